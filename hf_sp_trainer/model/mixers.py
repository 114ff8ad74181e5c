"""Find what in a model mixes the sequence other than attention through the transformers attention registry.

Sequence parallelism replaces only the registered attention function: every other layer that looks across tokens
(a convolution over the sequence, an SSM / linear-attention / recurrent layer, an attention that builds its own mask
or is not causal) would see only this rank's shard and be silently wrong. ``check_sequence_mixers`` refuses such a
model, naming the layer; the detection reads the modules and the config's layer types, never family names.

It reads modeling code (``inspect.getsource`` of a layer's ``forward``: which plain functions it calls, whether it
passes ``**kwargs`` on, where the mask given to the attention comes from; a modeling module's mention of sliding
windows). That stays a reading of the code, not a behaviour check: it classifies arbitrary layers of every family
(about 200) before any weight is loaded or moved, and a behaviour check would have to build and run each layer type
with inputs only its own family knows how to make. What keeps it honest is the family suite
(``tests/test_model_families.py``): every causal-LM family of the installed transformers is exact under SP or refused,
and a changed classification fails against ``docs/models.md``. The functions SP *swaps* are behaviour-checked when
swapped (``mixers/swap.py``, through ``hf_sp_trainer.patches``).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from functools import cache

import torch
from torch.nn.modules.conv import _ConvNd
from transformers.modeling_layers import GradientCheckpointingLayer

from .hub_functions import plain_function

# Class names of non-attention sequence mixers (state spaces, linear attention, recurrences, short convolutions).
MIXER_CLASS = re.compile(
    r"Mamba|SSM|Rglru|RGLRU|Recurrent|Lightning|LinearAttention|Delta|Rwkv|RWKV|LSTM|ShortConv|Retention|Hyena"
    r"|Mixer$"  # BambaMixer, FalconH1Mixer, ... (Mamba mixers named after their family)
)
# Layer types (config.layer_types and the like) naming a non-attention sequence mixer.
MIXER_TYPE = re.compile(r"linear|conv|mamba|ssm|recurren|rglru|delta|rwkv|lstm|retention", re.IGNORECASE)
LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types", "layers_type")
# transformers' module-level kernels that hf_sp_trainer.mixers.swap replaces with exact SP versions: a mixer whose
# forward mixes the sequence only through these runs exactly under SP (Mamba2's fused whole-layer path is switched
# off under SP, as is Mamba1's ``mamba_inner_fn``: the layer falls back to its unfused path through the others).
SP_KERNELS = (
    "causal_conv1d_fn",
    "torch_chunk_gated_delta_rule",
    "mamba2_chunk_scan",
    "mamba2_split_conv1d_scan_combined",
    "chunk_kimi_delta_attention",
    "mamba_selective_scan",
    "mamba_inner_fn",
)
# Attention classes that build their own mask (a learned sparse top-k) whose forward hf_sp_trainer.mixers.swap
# replaces with an exact SP version (checked against the installed one): DeepSeek-V3.2's sparse attention (DSA).
# DSA's: their indexers' top-k by attention.dsa.sp_index_topk
DSA_ATTENTIONS = (
    "DeepseekV32Attention",
    "GlmMoeDsaAttention",
    "AXK2Attention",
    "Dots3NoteTextAttention",
    "MistralLarge4TextAttention",  # queries scaled by document position; NoPE and shared layers
    "HYV4Attention",  # its per-head sinks; shared layers reuse the full layer's top-k
    "HYV4VLAttention",  # HY-V4-VL's decoder: HY-V4's maths, mrope positions, interleaved RoPE
)
SP_ATTENTIONS = (
    *DSA_ATTENTIONS,
    "Glm5NextTextAttention",  # GLM-5-Next: pools of keys from each document's start, no RoPE (attention/pooled_dsa.py)
    "Qwen4ExpTextAttention",  # query-sparse: top blocks of pooled keys plus its own block's tail (attention/qsa.py)
    "DeepseekV4Attention",  # window + compressed entries (CSA's picked by its indexer), sinks: attention/deepseek_v4.py
    "DogeAttention",  # a learned per-key bias, each query's top keys by it (attention/doge.py)
)
SP_INDEXERS = (
    "DeepseekV32Indexer",
    "GlmMoeDsaIndexer",
    "AXK2Indexer",
    "Dots3NoteTextIndexer",
    "MistralLarge4TextIndexer",
    "HYV4Indexer",
    "HYV4VLIndexer",
    "Glm5NextTextIndexer",
    "Qwen4ExpTextQSAIndexer",
)  # their indexers, swapped with them
# Attentions with a top-k selection whose forward runs as installed (it hands the selection to SP's attention as a
# kwarg) and whose indexer is swapped: MiniMax-M3's block-sparse attention (``attention/block_sparse.py``).
SP_BLOCK_ATTENTIONS = ("MiniMaxM3VLAttention",)
SP_BLOCK_INDEXERS = ("MiniMaxM3VLIndexer",)
SELECTING_ATTENTIONS = (*SP_ATTENTIONS, *SP_BLOCK_ATTENTIONS)
# The selecting attentions under Ulysses SP, a ring gathering the ring group's keys (attention/dsa.ring_gather) ...
RING_SELECTING = (*DSA_ATTENTIONS, "Glm5NextTextAttention", "Qwen4ExpTextAttention", "DogeAttention")
RING_SELECTING += SP_BLOCK_ATTENTIONS
# ... and those that split no heads: every rank keeps all heads of its own queries over contiguous shards (DeepSeek-V4:
# a left halo and gathered compressed entries, attention/deepseek_v4.py), so any sp, and no ring
CONTEXT_PARALLEL_ATTENTIONS = ("DeepseekV4Attention",)
# The selections' indexers: transformers runs them without autograd (their parameters never get a gradient, on one
# device as under SP), which DDP must be told of (``trainers.base``: ``ddp_find_unused_parameters``)
NO_GRAD_INDEXERS = (*SP_INDEXERS, *SP_BLOCK_INDEXERS, "DeepseekV4Indexer")


def has_no_grad_indexers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a selection indexer with trainable parameters (``NO_GRAD_INDEXERS``)."""
    return any(
        type(m).__name__ in NO_GRAD_INDEXERS and any(p.requires_grad for p in m.parameters()) for m in model.modules()
    )


