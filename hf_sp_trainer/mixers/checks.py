"""Behaviour checks of the installed kernels the SP mixers rely on (``swap.attach_mixers`` swaps a function only after
its check passes): each runs the installed function on a small input and compares it with what the SP version
assumes of it (affine in the initial state, a split with the state handed over equal to the whole run, ...).
``check_kernel`` runs transformers' torch path on the CPU and, for the ``DISPATCHED`` kernels, the kernel its hub
wrapper dispatches to (flash-linear-attention's, mamba-ssm's) where that can run here.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from ..attention.dsa import PROJECTIONS, document_causal, document_ids, selected_attention, sp_index_topk
from ..model.hub_functions import plain_function, torch_path
from ..sharding import SequenceSharding
from .block_checks import block_sparse_ok
from .check_parts import close, dispatch_device, on_device, random_module, rotary_embedding
from .doge_checks import doge_attention_ok
from .lightning import lightning_forward
from .mamba2 import run_decay, step_sizes
from .ple_checks import ngram_ok, ple_conv_ok
from .pooled_dsa_checks import pooled_attention_ok, pooled_indexer_ok
from .positional_dsa_checks import positional_attention_ok, positional_indexer_ok
from .qsa_checks import qsa_attention_ok, qsa_indexer_ok
from .rg_lru import recurrent_block_forward
from .runs import shard_runs
from .selective_scan import discretised_steps, state_output
from .v4_checks import v4_attention_ok

# Kernels whose SP version calls the installed function itself (``core`` / ``scan`` in ``swap``): with
# flash-linear-attention or mamba-ssm installed, the hub wrapper's dispatch target (the conv's SP version is our own
# torch conv). Checked on the device a model runs on, or on the CPU under Triton's interpreter.
DISPATCHED = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "mamba2_chunk_scan")
# Dispatched to a CUDA extension (mamba-ssm's ``selective_scan_fn``: no Triton, so not under the interpreter either).
CUDA_DISPATCHED = ("mamba_selective_scan",)
DSA_CHECK_KEY = "hf_sp_dsa_check"  # the attention key DSA's check registers (a plain kernel on the selected keys)


def check_fused_fallback(fn: Callable) -> None:
    """transformers' torch fallback of the fused whole-layer Mamba2 path (the hub wrapper's ``__wrapped__``) returns
    ``None``, which the layer reads as 'no fused path': what the SP entry returns under SP."""
    fallback = torch_path(fn)
    required = [
        p.name
        for p in inspect.signature(fallback).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if fallback(**dict.fromkeys(required)) is not None:
        raise ValueError(f"{fallback.__module__}.{fallback.__name__}'s torch fallback no longer returns None")


def parameter_device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def check_kernel(module_name: str, name: str, fn: Callable, device: torch.device | str | None = None) -> None:
    """Raise unless the installed ``fn`` still computes what its SP version relies on (a small input): transformers'
    torch path (``__wrapped__`` of its hub wrapper) on CPU, and, for the ``DISPATCHED`` kernels, ``fn`` itself as it
    will run for a model on ``device`` (``dispatch_device``): with flash-linear-attention or mamba-ssm installed, their
    kernel. Elsewhere (CPU without the interpreter) the torch path is what runs."""
    check = CHECKS.get(name)
    if check is None:
        return
    reference, installed = torch_path(fn), plain_function(fn)  # under SP the swap calls ``installed``
    runs = [(reference, "cpu", "")]
    target = dispatch_device(device)
    if target is not None and name in CUDA_DISPATCHED and not target.startswith("cuda"):
        target = None  # a CUDA extension: on the CPU (even under the interpreter) the torch path is all that runs
    if name in DISPATCHED + CUDA_DISPATCHED and target is not None and (installed is not reference or target != "cpu"):
        runs.append((installed, target, f" (the kernel it dispatches to, on {target})"))
    for impl, where, what in runs:
        if not check(impl, where):
            raise ValueError(
                f"{module_name}.{name}{what} no longer computes what hf_sp_trainer's sequence-parallel version of it "
                "assumes (this transformers or kernel package version changed it); use sp_size=1 for this model or "
                "a supported version."
            )


def check_module(cls: type, forward: Callable, attr: str = "forward") -> None:
    """Raise unless the installed ``cls.<attr>`` still computes what its SP replacement computes (a small
    instance of ``cls`` on a CPU input: each document alone, as the replacement runs it at sp_size 1)."""
    if not _MODULE_CHECKS[cls.__name__](cls, forward):
        raise ValueError(
            f"{cls.__module__}.{cls.__name__}.{attr} no longer computes what hf_sp_trainer's sequence-parallel "
            "version of it assumes (this transformers version changed it); use sp_size=1 for this model or a "
            "supported transformers."
        )


@functools.cache
def _lightning_ok(cls: type, forward: Callable) -> bool:
    """Two documents (of 10 and 9 tokens, blocks of 4: three blocks each, partial ones, a start inside one)
    through the replacement at sp_size 1 equal the installed forward run on each document alone."""
    module_globals = sys.modules[cls.__module__]
    config_cls = next(v for k, v in vars(module_globals).items() if k.endswith("Config") and isinstance(v, type))
    config = config_cls(
        hidden_size=16, num_attention_heads=2, head_dim=8, num_hidden_layers=2, block_size=4,
        layer_types=["linear_attention", "full_attention"], intermediate_size=16, vocab_size=8,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = cls(config, 0).float()
        hidden = torch.randn(1, 19, 16)
    with torch.no_grad():
        alone = torch.cat([forward(layer, hidden[:, s:e], None, None)[0] for s, e in ((0, 10), (10, 19))], dim=1)
        runs = shard_runs(torch.tensor([0, 10, 19]), 1, SequenceSharding(1), 0)
        padding = module_globals.apply_mask_to_padding_states
        ours = lightning_forward(layer, hidden, None, runs, None, padding)[0]
    return float((ours - alone).norm()) <= 1e-5 * float(alone.norm())


def _recurrent_gemma(cls: type, *args) -> torch.nn.Module:
    """A small ``cls`` (RecurrentGemma's recurrent block or RG-LRU: width 8, 2 heads) with random weights."""
    config_cls = next(v for k, v in vars(sys.modules[cls.__module__]).items() if k.endswith("Config"))
    config = config_cls(hidden_size=8, lru_width=8, num_attention_heads=2, conv1d_width=3, vocab_size=8)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = cls(config, *args).float()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.5)
    return module


