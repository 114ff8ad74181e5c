"""What the tier's spawned gloo ranks run: tiny hybrid models whose linear-attention / SSM layers dispatch to FLA's
and mamba_ssm's Triton kernels (interpreted on CPU), under SP and after SP was removed, against transformers' torch
path on each document alone (``kernels.torch_path``). Importing this module installs the interpreter shims (a spawned
rank imports it before anything else of the tier)."""

from __future__ import annotations

import contextlib
import copy
import datetime
import time
import traceback
from collections.abc import Iterator

from tests.interpreter import shims

shims.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.family_harness import _reference, _sp_run, compare  # noqa: E402
from tests.harness import VOCAB, tiny_model, weak_decay  # noqa: E402
from tests.interpreter.kernels import torch_path  # noqa: E402

ROWS = ((5, 11, 8), (24,))  # at sp 2 the second document straddles the shards; a whole shard continues a document
KINDS = {  # kernel -> the tiny model whose layers run it
    "gdn": "qwen3_5 (FLA chunk_gated_delta_rule)",
    "kda": "kimi_linear (FLA chunk_kda)",
    "mamba2": "granitemoehybrid (mamba_ssm mamba_chunk_scan_combined)",
}


def tiny(kind: str, seed: int = 0):
    """A 2-layer model (a mixer layer, then attention), fp32, weak decay (state reaches across documents and ranks)."""
    if kind == "gdn":  # grouped value heads: 2 value heads share one key head
        return tiny_model("qwen3_5", seed, linear_num_key_heads=1, linear_num_value_heads=2)
    if kind == "mamba2":  # chunks of 16: a document of 24 tokens spans two inside the kernel
        model = tiny_model("granitemoehybrid", seed, mamba_chunk_size=16, mamba_n_heads=2, mamba_expand=1)
        with torch.no_grad():  # at the default init the D skip carries all but 1e-5 of the output: the SSM must count
            for layer in (m for m in model.modules() if hasattr(m, "in_proj") and hasattr(m, "D")):
                layer.in_proj.weight.mul_(30.0)
                layer.D.mul_(0.1)
        return model
    import transformers

    config = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, use_cache=False,
        layer_types=["linear_attention", "full_attention"],
        linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    weak_decay(model, seed)
    return model.float()


def rows(seed: int = 1) -> list[list[torch.Tensor]]:
    """Random documents of ``ROWS``' lengths, one list per packed row."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, VOCAB, (n,), generator=g) for n in docs] for docs in ROWS]


def sp_case(kind: str, sp_size: int, ring_size: int | None = None, train: bool = False) -> dict:
    """The packed rows under SP (the Triton kernels) vs each document alone on transformers' torch path: the worst
    relative error of the loss and every gradient (``family_harness.compare``)."""
    from hf_sp_trainer import apply_sequence_parallel

    model = tiny(kind).train(train)
    data = rows()
    reference = copy.deepcopy(model)
    with torch_path(reference) as switched:
        assert switched, f"{kind}: no kernel function to switch to the torch path"
        refs = [_reference(reference, docs) for docs in data]
    sp = apply_sequence_parallel(model, sp_size, ring_size=ring_size)
    try:
        worst, where = max(compare(ref, _sp_run(model, sp, docs)) for ref, docs in zip(refs, data, strict=True))
    finally:
        sp.remove()
    return {"err": worst, "where": where, "varlen": _entry_takes_varlen(model)}


def _entry_takes_varlen(model) -> bool | None:
    """Whether the SP entry runs ``model``'s installed kernel through its varlen path (the entry's own decision:
    ``varlen_checks.varlen_capable`` for the delta rules' ``cu_seqlens``, ``varlen_checks.seq_idx_capable`` for
    Mamba2's ``seq_idx``); ``None``: neither kernel."""
    import sys

    from hf_sp_trainer import patches
    from hf_sp_trainer.mixers.varlen_checks import seq_idx_capable, varlen_capable

    module = sys.modules[type(model.model).__module__]
    for name, channel_decay in (("torch_chunk_gated_delta_rule", False), ("chunk_kimi_delta_attention", True)):
        if hasattr(module, name):
            return varlen_capable(patches.original(module, name), "cpu", channel_decay)
    if hasattr(module, "mamba2_chunk_scan"):
        return seq_idx_capable(patches.original(module, "mamba2_chunk_scan"), "cpu")
    return None


def _loss_and_grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return loss.item(), grads


def _generate(model, prompt: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        prompt, max_new_tokens=3, do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
        pad_token_id=0,
    )  # fmt: skip
    return torch.stack(out.logits)