# Modules transformers anchors at row slots (its packed forward mixes documents): SP's version runs at sp_size 1 too,
# where documents are kept apart in one process (MiniMax-M3 refuses packed rows there; DeepSeek-V4 runs them exactly)
ROW_ANCHORED = (*SP_BLOCK_INDEXERS, "DeepseekV4Attention")
# Mixer classes with no kernel function to hook, a method of which hf_sp_trainer.mixers.swap replaces with an exact SP
# version (checked against the installed one): MiniMax's lightning attention; RecurrentGemma's recurrent block (its
# conv) and RG-LRU (its scan).
# Qwen4-Exp's per-layer embeddings (hashed n-grams of earlier token ids, a dilated conv): the layer is covered, its
# n-gram embedding's forward and its conv (``_short_conv``) swapped (``mixers/token_history.py``).
SP_TOKEN_HISTORY = ("Qwen4ExpTextPLELayer", "Qwen4ExpTextNGramEmbedding")
SP_MODULES = (
    *SP_TOKEN_HISTORY,
    "MiniMaxLightningAttention",
    "RecurrentGemmaRecurrentBlock",
    "RecurrentGemmaRglru",
    *SP_ATTENTIONS,
    *SP_INDEXERS,
    *SP_BLOCK_INDEXERS,
)
# transformers >= 5.25's layer-level functions (the cache handling around the kernels; hub functions ``kernelize`` may
# replace whole): swapped to run transformers' own function under SP, so a layer calling one is covered when that
# function mixes the sequence only through ``SP_KERNELS`` (``layer_function_problem``).
LAYER_FUNCTIONS = ("causal_conv1d_forward", "mamba2_scan_forward", "mamba_scan_forward")
# Kernels of cached decoding only (unreachable under SP, which runs without a cache; swapped to raise if reached).
DECODE_ONLY_KERNELS = (
    "causal_conv1d_update",
    "torch_recurrent_gated_delta_rule",
    "mamba2_selective_state_update",
    "recurrent_kimi_delta_attention",
    "mamba_selective_state_update",
)
# Names of functions that mix the sequence (a mixer calling one not in SP_KERNELS is not covered).
MIXING_FUNCTION = re.compile(r"conv|delta|scan|selective|recurren|lightning|ssd|wkv|lstm|mamba|rglru", re.I)
# Attention classes whose model applies ``config.<field>`` as a sliding window to every layer through its mask alone
# (the module neither holds nor passes it: PhiMoE builds its mask with ``create_sliding_window_causal_mask`` when
# ``config.sliding_window`` is set). SP gives that window to the attention itself (``mask_only_window``); the family
# suite crosses the window under its rows, so a modeling change that breaks this fact fails there.
MASK_ONLY_WINDOWS = {
    "PhimoeAttention": "sliding_window",
    "DogeAttention": "sliding_window",  # its swapped forward applies it (attention/doge.py), as the model's mask does
}
# Modules that mix tokens outside attention by a reshape, named by class: Doge's product-key MoE splits its router
# logits ``[b, s, 2k]`` as ``view(2, b * s, k)``, so a token's routing reads other tokens' logits (its modeling code
# says so), which a rank's shard, or a document alone, doesn't hold
TOKEN_MIXING_MODULES = {"DogeCDMoE": "a router that reads other tokens' logits (a reshape across the sequence)"}
# Modules that read earlier tokens' ids (n-gram embeddings): each rank's first tokens would miss theirs under SP
TOKEN_HISTORY = re.compile(r"N[Gg]ram(Embedding|Hash)")
HYBRID_ADVICE = (
    "Use sp_size=1 for this model (hf_sp_trainer.mixers runs Gated DeltaNet, Kimi delta attention, Mamba1, Mamba2, "
    "short convolutions, MiniMax's lightning attention and RecurrentGemma's RG-LRU exactly under SP; this layer is "
    "none of those)."
)