@functools.cache
def _recurrent_block_ok(cls: type, forward: Callable) -> bool:
    """Two documents (of 7 and 6 tokens) through the replacement at sp_size 1 equal the installed forward (without
    a cache) on each alone."""
    block, hidden = _recurrent_gemma(cls, 0), torch.randn(1, 13, 8, generator=torch.Generator().manual_seed(0))
    docs = ((0, 7), (7, 13))
    with torch.no_grad():
        alone = [
            forward(block, hidden[:, s:e], position_ids=torch.arange(e - s)[None], attention_mask=None, use_cache=False)
            for s, e in docs
        ]
        positions = torch.cat([torch.arange(e - s) for s, e in docs])[None]
        runs = shard_runs(torch.tensor([0, 7, 13]), 1, SequenceSharding(1), 0)
        ours = recurrent_block_forward(block, hidden, positions, runs, None, {})[0]
    return close(ours, torch.cat([out for out, _ in alone], dim=1))


@functools.cache
def _rnn_scan_ok(cls: type, scan: Callable) -> bool:
    """The RG-LRU scan is the diagonal recurrence SP folds: from a state ``S`` it adds ``cumprod(a) ⊙ S``, its final
    state ``prod(a) ⊙ S``, and a split with the state handed over equals the whole run."""
    gen = torch.Generator().manual_seed(0)
    x, a, s0 = torch.randn(1, 9, 8, generator=gen), 0.4 + 0.5 * torch.rand(1, 9, 8, generator=gen), torch.randn(1, 8)
    reset = torch.zeros(1, 9, 1, dtype=torch.bool)
    layer = _recurrent_gemma(cls)

    def run(lo: int, hi: int, state: torch.Tensor | None):
        return scan(layer, hidden_states=x[:, lo:hi], recurrent_gate=a[:, lo:hi], reset=reset[:, lo:hi],
                    recurrent_states=state)  # fmt: skip

    whole, last = run(0, 9, s0)
    zero, last_zero = run(0, 9, None)
    head, mid = run(0, 4, s0)
    rest, end = run(4, 9, mid)
    return (
        close(whole, zero + a.cumprod(1) * s0[:, None])
        and close(last, last_zero + a.prod(1) * s0)
        and close(torch.cat([head, rest], 1), whole)
        and close(end, last)
    )