def after_sp_case(kind: str, sp_size: int) -> dict:
    """SP attached, then removed: a plain forward + backward (the kernels without SP bounds: our entries call the
    library by keyword) and a short cached ``generate`` (prefill through the chunk kernel with a final state, then
    the decode-only recurrent kernels) equal transformers' torch path."""
    from hf_sp_trainer import apply_sequence_parallel

    model = tiny(kind).eval()
    apply_sequence_parallel(model, sp_size).remove()
    ids = rows(seed=2)[1][0][None]  # one document of 24 tokens
    got = _loss_and_grads(model, ids)
    got_logits = _generate(model, ids[:, :7])
    with torch_path(model):
        ref = _loss_and_grads(model, ids)
        ref_logits = _generate(model, ids[:, :7])
    worst, where = compare(ref, got)
    generate_err = float((got_logits - ref_logits).norm() / ref_logits.norm())
    out = {"err": worst, "where": where, "generate_err": generate_err}
    if kind == "mamba2":  # training mode without SP: mamba_ssm's fused whole-layer path, which needs causal_conv1d
        model.train()
        try:
            model(input_ids=ids)
            out["fused_train_path"] = "ran"
        except Exception as exc:  # noqa: BLE001 - what happens is the finding
            out["fused_train_path"] = f"{type(exc).__name__}: {exc}"
    return out


def kernel_case(kernel: str, docs: list[int], ring_size: int = 1, varlen: bool = False, chunk: int = 64) -> dict:
    """``tests/mixer_harness.py``'s kernel-level delta-rule check (``kernel``: "gdn" or "kda") with the installed
    kernel (FLA's, through transformers' hub wrapper) as the SP core and as the per-document reference: the output
    and the gradients of q, k, v, g and beta; ``varlen``: FLA's ``cu_seqlens`` path (one call per list of segments,
    its calls in ``kernel_calls``)."""
    from tests import mixer_harness

    diffs = mixer_harness.check_gdn([docs], ring_size, heads=2, k_heads=1, kda=kernel == "kda", varlen=varlen)
    calls = diffs.pop(mixer_harness.KERNEL_CALLS, None)
    where = max(diffs, key=diffs.get)
    return {"err": diffs[where], "where": where, "kernel_calls": calls}


@contextlib.contextmanager
def train_head_calls() -> Iterator[list]:
    """Inside: the list of LM-head-shaped outputs (``VOCAB`` columns) computed in training mode; none when Liger
    computes the loss (it takes the head's weight), one per chunk and recomputation for the chunked torch loss."""
    calls: list = []

    def hook(module, _args, output) -> None:
        if module.training and isinstance(output, torch.Tensor) and output.ndim >= 2 and output.shape[-1] == VOCAB:
            calls.append(type(module).__name__)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def trainer_case(case) -> dict:
    """``tests/harness.py``'s SPTrainer run of ``case`` (fused_loss: Liger's kernel), with ``train_head_calls``."""
    from tests.harness import run_cases

    with train_head_calls() as calls:
        result = run_cases([case])[case.name]
    return {**result, "train_head_calls": len(calls)}


def mamba2_kernel_case(docs: list[int], ring_size: int = 1, varlen: bool = False) -> dict:
    """``tests/mixer_harness.py``'s kernel-level Mamba2 check with the installed scan (mamba_ssm's, through
    transformers' hub wrapper) as the SP scan and the per-document reference; ``varlen``: its ``seq_idx`` path (one
    call per run, its calls in ``kernel_calls``)."""
    from tests import mixer_harness

    diffs = mixer_harness.check_mamba2(docs, ring_size, varlen=varlen)
    calls = diffs.pop(mixer_harness.KERNEL_CALLS, None)
    where = max(diffs, key=diffs.get)
    return {"err": diffs[where], "where": where, "kernel_calls": calls}


CASES = {
    "sp": sp_case, "after_sp": after_sp_case, "kernel": kernel_case, "mamba2_kernel": mamba2_kernel_case,
    "trainer": trainer_case,
}  # fmt: skip


def serve(cases: list[tuple[str, str, dict]]) -> dict[str, dict]:
    """In a spawned gloo world: every ``(name, kind, kwargs)`` case (``kind``: a key of ``CASES``) in turn, inside
    ``cuda_calls_on_cpu`` (mamba_ssm); a case that raises is recorded, agreed over the ranks, and the next one runs."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    from transformers.utils import logging

    logging.set_verbosity_error()
    out = {}
    with shims.cuda_calls_on_cpu():
        for name, kind, kwargs in cases:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                result = CASES[kind](**kwargs)
            except Exception as exc:  # noqa: BLE001 - reported by the test of this case
                result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            result["seconds"] = round(time.perf_counter() - start, 1)
            result["cpu_seconds"] = round(time.process_time() - cpu, 1)  # the wall time on an idle core
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, result)
            out[name] = next((r for r in everyone if "error" in r), everyone[0])
    return out