def sequence_mixers(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """``(where, class or layer type, what it is)`` for every sequence mixer SP can't split, in model order."""
    found = []
    covered = covered_mixers(model)
    for name, module in model.named_modules():
        cls = type(module).__name__
        if name in covered or any(name.startswith(f"{c}.") or c.startswith(f"{name}.") for c in covered):
            continue  # a mixer SP runs exactly, a part of it, or a layer holding it (checked on its own)
        if isinstance(module, _ConvNd):
            found.append((name, cls, "a convolution over the sequence"))
        elif cls in TOKEN_MIXING_MODULES:
            found.append((name, cls, TOKEN_MIXING_MODULES[cls]))
        elif TOKEN_HISTORY.search(cls):  # Qwen4-Exp: hashed n-grams of the previous token ids
            found.append((name, cls, "an embedding of the previous tokens' ids (a shard's first tokens lack theirs)"))
        elif _is_mixer_class(model, type(module)) and not _is_inside(name, found) and not _holds(model, module):
            found.append((name, cls, "a state-space / linear-attention / recurrent layer" + _unsupported(type(module))))
        elif getattr(module, "is_causal", True) is False and _calls_attention(type(module)):
            found.append((name, cls, "a bidirectional (is_causal=False) attention (SP attention is causal)"))
        elif _calls_attention(type(module)) and _builds_own_mask(type(module)) and cls not in SELECTING_ATTENTIONS:
            found.append((name, cls, "an attention that computes its own mask (learned, or a top-k selection)"))
    found += _attention_without_kwargs(model)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "sliding_window", None):  # a window SP must be told: by a kwarg or the module's attribute
        for name, module in model.named_modules():
            if mask_only_window(module, text) is not None:
                continue  # SP passes the window the model's mask applies (MASK_ONLY_WINDOWS)
            if _calls_attention(type(module)) and getattr(module, "sliding_window", None) is None:
                if not _mentions_sliding_window(type(module)) and _may_slide(type(module)):
                    what = "an attention whose sliding window lives only in the mask SP drops"
                    found.append((name, type(module).__name__, what))
    layers = [name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    for field in LAYER_TYPE_FIELDS:
        types = getattr(text, field, None) or []
        for i, kind in enumerate(types if isinstance(types, (list, tuple)) else []):
            exact = i < len(layers) and any(c.startswith(f"{layers[i]}.") for c in covered)
            if isinstance(kind, str) and MIXER_TYPE.search(kind) and not exact:
                found.append((f"config.{field}[{i}]", kind, "a non-attention layer type"))
    return found


def mask_only_window(module: torch.nn.Module, text_config) -> int | None:
    """The sliding window ``module``'s model applies to it through the mask alone (``MASK_ONLY_WINDOWS``), else None.
    Only for a config without per-layer types: with them, which layers slide is the mask's per-type choice."""
    field = MASK_ONLY_WINDOWS.get(type(module).__name__)
    if field is None or getattr(text_config, "layer_types", None):
        return None
    window = getattr(text_config, field, None)
    return window if isinstance(window, int) and window > 0 else None


def uses_attention_registry(model: torch.nn.Module) -> bool:
    """The model's attention goes through the transformers attention registry: its class says so, or (hybrid
    models such as Qwen3.5, which don't set ``_supports_attention_backend``) no attention module of it computes
    attention itself, and it has attention calling the registry's ``attention_interface`` or sequence mixers
    (whether those run under SP is ``check_sequence_mixers``' question)."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    kinds = [type(m) for m in model.modules()]
    own = [c for c in kinds if c.__name__.endswith("Attention") and not _calls_attention(c)]
    own = [c for c in own if not _is_mixer_class(model, c)]
    return not own and any(_calls_attention(c) or _is_mixer_class(model, c) for c in kinds)


def _is_mixer_class(model: torch.nn.Module, cls: type) -> bool:
    """``cls``'s name, without the model family's ("RecurrentGemma", "Rwkv": not themselves hints), names a mixer."""
    family = re.split(r"For[A-Z]|Model|LMHead", type(model).__name__)[0]
    return bool(MIXER_CLASS.search(cls.__name__.removeprefix(family)))


def covered_mixers(model: torch.nn.Module) -> set[str]:
    """Paths of the mixers SP runs exactly: state-space / linear / conv layers whose forward mixes the sequence only
    through ``SP_KERNELS`` (never calling a convolution module of their own), and those of ``SP_MODULES``."""
    covered = set()
    for name, module in model.named_modules():
        if type(module).__name__ in SP_TOKEN_HISTORY and not any(name.startswith(f"{c}.") for c in covered):
            covered.add(name)  # not a mixer class by name: a PLE layer (and what it holds)
            continue
        if not _is_mixer_class(model, type(module)) or any(name.startswith(f"{c}.") for c in covered):
            continue
        if type(module).__name__ in SP_MODULES:
            covered.add(name)
            continue
        mixing = _mixing_calls(type(module))
        convs = [n for n, child in module.named_children() if isinstance(child, _ConvNd)]
        if (
            mixing & set(SP_KERNELS)
            and mixing <= set(SP_KERNELS) | set(DECODE_ONLY_KERNELS)
            and not any(_self_call(type(module), n) for n in convs)
        ):
            covered.add(name)
    return covered


def _holds(model: torch.nn.Module, module: torch.nn.Module) -> bool:
    """A decoder layer named like a mixer (``JambaMambaDecoderLayer``) that mixes nothing itself but holds a mixer:
    the mixer is the one to name."""
    if not isinstance(module, GradientCheckpointingLayer) or any(
        MIXING_FUNCTION.search(c) for c in _global_calls(type(module))
    ):
        return False
    return any(_is_mixer_class(model, type(m)) for m in list(module.modules())[1:])


@cache
def _mentions_sliding_window(cls: type) -> bool:
    """The class's source names ``sliding_window`` (read once per class: ``inspect`` parses the whole module)."""
    return "sliding_window" in inspect.getsource(cls)


@cache
def _may_slide(cls: type) -> bool:
    """The modeling module of ``cls`` can apply a sliding window at all (Qwen2-MoE sets it on sliding layers; one
    that never mentions it, such as Nemotron-H, ignores a ``config.sliding_window``: the causal mask doesn't read
    it)."""
    module = sys.modules.get(cls.__module__)
    try:
        return module is None or "sliding" in inspect.getsource(module)
    except (OSError, TypeError):
        return True


def _unsupported(cls: type) -> str:
    """`` mixing through f, g`` for the sequence-mixing functions of ``cls.forward`` that SP has no exact version of
    (Mamba1's selective scan, ...), else empty."""
    calls = _mixing_calls(cls) - set(SP_KERNELS) - set(DECODE_ONLY_KERNELS)
    return f" mixing through {', '.join(sorted(calls))}, which SP has no exact version of" if calls else ""


@cache
def _mixing_calls(cls: type) -> frozenset[str]:
    """The sequence-mixing functions ``cls.forward`` calls, those of the ``LAYER_FUNCTIONS`` it calls in their place
    (a layer function with no mixing call of its own stays: nothing proves it exact)."""
    mixing = set()
    for name in (c for c in _global_calls(cls) if MIXING_FUNCTION.search(c)):
        inner = _layer_function_calls(sys.modules.get(cls.__module__), name) if name in LAYER_FUNCTIONS else None
        mixing |= inner or {name}
    return frozenset(mixing)


def _layer_function_calls(module, name: str) -> set[str] | None:
    function = getattr(module, name, None)
    if function is None:
        return None
    return {c for c in _global_calls(plain_function(function)) if MIXING_FUNCTION.search(c)} or None


def layer_function_problem(function) -> str | None:
    """Why the function beneath a layer-level function (``LAYER_FUNCTIONS``) can't run exactly under SP with the swapped
    kernels (it mixes the sequence through something else, or through none of them), else ``None``."""
    mixing = {c for c in _global_calls(function) if MIXING_FUNCTION.search(c)}
    if not mixing & set(SP_KERNELS) or not mixing <= set(SP_KERNELS) | set(DECODE_ONLY_KERNELS):
        where = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"
        return (
            f"{where} mixes the sequence through {sorted(mixing) or 'no kernel function'}, not only through the "
            f"kernels SP swaps ({', '.join(SP_KERNELS)})"
        )
    return None


@cache
def _global_calls(target) -> frozenset[str]:
    """Names of the plain functions a class's ``forward`` (or a function) calls (``f(...)``, not ``self.f(...)``)."""
    try:
        source = inspect.getsource(target.forward if isinstance(target, type) else target)
        tree = ast.parse(textwrap.dedent(source))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))


