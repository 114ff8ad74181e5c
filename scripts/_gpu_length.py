"""GPU check of the length-dependent settings under SP (``attention/position_rules.py``), for ``gpu_check.py``.

A whole model step on one packed row of three documents, against each document alone through the model's own forward
(sdpa) on the same device and dtype: the loss and every gradient. On CUDA SP's kernel is torch's varlen attention
(one call per layer, ``cu_seqlens`` from the layout, the chunk layout on Llama-4's chunked layers), which the CPU
tests can't run.

- llama4: chunked attention (chunk 64; 8 dry) and the NoPE temperature (floor 64; 4 dry, ``attn_scale`` 1), documents
  crossing both;
- phi3_longrope: longrope with its threshold between the first shard's positions and the longest document, one
  document per row (one device decides per row);
- deepseek_v32_dsa: DeepSeek sparse attention, its indexer's top-k (64; 8 dry) under every document (SP's
  ``attention/dsa.py``: the selected keys through sdpa with a boolean mask, in query tiles).
- qwen4_exp_qsa: Qwen4-Exp's query-sparse attention, a budget of 64 tokens (8 dry) in blocks of 4 under every
  document (``attention/qsa.py``), beside a Gated DeltaNet layer with a PLE layer (hashed n-grams, a dilated conv:
  ``mixers/token_history.py``).
- deepseek_v4: DeepSeek-V4's window (64; 7 dry) and compressed entries (CSA every 4 tokens with the top 16, HCA every
  32; 2 / 4 / 8 dry) under every document (``attention/deepseek_v4.py``: context-parallel, all heads per rank).

sp 1 runs on one rank; sp 2 is two processes sharing the one GPU over gloo, Ulysses.

bf16 also runs the each-document-alone reference in fp32 on the same weights (the bf16 model is the fp32 one's
weights rounded): a bf16 case passes if its ``worst`` (vs the bf16 reference) is within ``TOL``, or if SP's error
against the fp32 reference is at most 1.25x transformers' own bf16 error against it (``ours_vs_fp32`` vs
``ref_vs_fp32``; ``rule`` says which passed) - a top-k (DSA's indexer) flips at near-ties under bf16 rounding, so two
bf16 runs that differ only in rounding need not agree within ``TOL``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _gpu_steps import TOL, grads, loss_sum, run_worlds, start_rank, summed_over, within_tol, worst


def _model(case: str, dry: bool, device: torch.device, dtype: torch.dtype):
    import transformers

    small = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if case == "llama4":
        chunk = 8 if dry else 64
        config = transformers.Llama4TextConfig(
            **small, num_hidden_layers=4, moe_layers=[], intermediate_size_mlp=256, attention_chunk_size=chunk,
            floor_scale=4 if dry else 64, attn_scale=1.0,
        )  # fmt: skip
        cls = transformers.Llama4ForCausalLM
    elif case == "deepseek_v32_dsa":  # the indexer's top-k (64; 8 dry) under every document, 16 indexer heads
        mla = dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        config = transformers.DeepseekV32Config(
            **{**small, "num_key_value_heads": 4}, **mla, num_hidden_layers=2, first_k_dense_replace=2,
            index_n_heads=16, index_head_dim=32, index_topk=8 if dry else 64,
        )  # fmt: skip
        cls = transformers.DeepseekV32ForCausalLM
    elif case == "qwen4_exp_qsa":  # 16 indexer heads: no exact zero-score ties at the k-th block
        gdn = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
        config = transformers.Qwen4ExpTextConfig(
            **small, **gdn, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, indexer_n_heads=16, indexer_kv_heads=1,
            indexer_head_dim=32, indexer_budget=8 if dry else 64, indexer_compress_ratio=4, ple_layer_ids=[1],
            ngram_vocab_size_base=64,
        )  # fmt: skip
        cls = transformers.Qwen4ExpForCausalLM
    elif case == "deepseek_v4":  # eager only (its sinks); 16 indexer heads
        rates = {"compressed_sparse_attention": 2 if dry else 4, "heavily_compressed_attention": 8 if dry else 32}
        config = transformers.DeepseekV4Config(
            **{**small, "num_key_value_heads": 1}, num_hidden_layers=2, qk_rope_head_dim=16, q_lora_rank=64,
            o_groups=2, o_lora_rank=32, sliding_window=7 if dry else 64, compress_rates=rates,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], mlp_layer_types=["moe"] * 2,
            index_n_heads=16, index_head_dim=32, index_topk=4 if dry else 16, num_local_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64,
        )  # fmt: skip
        cls = transformers.DeepseekV4ForCausalLM
    else:
        threshold = 24 if dry else 1024
        short, long = [1.0 + i / 16 for i in range(16)], [2.0 + i / 8 for i in range(16)]
        rope = dict(rope_type="longrope", original_max_position_embeddings=threshold, rope_theta=10000.0,
                    short_factor=short, long_factor=long)  # fmt: skip
        config = transformers.Phi3Config(
            **small, num_hidden_layers=2, rope_parameters=rope, original_max_position_embeddings=threshold
        )
        cls = transformers.Phi3ForCausalLM
    torch.manual_seed(0)
    attn = "eager" if case == "deepseek_v4" else "sdpa"
    return cls._from_config(config, attn_implementation=attn, dtype=dtype).to(device).train()


def _rows(case: str, dry: bool) -> list[list[int]]:
    """Document lengths per row: Llama-4 one packed row; longrope one document per row, past the threshold."""
    if case in ("llama4", "deepseek_v32_dsa", "qwen4_exp_qsa", "deepseek_v4"):
        return [[40, 13, 60]] if dry else [[700, 150, 1200]]
    return [[40]] if dry else [[1800]]


def _alone(model, rows: list[list[torch.Tensor]], device: torch.device) -> tuple[float, dict]:
    """The reference: the loss summed over each document run alone through the model, and every gradient."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for doc in (doc for docs in rows for doc in docs):
        ids = doc[None].to(device)
        total = total + loss_sum(model(input_ids=ids).logits, F.pad(ids[:, 1:], (0, 1), value=-100))
    total.backward()
    ref = (total.item(), grads(model))
    model.zero_grad(set_to_none=True)
    return ref


