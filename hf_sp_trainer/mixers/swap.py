"""Plugging the SP mixers into transformers' hybrid layers, in one place.

transformers' hybrid layers call module-level kernel functions of their modeling module (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ...) with the decoder's ``**kwargs``, which under SP carry the whole sequence's
document bounds. ``attach_mixers`` swaps each such function of the model's modeling modules, through the patch
registry (``hf_sp_trainer.patches``), for an entry that runs the exact SP version when those bounds are present (an
SP forward) and transformers' function otherwise. A function is swapped only after a check on a small input that the
installed one still computes what the SP version relies on (``check_kernel``: transformers' torch path, and the kernel
its hub wrapper dispatches to where that can run here); a test fails loudly when a release moves or changes one.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import patches
from ..documents import (
    BOUNDS_KWARG,
    SP_KWARG,
    DocumentHook,
    in_sp_forward,
    refuse_without_documents,
    scoped_sp_kwargs,
)
from ..memory.checkpointing import recompute_region, scope_checkpointed_layers
from ..model.hub_functions import function_name, plain_function
from ..model.mixers import (
    DECODE_ONLY_KERNELS,
    LAYER_FUNCTIONS,
    SP_KERNELS,
    SP_MODULES,
)
from ..sharding import SequenceSharding
from ..topology import SPTopology
from .causal_conv import sp_causal_conv1d
from .checks import (
    CHECKS,
    check_fused_fallback,
    check_kernel,
    check_module,
    parameter_device,
)
from .gated_deltanet import sp_chunk_gated_delta_rule
from .hub_layers import check_cache_argument, check_layer_function, hub_layer_check
from .lightning import lightning_forward
from .mamba2 import sp_mamba2_chunk_scan
from .rg_lru import recurrent_block_forward, sp_rnn_scan
from .runs import shard_runs
from .selection import (
    block_indexer_entry,
    doge_attention_entry,
    dsa_attention_entry,
    dsa_indexer_entry,
    pooled_attention_entry,
    pooled_indexer_entry,
    positional_indexer_entry,
    qsa_attention_entry,
    qsa_indexer_entry,
    v4_attention_entry,
)
from .selective_scan import sp_selective_scan
from .token_history import document_ngrams, sp_dilated_conv, whole_ids
from .varlen_checks import seq_idx_capable, varlen_capable

STATE_PASSING = ("gather", "relay")  # linear_state.py (the default) and relay.py (a debugging aid)


def check_state_passing(state_passing: str) -> None:
    """``sp_state_passing`` must name one of ``STATE_PASSING``."""
    if state_passing not in STATE_PASSING:
        raise ValueError(
            f"sp_state_passing={state_passing!r} is not one of {list(STATE_PASSING)}: 'gather' (the default) or "
            "'relay' (a sequential debugging aid)."
        )


@dataclass
class MixerContext:
    """Where this process's tokens sit: its SP topology, or ``None`` at sp_size 1 (the whole sequence, no group),
    and how recurrent state crosses the ranks (``STATE_PASSING``)."""

    topology: SPTopology | None
    sharding: SequenceSharding
    state_passing: str = "gather"

    @property
    def relay(self) -> bool:
        return self.state_passing == "relay"

    @property
    def group(self):
        return None if self.topology is None else self.topology.sp_group

    def runs(self, bounds: torch.Tensor, rows: int):
        return shard_runs(bounds, rows, self.sharding, 0 if self.topology is None else self.topology.sp_rank)


def _sp_call(kwargs: dict, kernel: str) -> tuple[torch.Tensor | None, MixerContext | None]:
    """The documents and the mixer context of the model being run, which its decoder pre-hook passes down (popped
    from ``kwargs``; where a model, layer or mixer drops its kwargs, those its decoder passed down:
    ``documents.scoped_sp_kwargs``); ``(None, None)`` outside an SP forward (no pre-hook, or cached decoding).
    Inside one, ``kernel`` reached without them raises: its installed version would mix the documents and shards."""
    bounds, context = kwargs.pop(BOUNDS_KWARG, None), kwargs.pop(SP_KWARG, None)
    if bounds is None:
        scoped = scoped_sp_kwargs()
        bounds, context = scoped.get(BOUNDS_KWARG), scoped.get(SP_KWARG)
    mixers = (context or {}).get("mixers")
    if bounds is None or mixers is None:
        refuse_without_documents(kernel)
        return None, None
    return bounds, mixers


def _sp_active(kwargs: dict) -> bool:
    """An SP forward (or documents kept apart) is running the caller: bounds in its kwargs or its layer's, or the
    caller runs in such a model's forward outside its decoder."""
    return kwargs.get(BOUNDS_KWARG) is not None or in_sp_forward()