def check_sequence_mixers(model: torch.nn.Module, sp_size: int) -> None:
    """Raise a ``ValueError`` naming the first layer SP can't split (no collective: the same on every rank)."""
    found = sequence_mixers(model)
    if found:
        where, cls, what = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ValueError(
            f"{type(model).__name__}: {where} ({cls}) is {what}{more}. Sequence parallelism (sp_size={sp_size}) "
            "replaces only attention called through the transformers attention registry with the decoder's kwargs; "
            f"this layer would see only this rank's shard of each sequence. {HYBRID_ADVICE}"
        )


def attention_without_kwargs(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """``(path, parent, attribute)`` of every attention module its parent calls without passing ``**kwargs`` on
    (Nemotron's and StableLM's decoder layers): SP's kwargs reach such an attention only through
    ``documents.relay_sp_kwargs``, which needs the parent itself to take ``**kwargs``."""
    found = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if not _calls_attention(type(child)):
                continue
            call = _self_call(type(parent), child_name)
            if call is not None and not any(k.arg is None for k in call.keywords):
                found.append((f"{parent_name}.{child_name}".lstrip("."), parent, child_name))
    return found


def _attention_without_kwargs(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """Attention modules SP's kwargs can't reach: called without ``**kwargs`` by a parent that takes none either."""
    found = []
    for where, parent, child_name in attention_without_kwargs(model):
        if not takes_var_kwargs(type(parent)):
            name = type(parent).__name__
            what = f"an attention {name} calls without **kwargs, and {name} takes none (SP's bounds can't reach it)"
            found.append((where, type(getattr(parent, child_name)).__name__, what))
    return found


def takes_var_kwargs(cls: type) -> bool:
    """``cls.forward`` accepts ``**kwargs``."""
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


@cache
def _self_call(cls: type, attr: str) -> ast.Call | None:
    """The call ``self.<attr>(...)`` in ``cls.forward``, if there is one."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == attr:
            if getattr(func.value, "id", None) == "self":
                return node
    return None


def _is_inside(name: str, found: list[tuple[str, str, str]]) -> bool:
    return any(name.startswith(f"{where}.") for where, _, _ in found)


@cache
def _forward_call(cls: type) -> ast.Call | None:
    """The ``attention_interface(...)`` call in ``cls.forward``, if it has one (the registry's attention)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "attention_interface":
            return node
    return None


def _calls_attention(cls: type) -> bool:
    return _forward_call(cls) is not None


@cache
def _builds_own_mask(cls: type) -> bool:
    """The mask given to the registry's attention is computed in the module's forward (a learned dynamic mask, a
    sparse top-k selection), not just the model's ``attention_mask`` (or a slice of it): SP passes no mask."""
    call = _forward_call(cls)
    mask = next((k.value for k in call.keywords if k.arg == "attention_mask"), None)
    if mask is None and len(call.args) > 4:
        mask = call.args[4]
    if not isinstance(mask, ast.Name):
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == mask.id for t in node.targets):
            value = node.value
            picked = isinstance(value, ast.Call) and getattr(value.func, "attr", None) == "get"  # mapping["type"]
            if not picked and not isinstance(value, (ast.Name, ast.Subscript, ast.Constant, ast.IfExp)):
                return True
    return False