def _vs_fp32(rec: dict[str, Any], ref: tuple[float, dict], got: tuple[float, dict], ref32: tuple[float, dict]):
    """bf16: ``rec`` (SP vs the bf16 reference) with both runs' errors against the fp32 reference and the rule."""
    ours, theirs = worst(ref32, got), worst(ref32, ref)
    rec |= {"ours_vs_fp32": ours["worst"], "ours_vs_fp32_where": ours["where"],
            "ref_vs_fp32": theirs["worst"], "ref_vs_fp32_where": theirs["where"]}  # fmt: skip
    if rec["worst"] <= TOL["bfloat16"]:
        return rec | {"within_tol": True, "rule": "tol"}
    if ours["worst"] <= 1.25 * theirs["worst"]:
        return rec | {"within_tol": True, "rule": "vs_fp32"}
    return rec | {"within_tol": False, "rule": None}


def _exact(case: str, world: int, device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    from hf_sp_trainer import apply_sequence_parallel

    gen = torch.Generator().manual_seed(1)
    rows = [[torch.randint(3, 256, (n,), generator=gen) for n in docs] for docs in _rows(case, dry)]
    ref32 = None
    model = _model(case, dry, device, dtype)
    if dtype != torch.float32:  # the fp32 reference on the same weights: this model holds them rounded
        model32 = _model(case, dry, device, torch.float32)
        ref32 = _alone(model32, rows, device)
        model.load_state_dict(model32.state_dict())  # copied into the model's own dtypes (buffers as built)
        del model32
    ref = _alone(model, rows, device)
    with apply_sequence_parallel(model, world) as sp:
        loss = torch.zeros((), device=device)
        for docs in rows:
            ids = torch.cat(docs)[None]
            positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
            labels = ids.masked_fill(positions == 0, -100)
            shard = sp.shard_batch({"input_ids": ids, "position_ids": positions, "labels": labels})
            shard = {k: v.to(device) for k, v in shard.items() if torch.is_tensor(v)}
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            step = loss_sum(logits, shard["shift_labels"])
            step.backward()
            loss = loss + step.detach()
        got = summed_over(sp.topology.sp_group, loss, grads(model))
        kernel = sp.attention.kernel
    rec = worst(ref, got) | {"kernel": kernel, "documents": _rows(case, dry)}
    return within_tol(rec, dtype) if ref32 is None else _vs_fp32(rec, ref, got, ref32)


def _worker(rank: int, world: int, port: int, device: str, dry: bool, out_path: str) -> None:
    import json

    from _bench_common import end_spawned_worker

    dev = start_rank(rank, world, port, device)
    out: dict[str, Any] = {}
    for case in ("llama4", "phi3_longrope", "deepseek_v32_dsa", "qwen4_exp_qsa", "deepseek_v4"):
        for dtype in [torch.float32, torch.bfloat16] if dev.type == "cuda" else [torch.float32]:
            name = f"{case}_sp{world}_{str(dtype).removeprefix('torch.')}"
            try:
                out[name] = _exact(case, world, dev, dtype, dry)
            except Exception as exc:  # noqa: BLE001 - recorded; the next case still runs
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f, default=str)
    end_spawned_worker()


def length_checks(device: torch.device, dry: bool) -> dict[str, Any]:
    """sp 1 and sp 2 (two processes on the device): ``{case: figures}``, ``within_tol`` over all of them."""
    out = run_worlds(_worker, device, dry)
    cases = [v for v in out.values() if isinstance(v, dict)]
    out["within_tol"] = bool(cases) and all(v.get("within_tol", False) for v in cases)
    return out