def _wraps(original: Callable):
    """``functools.wraps`` of the function beneath ``original`` (a hub function is an ``nn.Module`` instance)."""
    return functools.wraps(plain_function(original))


def _conv_entry(original: Callable) -> Callable:
    @_wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        bounds, ctx = _sp_call(kwargs, function_name(original))
        if ctx is None:
            return original(hidden_states, weight, bias=bias, activation=activation, **kwargs)
        runs = ctx.runs(bounds, hidden_states.shape[0])
        with recompute_region():
            return sp_causal_conv1d(hidden_states, weight, bias, activation, runs, ctx.group)

    return causal_conv1d_fn


def _gdn_entry(original: Callable) -> Callable:
    checked = plain_function(original)  # under SP, what check_kernel checked (never a kernel kernelize picked later)

    @_wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, **kwargs):
        bounds, ctx = _sp_call(kwargs, function_name(original))
        if ctx is None:
            # by keyword: with flash-linear-attention installed, ``original`` is FLA's kernel, whose 6th parameter is
            # ``scale`` (transformers' hub wrapper drops the ``chunk_size`` FLA doesn't take)
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, **kwargs)
        runs = ctx.runs(bounds, query.shape[0])
        options = {
            k: kwargs[k] for k in ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel") if k in kwargs
        }
        core = functools.partial(checked, chunk_size=chunk_size)
        varlen = varlen_capable(checked, value.device, channel_decay=g.dim() == 4)  # FLA's: one call per list
        with recompute_region():
            return sp_chunk_gated_delta_rule(
                core, query, key, value, g, beta, runs, ctx.group, relay=ctx.relay, varlen=varlen, **options
            )

    return torch_chunk_gated_delta_rule