def _dsa_parts(cls: type):
    """A small DeepSeek-V3.2-shaped config of ``cls``'s modeling module (top-4 of 9- and 11-token documents; 8
    indexer heads: no score ties at the 4th place), ``cls(config, 0)`` with random weights, its rotary embedding."""
    modeling = sys.modules[cls.__module__]
    family = cls.__name__.removesuffix("Attention").removesuffix("Indexer")  # e.g. Dots3NoteText
    config_cls = (  # a VLM's decoder (HY-V4-VL): its text config
        getattr(modeling, f"{family}TextConfig", None)
        or getattr(modeling, f"{family}Config", None)
        or next(v for k, v in vars(modeling).items() if k.endswith("Config") and isinstance(v, type))
    )
    sizes = dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, index_n_heads=8, index_head_dim=8, index_topk=4,
        num_hidden_layers=1, intermediate_size=16, vocab_size=8,
    )  # fmt: skip
    if "layer_types" in getattr(config_cls, "__dataclass_fields__", {}):  # Dots3-Note: DSA on its indexed layers
        sizes["layer_types"] = ["indexed_attention"]
    if "mrope_section" in getattr(config_cls, "ignore_keys_at_rope_validation", ()):  # t / h / w over 2 frequencies
        sizes["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]}
    config = config_cls(**sizes)
    config._attn_implementation = "eager"  # HY-V4's sinks: eager only
    module, rotary = random_module(cls, config), rotary_embedding(cls, config)
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # per layer type (Dots3-Note)
        return module, functools.partial(rotary, layer_type=config.layer_types[0])
    return module, rotary


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@functools.cache
def _dsa_indexer_ok(cls: type, forward: Callable) -> bool:
    """Two packed documents (9 and 11 tokens) through ``sp_index_topk`` (no group) select, among each query's visible
    keys, the keys the installed indexer selects on each document alone."""
    indexer, rotary = _dsa_parts(cls)
    gen = torch.Generator().manual_seed(0)
    hidden, q_resid = torch.randn(1, 20, 32, generator=gen), torch.randn(1, 20, 16, generator=gen)
    docs = ((0, 9), (9, 20))
    with torch.no_grad():
        expected = torch.zeros(20, 20, dtype=torch.bool)
        for s, e in docs:
            n = e - s
            embeddings = rotary(hidden[:, s:e], torch.arange(n)[None])
            picks = forward(indexer, hidden[:, s:e], q_resid[:, s:e], embeddings, _causal(n)[None], None)
            chosen = torch.zeros(n, n, dtype=torch.bool).scatter_(-1, picks[0].long(), True)
            expected[s:e, s:e] = chosen & _causal(n)
        positions = torch.cat([torch.arange(e - s) for s, e in docs])[None]
        projected = PROJECTIONS[cls.__name__](indexer, hidden, q_resid, rotary(hidden, positions))
        bounds = torch.tensor([0, 9, 20])
        picks = sp_index_topk(indexer, projected, bounds, None, 0)
        got = torch.zeros(20, 20, dtype=torch.bool).scatter_(-1, picks[0].long(), True)
        got &= document_causal(document_ids(bounds, 1, 20, "cpu"), torch.arange(20))[0]
    return bool(expected.any()) and torch.equal(got, expected)


@functools.cache
def _dsa_attention_ok(cls: type, forward: Callable) -> bool:
    """The installed forward hands its indexer's top-k to a non-eager kernel as ``indices=`` (given the mask it
    slices for the indexer): with ``selected_attention`` as that kernel it equals its own eager path on a document."""
    layer, rotary = _dsa_parts(cls)
    hidden = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(0))
    embeddings, bounds = rotary(hidden, torch.arange(11)[None]), torch.tensor([0, 11])
    causal = torch.zeros(11, 11).masked_fill(~_causal(11), torch.finfo(torch.float32).min)[None, None]  # additive

    handed = []

    def kernel(module, q, k, v, mask, dropout=0.0, scaling=None, indices=None, s_aux=None, **kwargs):
        handed.append(indices is not None)
        if indices is None:  # what SP's attention would then attend: every visible key
            indices = torch.arange(q.shape[2]).expand(q.shape[0], q.shape[2], -1)
        return selected_attention(q, k, v, indices, bounds, scaling, sinks=s_aux), None

    AttentionInterface.register(DSA_CHECK_KEY, kernel)
    with torch.no_grad():
        reference = forward(layer, hidden_states=hidden, position_embeddings=embeddings, attention_mask=causal)[0]
        layer.config._attn_implementation = DSA_CHECK_KEY
        ours = forward(layer, hidden_states=hidden, position_embeddings=embeddings, attention_mask=causal)[0]
    return handed == [True] and close(ours, reference)