def _mamba2_entry(original: Callable) -> Callable:
    checked = plain_function(original)

    @_wraps(original)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, **kwargs):
        bounds, ctx = _sp_call(kwargs, function_name(original))
        if ctx is None:
            return original(hidden_states, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, **kwargs)
        if kwargs.get("initial_states") is not None or kwargs.get("return_final_states", False):
            raise ValueError("Mamba2 under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, hidden_states.shape[0])
        options = {k: kwargs[k] for k in ("dt_softplus", "dt_limit") if k in kwargs}
        scan = functools.partial(checked, chunk_size=chunk_size)
        varlen = seq_idx_capable(checked, hidden_states.device)  # mamba_ssm's: one call per run
        with recompute_region():
            return sp_mamba2_chunk_scan(
                scan, hidden_states, dt, A, B, C, runs, ctx.group, D=D, dt_bias=dt_bias, relay=ctx.relay,
                varlen=varlen, **options,
            )  # fmt: skip

    return mamba2_chunk_scan


def _selective_entry(original: Callable) -> Callable:
    """Mamba1's selective scan (Jamba, Mamba, FalconMamba, Zamba), which its mixer calls without ``**kwargs``."""
    checked = plain_function(original)

    @_wraps(original)
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, **kwargs):
        bounds, ctx = _sp_call(kwargs, function_name(original))
        if ctx is None:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, **kwargs)
        if kwargs.get("return_last_state", False):
            raise ValueError("Mamba1 under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, hidden_states.shape[0])
        options = {k: kwargs[k] for k in ("use_mambapy", "use_associative_scan") if k in kwargs}
        scan = functools.partial(checked, **options)
        softplus = kwargs.get("delta_softplus", False)
        with recompute_region():
            return sp_selective_scan(
                scan, hidden_states, dt, A, B, C, runs, ctx.group, D=D, z=z, delta_bias=delta_bias,
                delta_softplus=softplus, relay=ctx.relay,
            )  # fmt: skip

    return mamba_selective_scan


def _unfused_entry(original: Callable) -> Callable:
    """A fused whole-layer path (mamba-ssm's ``mamba_split_conv1d_scan_combined`` for Mamba2, ``mamba_inner_fn``
    for Mamba1) returns ``None`` under SP, as its torch fallback always does: the layer then runs its unfused path
    through the swapped kernels."""

    @_wraps(original)
    def fused_layer(*args, **kwargs):
        if _sp_active(kwargs):
            return None
        return original(*args, **kwargs)

    return fused_layer


def _decode_only_entry(original: Callable) -> Callable:
    @_wraps(original)
    def decode_kernel(*args, **kwargs):
        if _sp_active(kwargs):
            raise ValueError(f"{function_name(original)} (cached decoding) can't run under sequence parallelism.")
        return original(*args, **kwargs)

    return decode_kernel


def _layer_function_entry(original: Callable) -> Callable:
    """A layer-level function of transformers >= 5.25 (``causal_conv1d_forward``, ``mamba2_scan_forward``,
    ``mamba_scan_forward``: the cache handling around the kernels, a hub function ``kernelize`` may replace whole):
    under SP transformers' own function beneath it, whose kernel calls reach the swapped kernels; outside SP the
    installed one unchanged."""
    plain = plain_function(original)

    @_wraps(original)
    def layer_function(*args, **kwargs):
        if _sp_active(kwargs):
            return plain(*args, **kwargs)
        return original(*args, **kwargs)

    return layer_function


def _lightning_entry(original: Callable) -> Callable:
    """MiniMax's lightning attention: its forward with the recurrence run by ``lightning_forward`` under SP."""
    padding = sys.modules[original.__module__].apply_mask_to_padding_states

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        bounds, ctx = _sp_call(kwargs, original.__qualname__)
        if ctx is None:
            return original(self, hidden_states, *args, **kwargs)
        if args or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("Lightning attention under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, hidden_states.shape[0])
        mask = kwargs.get("attention_mask")
        with recompute_region():
            return lightning_forward(self, hidden_states, mask, runs, ctx.group, padding, relay=ctx.relay)

    return forward


def _ngram_entry(original: Callable) -> Callable:
    """Qwen4-Exp's n-gram embedding (``Qwen4ExpTextNGramEmbedding``): under SP each document's own history."""

    @functools.wraps(original)
    def forward(self, input_ids, cache=None, **kwargs):  # kwargs: transformers >= 5.25 passes the layer's on
        bounds, ctx = _sp_call(kwargs, original.__qualname__)
        if ctx is None:
            return original(self, input_ids=input_ids, cache=cache, **kwargs)
        if cache is not None:
            raise ValueError("Qwen4-Exp's n-gram embedding under sequence parallelism runs without a cache.")
        runs = ctx.runs(bounds, input_ids.shape[0])
        return document_ngrams(original, self, whole_ids(input_ids, runs, ctx.group), runs)

    return forward


def _ple_conv_entry(original: Callable) -> Callable:
    """Qwen4-Exp's PLE conv (``Qwen4ExpTextPLELayer._short_conv``): under SP a causal conv with its halo."""

    @functools.wraps(original)
    def _short_conv(self, hidden_states, cache=None, **kwargs):  # kwargs: transformers >= 5.25 passes the layer's on
        bounds, ctx = _sp_call(kwargs, original.__qualname__)
        if ctx is None:
            return original(self, hidden_states=hidden_states, cache=cache, **kwargs)
        if cache is not None:
            raise ValueError("Qwen4-Exp's PLE conv under sequence parallelism runs without a cache.")
        with recompute_region():
            return sp_dilated_conv(hidden_states, self.conv1d, ctx.runs(bounds, hidden_states.shape[0]), ctx.group)

    return _short_conv


def _recurrent_block_entry(original: Callable) -> Callable:
    """RecurrentGemma's recurrent block: its conv as SP's causal conv, its RG-LRU run with the block's SP kwargs as
    the innermost scope (the layer calls it without them), so its swapped scan carries the state."""

    @functools.wraps(original)
    def forward(self, input_states, position_ids, attention_mask, use_cache=True, **kwargs):
        scope = {k: kwargs[k] for k in (BOUNDS_KWARG, SP_KWARG) if k in kwargs} or scoped_sp_kwargs()
        bounds, ctx = _sp_call(kwargs, original.__qualname__)
        if ctx is None:
            return original(
                self, input_states, position_ids=position_ids, attention_mask=attention_mask, use_cache=use_cache,
                **kwargs,
            )  # fmt: skip
        if use_cache:
            raise ValueError("RecurrentGemma under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, input_states.shape[0])
        with recompute_region():
            return recurrent_block_forward(self, input_states, position_ids, runs, ctx.group, scope)

    return forward


def _rnn_scan_entry(original: Callable) -> Callable:
    """The RG-LRU's scan (``RecurrentGemmaRglru._rnn_scan``), called without kwargs: SP's come from the scope."""

    @functools.wraps(original)
    def _rnn_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
        bounds, ctx = _sp_call({}, original.__qualname__)
        if ctx is None:
            return original(
                self, hidden_states=hidden_states, recurrent_gate=recurrent_gate, reset=reset,
                recurrent_states=recurrent_states, acc_dtype=acc_dtype,
            )  # fmt: skip
        if recurrent_states is not None:
            raise ValueError("RecurrentGemma under sequence parallelism runs without a cache (use_cache=False).")
        runs = ctx.runs(bounds, hidden_states.shape[0])
        scan = functools.partial(original, self, acc_dtype=acc_dtype)
        return sp_rnn_scan(scan, hidden_states, recurrent_gate, reset, runs, ctx.group, relay=ctx.relay), None

    return _rnn_scan


def _kernel_check(module_name: str, name: str, device, fn: Callable) -> None:
    """``check_kernel``: the installed kernel still computes what its SP version relies on (a small input, on the
    CPU and where the kernel its hub wrapper dispatches to runs)."""
    check_kernel(module_name, name, fn, device)


ENTRIES: dict[str, Callable[[Callable], Callable]] = {
    "causal_conv1d_fn": _conv_entry,
    "torch_chunk_gated_delta_rule": _gdn_entry,
    "chunk_kimi_delta_attention": _gdn_entry,  # KDA: the delta rule with a per-channel decay, the same SP algorithm
    "mamba2_chunk_scan": _mamba2_entry,
    "mamba2_split_conv1d_scan_combined": _unfused_entry,
    "mamba_selective_scan": _selective_entry,
    "mamba_inner_fn": _unfused_entry,
    **dict.fromkeys(LAYER_FUNCTIONS, _layer_function_entry),  # transformers >= 5.25
}
assert set(ENTRIES) == set(SP_KERNELS) | set(LAYER_FUNCTIONS), "model.mixers must name exactly the swapped functions"
# Mixer classes with no kernel function to hook: class name -> (the method swapped, its entry, why)
MODULE_ENTRIES: dict[str, tuple[str, Callable[[Callable], Callable], str]] = {
    "MiniMaxLightningAttention": ("forward", _lightning_entry, "the exact SP lightning attention"),
    "RecurrentGemmaRecurrentBlock": ("forward", _recurrent_block_entry, "the exact SP conv of the RG-LRU block"),
    "RecurrentGemmaRglru": ("_rnn_scan", _rnn_scan_entry, "the exact SP RG-LRU scan (state passed across ranks)"),
    "DeepseekV32Attention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "DeepseekV32Indexer": ("forward", dsa_indexer_entry, "DSA's top-k over the whole sequence's keys under SP"),
    "GlmMoeDsaAttention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "GlmMoeDsaIndexer": ("forward", dsa_indexer_entry, "DSA's top-k over the whole sequence's keys under SP"),
    "AXK2Attention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "AXK2Indexer": ("forward", dsa_indexer_entry, "DSA's top-k over the whole sequence's keys under SP"),
    "Dots3NoteTextAttention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "Dots3NoteTextIndexer": ("forward", dsa_indexer_entry, "DSA's top-k over the whole sequence's keys under SP"),
    "MistralLarge4TextAttention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "MistralLarge4TextIndexer": ("forward", positional_indexer_entry, "DSA's top-k (document positions) under SP"),
    "HYV4Attention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "HYV4Indexer": ("forward", dsa_indexer_entry, "DSA's top-k over the whole sequence's keys under SP"),
    "HYV4VLAttention": ("forward", dsa_attention_entry, "DSA's attention, its indexer given SP's documents"),
    "HYV4VLIndexer": ("forward", dsa_indexer_entry, "DSA's top-k over the whole sequence's keys under SP"),
    "Glm5NextTextAttention": ("forward", pooled_attention_entry, "GLM-5-Next's attention, its top-k as indices="),
    "Glm5NextTextIndexer": ("forward", pooled_indexer_entry, "pools of keys from each document's start under SP"),
    "Qwen4ExpTextAttention": ("forward", qsa_attention_entry, "Qwen4-Exp's attention, selecting over the sequence"),
    "Qwen4ExpTextQSAIndexer": ("forward", qsa_indexer_entry, "Qwen4-Exp's indexer (its attention selected)"),
    "Qwen4ExpTextNGramEmbedding": ("forward", _ngram_entry, "hashed n-grams of each document's own earlier ids"),
    "Qwen4ExpTextPLELayer": ("_short_conv", _ple_conv_entry, "the exact SP dilated conv of Qwen4-Exp's PLE layers"),
    "DeepseekV4Attention": ("forward", v4_attention_entry, "DeepSeek-V4's window and compressed entries under SP"),
    "MiniMaxM3VLIndexer": ("forward", block_indexer_entry, "MiniMax-M3's block top-k over the whole sequence"),
    "DogeAttention": ("forward", doge_attention_entry, "Doge's dynamic mask over each document's keys under SP"),
}
assert set(MODULE_ENTRIES) == set(SP_MODULES), "detect.SP_MODULES must name exactly the swapped classes"
_FIX = "Use sp_size=1 for this model, or the transformers version hf_sp_trainer is tested with."
_REASONS: dict[Callable, str] = {
    _conv_entry: "the exact SP causal conv1d of hybrid layers (each document's conv across the SP ranks)",
    _gdn_entry: "the exact SP chunked delta rule (recurrent state passed across the SP ranks)",
    _mamba2_entry: "the exact SP Mamba2 chunk scan (recurrent state passed across the SP ranks)",
    _selective_entry: "the exact SP Mamba1 selective scan (recurrent state passed across the SP ranks)",
    _unfused_entry: "switch a fused whole-layer Mamba path off under SP (the layer falls back to the swapped kernels)",
    _decode_only_entry: "refuse cached-decoding kernels inside an SP forward (SP runs without a cache)",
    _layer_function_entry: "run transformers' own layer-level function under SP, so its kernels are the swapped ones",
}
# Entries with nothing to check: outside an SP forward they call the installed function unchanged, inside one they
# raise instead of calling it, so no property of the installed function is relied on.
_UNCHECKED: dict[Callable, str] = {
    _decode_only_entry: "outside SP it calls the installed function unchanged; under SP it raises instead of running",
}


def attach_mixers(model: torch.nn.Module, documents: DocumentHook, state_passing: str = "gather") -> list[str]:
    """Swap the SP kernels into ``model``'s modeling modules (idempotent) and give ``model``'s layers, through its
    decoder pre-hook ``documents``, the context they run with (its topology: ``None`` at sp_size 1, documents kept
    apart within the process; ``state_passing``: one of ``STATE_PASSING``); returns ``module.function`` for every
    swapped function."""
    check_state_passing(state_passing)
    device = parameter_device(model)
    swapped = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        for name, entry in {**ENTRIES, **dict.fromkeys(DECODE_ONLY_KERNELS, _decode_only_entry)}.items():
            if getattr(module, name, None) is None:
                continue
            if name in CHECKS:
                check, unchecked = functools.partial(_kernel_check, module_name, name, device), None
            elif entry is _unfused_entry:
                check, unchecked = check_fused_fallback, None
            elif entry is _layer_function_entry:
                check, unchecked = check_layer_function, None
            else:
                check, unchecked = None, _UNCHECKED[entry]
            patches.patch(module, name, wrap=entry, check=check, unchecked=unchecked, reason=_REASONS[entry], fix=_FIX)
            swapped.append(f"{module_name}.{name}")
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        if cls.__name__ in MODULE_ENTRIES:
            attr, entry, why = MODULE_ENTRIES[cls.__name__]
            check = functools.partial(_check_module, cls, attr, entry)
            patches.patch(cls, attr, wrap=entry, check=check, reason=f"{why} (no kernel function to hook)", fix=_FIX)
            swapped.append(f"{cls.__module__}.{cls.__name__}.{attr}")
    if swapped:  # a checkpoint recompute finds SP's kwargs where the forward found them (and never falls back)
        scope_checkpointed_layers(model)
    check = hub_layer_check(model)
    check()
    documents.forward_checks["hub layers"] = check
    documents.context["mixers"] = MixerContext(documents.topology, documents.sharding, state_passing)
    return swapped


def _check_module(cls: type, attr: str, entry: Callable[[Callable], Callable], installed: Callable) -> None:
    """``check_module``, after ``_check_cache_argument``."""
    check_cache_argument(cls, attr, entry, installed)
    check_module(cls, installed, attr=attr)


def check_cache_arguments(model: torch.nn.Module) -> None:
    """``_check_cache_argument`` for every class of ``model`` SP swaps a method of (signatures only: cheap, for
    ``validate_model_for_sp``)."""
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        if cls.__name__ in MODULE_ENTRIES:
            attr, entry, _ = MODULE_ENTRIES[cls.__name__]
            check_cache_argument(cls, attr, entry, patches.original(cls, attr))


def check_mixer_kernels(model: torch.nn.Module) -> None:
    """The checks of ``attach_mixers`` alone, with no side effect: a ``ValueError`` before any collective."""
    hub_layer_check(model)()
    device = parameter_device(model)
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is None or not module_name.startswith("transformers.models."):
            continue
        for name in ENTRIES:
            if getattr(module, name, None) is not None:
                if name in LAYER_FUNCTIONS:
                    check_layer_function(patches.original(module, name))
                else:
                    check_kernel(module_name, name, patches.original(module, name), device)
    for cls in {type(m) for m in model.modules()}:
        if cls.__name__ in MODULE_ENTRIES:
            attr, entry, _ = MODULE_ENTRIES[cls.__name__]
            _check_module(cls, attr, entry, patches.original(cls, attr))