_MODULE_CHECKS: dict[str, Callable[[type, Callable], bool]] = {
    "DeepseekV32Attention": _dsa_attention_ok,
    "DeepseekV32Indexer": _dsa_indexer_ok,
    "GlmMoeDsaAttention": _dsa_attention_ok,
    "GlmMoeDsaIndexer": _dsa_indexer_ok,
    "AXK2Attention": _dsa_attention_ok,
    "AXK2Indexer": _dsa_indexer_ok,
    "HYV4Attention": _dsa_attention_ok,
    "HYV4Indexer": _dsa_indexer_ok,
    "HYV4VLAttention": _dsa_attention_ok,
    "HYV4VLIndexer": _dsa_indexer_ok,
    "Glm5NextTextAttention": pooled_attention_ok,  # pooled_dsa_checks.py
    "Glm5NextTextIndexer": pooled_indexer_ok,
    "Dots3NoteTextAttention": _dsa_attention_ok,
    "Dots3NoteTextIndexer": _dsa_indexer_ok,
    "MistralLarge4TextAttention": positional_attention_ok,  # positions, NoPE, shared top-k: positional_dsa_checks
    "MistralLarge4TextIndexer": positional_indexer_ok,
    "Qwen4ExpTextAttention": qsa_attention_ok,  # qsa_checks.py
    "Qwen4ExpTextQSAIndexer": qsa_indexer_ok,
    "Qwen4ExpTextNGramEmbedding": ngram_ok,  # ple_checks.py
    "Qwen4ExpTextPLELayer": ple_conv_ok,
    "DeepseekV4Attention": v4_attention_ok,  # v4_checks.py
    "DogeAttention": doge_attention_ok,  # doge_checks.py
    "MiniMaxM3VLIndexer": block_sparse_ok,  # and its attention's hand-over: block_checks.py
    "MiniMaxLightningAttention": _lightning_ok,
    "RecurrentGemmaRecurrentBlock": _recurrent_block_ok,
    "RecurrentGemmaRglru": _rnn_scan_ok,
}


@functools.cache
def _conv_ok(fn: Callable, device: str = "cpu") -> bool:
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 7, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    x, w, b = on_device(device, x, w, b)
    expected = F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=3, groups=3)[..., :7])
    return torch.allclose(fn(x, w, bias=b, activation="silu"), expected, atol=1e-6)  # only run on CPU


@functools.cache
def _gdn_ok(fn: Callable, device: str = "cpu", channel_decay: bool = False) -> bool:
    """Affine in the initial state, column by column: what the SP delta rule's ``[v | 0]`` / ``[0 | I]`` call uses
    (``channel_decay``: KDA's decay per key channel, ``g [b, s, heads, k]``); and a split with the state handed over
    equal to the whole run (a kernel ignoring ``initial_state`` is affine too)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 10, 2, 16, generator=gen)
    v, zeros = torch.randn(1, 10, 2, 16, generator=gen), torch.zeros(1, 10, 2, 16)
    g = -torch.rand(1, 10, 2, *((16,) if channel_decay else ()), generator=gen)
    beta, s0 = torch.rand(1, 10, 2, generator=gen), torch.randn(1, 2, 16, 16, generator=gen)
    q, k, v, zeros, g, beta, s0 = on_device(device, q, k, v, zeros, g, beta, s0)
    run = functools.partial(fn, chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = run(q, k, v, g=g, beta=beta, initial_state=s0)  # past q, k, v by name: FLA's differ from ours
    out_v, final_v = run(q, k, v, g=g, beta=beta, initial_state=None)
    out_s, final_s = run(q, k, zeros, g=g, beta=beta, initial_state=s0)
    first, mid = run(q[:, :6], k[:, :6], v[:, :6], g=g[:, :6], beta=beta[:, :6], initial_state=s0)
    rest, end = run(q[:, 6:], k[:, 6:], v[:, 6:], g=g[:, 6:], beta=beta[:, 6:], initial_state=mid)
    return (
        close(out, out_v + out_s)
        and close(final, final_v + final_s)
        and close(torch.cat([first, rest], 1), out)
        and close(end, final)
    )


@functools.cache
def _mamba2_ok(fn: Callable, device: str = "cpu") -> bool:
    """Affine in the initial state with the per-head decay ``exp(A sum dt)`` of ``step_sizes`` (``dt_bias``,
    softplus, the clamp: a limit that bites), and a split with the state handed over equal to the whole scan."""
    gen = torch.Generator().manual_seed(0)
    x, zeros = torch.randn(1, 11, 2, 8, generator=gen), torch.zeros(1, 11, 2, 8)
    dt, A = torch.randn(1, 11, 2, generator=gen), -torch.rand(2, generator=gen) - 0.5
    B, C = torch.randn(2, 1, 11, 1, 16, generator=gen)
    D, bias, s0 = torch.randn(2, generator=gen), torch.randn(2, generator=gen), torch.randn(1, 2, 8, 16, generator=gen)
    x, zeros, dt, A, B, C, D, bias, s0 = on_device(device, x, zeros, dt, A, B, C, D, bias, s0)
    opts = dict(chunk_size=8, dt_bias=bias, dt_softplus=True, dt_limit=(0.2, 1.5), return_final_states=True)
    out, final = fn(x, dt=dt, A=A, B=B, C=C, D=D, initial_states=s0, **opts)  # past x by name: mamba_ssm's differs
    out_x, final_x = fn(x, dt=dt, A=A, B=B, C=C, D=D, initial_states=None, **opts)
    out_s, _ = fn(zeros, dt=dt, A=A, B=B, C=C, D=None, initial_states=s0, **opts)
    decay = run_decay(A, step_sizes(dt, bias, True, (0.2, 1.5))[0])[:, None, None]
    head, tail = fn(x[:, :5], dt=dt[:, :5], A=A, B=B[:, :5], C=C[:, :5], D=D, initial_states=s0, **opts)
    rest, end = fn(x[:, 5:], dt=dt[:, 5:], A=A, B=B[:, 5:], C=C[:, 5:], D=D, initial_states=tail, **opts)
    return (
        close(out, out_x + out_s)
        and close(final, final_x + decay * s0)
        and close(torch.cat([head, rest], 1), out)
        and close(end, final)
    )


@functools.cache
def _selective_ok(fn: Callable, device: str = "cpu") -> bool:
    """Mamba1's scan in two parts, the second from zero plus what the first's final state adds to it (``state_output``,
    gated: the closed form the SP scan uses, with ``delta_bias`` and softplus), equals the whole scan; its final state
    is the second part's plus ``exp(A ⊙ sum dt)`` times the first's."""
    gen = torch.Generator().manual_seed(0)
    u, delta, z = torch.randn(3, 1, 4, 11, generator=gen)
    A, B, C = -torch.rand(4, 3, generator=gen) - 0.5, *torch.randn(2, 1, 3, 11, generator=gen)
    D, bias = torch.randn(2, 4, generator=gen)
    u, delta, z, A, B, C, D, bias = on_device(device, u, delta, z, A, B, C, D, bias)
    opts = dict(D=D, delta_bias=bias, delta_softplus=True, return_last_state=True)
    whole, last = fn(u, delta, A, B, C, z=z, **opts)  # by position: mamba-ssm names them u, delta
    head, mid = fn(u[..., :5], delta[..., :5], A, B[..., :5], C[..., :5], z=z[..., :5], **opts)
    rest, end = fn(u[..., 5:], delta[..., 5:], A, B[..., 5:], C[..., 5:], z=z[..., 5:], **opts)
    steps = discretised_steps(delta[..., 5:], bias, True)
    carried = state_output(A, steps, C[..., 5:], mid.float()) * F.silu(z[..., 5:])
    decay = torch.exp(A * steps[0].sum(-1)[:, None])
    return close(torch.cat([head, rest + carried], -1).float(), whole.float()) and close(
        (end.float() + decay * mid.float()), last.float()
    )


CHECKS: dict[str, Callable[[Callable, str], bool]] = {  # (the function, the device to run it on) -> ok
    "causal_conv1d_fn": _conv_ok,
    "torch_chunk_gated_delta_rule": _gdn_ok,
    "mamba2_chunk_scan": _mamba2_ok,
    "mamba_selective_scan": _selective_ok,
    "chunk_kimi_delta_attention": lambda fn, device: _gdn_ok(fn, device, channel_decay=True),
}
