"""Every decoder-only causal LM of the installed transformers at sp 2 (and a ring sample at sp 4) against the same
model run document by document in one process: the family-coverage check behind ``docs/models.md``.

The families come from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; each is classified (out of scope or not), shrunk to a
tiny random-init fp32 config by attribute names, and checked in ONE spawned gloo group for all families. A family's
outcome: ``exact`` (loss and every gradient within round-off: ``tests/exactness.py``'s rule), ``refused`` (a
``ValueError`` on every rank),
``wrong`` (a silent difference), ``crash`` (another exception, or a hang turned into an error by the gloo timeout),
``can't build`` (the shrink failed) or ``out of scope``.
"""

from __future__ import annotations

import copy
import datetime
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tests.exactness import EXACT, float64_scope, inject_error, judge, widened
from tests.harness import TIMEOUT_SCALE, weak_decay, worst_error
from tests.length_crossing import cross_config, rope_dims

VOCAB = 128
DOCS = (13, 9, 18)  # 40 tokens: the second document straddles the sp-2 boundary, every one straddles a ring chunk
LONG = 40
AUX_COEF = 0.1
COLLECTIVE_TIMEOUT_S = 60 * TIMEOUT_SCALE  # a hang turned into a crash outcome
REFERENCES_PER_RANK = 8  # families whose references a rank computes before the ranks exchange them
OUT_OF_SCOPE_SUBCONFIG = ("vision", "audio", "vq", "encoder", "decoder", "patcher", "text_config")

# Fields set by name wherever a config has them: (name, value). Sizes first, then MoE, MLA and the rest.
SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_heads": 8,  # Mamba2's SSM heads: hidden_size * expand == num_heads * head_dim
    "max_position_embeddings": 512,
    "use_cache": False,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size_per_layer_input": VOCAB,  # Gemma4's per-layer embeddings
    "hidden_size_per_layer_input": 8,
    # MoE: few experts, every MoE layer routed, the router aux loss on and weighty
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "output_router_logits": True,
    "router_aux_loss_coef": AUX_COEF,
    "aux_loss_coef": AUX_COEF,
    # MLA
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "rotary_dim": 8,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 16,
    # sequence mixers other than attention
    "sliding_window": 12,
    "use_sliding_window": True,
    "conv_kernel": 4,
    "mamba_d_state": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "state_size": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 8,
    "kda_lower_bound": -0.2,  # KDA's "safe gate" decay lies in (lower bound, 0): weak, as `weak_decay` makes the others
}


# Per family: fields its modeling code needs that the default config lacks (DBRX reads ``attn_config.rope_theta``
# and clamps by ``clip_qkv``, as its checkpoints set them) or sizes the generic shrink can't derive (XLNet's
# ``d_head``, Qwen4-Exp's QSA indexer, Gemma3n's shared-kv layers).
FAMILY_EXTRA = {
    "dbrx": {
        "d_model": 64,  # by its own name: its FFN copies it before the attribute map sets hidden_size
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "xlnet": {"d_head": 16},
    "bamba": {"attn_layer_indices": [1]},  # a Mamba2 layer and an attention layer (its default has no attention)
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},  # its pattern repeats 3 types over 26 layers
    "gemma3n_text": {"num_kv_shared_layers": 4},  # of the shrunk 11 layers (its default, 15, shares them all)
    "gemma4_text": {"global_head_dim": 32},  # its full-attention layers' head size (per_layer_config; 512)
    "gemma4_unified_text": {"global_head_dim": 32},
    # DSA: with 4 indexer heads, 1 pair in 16 scores exactly 0 (every head's relu zero), and keys tied at the k-th
    # place are picked by topk's tie order, which differs between a document alone and a whole row; 16 heads (real
    # models have 32-64) leave no such ties under these rows
    "deepseek_v32": {"index_n_heads": 16},
    "axk2": {"index_n_heads": 16},
    "dots3_note_text": {"index_n_heads": 16},
    "hy_v4": {"index_n_heads": 16, "indexer_types": ["full", "shared"] * 2},  # shared: the full one's top-k
    "glm_moe_dsa": {"index_n_heads": 16, "indexer_types": ["full", "shared"] * 2},  # shared: the full one's top-k
    # DeepSeek-V4: CSA every 2 tokens (its top-k then binds), HCA every 8 (its 128 never closes a window here)
    "deepseek_v4": {
        "index_n_heads": 16,
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
    },
    "kolibri1_1": {"index_num_heads": 1, "head_dim": 16},  # 5.25: its indexer heads within key head 0's queries
    "qwen4_exp_text": dict(  # top-2 blocks of 4 tokens (16 indexer heads: no exact zero-score ties, as for DSA)
        indexer_n_heads=16,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        ple_layer_ids=[1, 3],  # PLE layers, as its released configs: hashed n-grams of earlier ids, a dilated conv
        ngram_vocab_size_base=64,  # small hashed tables (the default: millions of rows)
        eos_token_id=2,  # restarts the n-gram history
    ),
}

# Families whose fp32 round-off reaches ``EXACT`` on some host, so that their verdict comes from the same check in
# float64 there (``tests/exactness.py``): DeepSeek-V4's and HY-V4's hyper-connection head gradients and Qwen4-Exp's
# PLE norms are sums over few tokens with cancellation. Their float64 run is forced on every host (``float64`` in
# their outcome), so the float64 path is exercised wherever the suite runs.
NEAR_THE_BAR = {"deepseek_v4", "hy_v4", "qwen4_exp_text"}

# ``None`` in these means "derive it" (not "no such feature"): some families don't, so they are set too.
DERIVED = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size"}
DERIVED |= {"n_shared_experts", "sliding_window"}


@dataclass
class Family:
    model_type: str
    class_name: str
    out_of_scope: str | None = None  # the reason


def families() -> list[Family]:
    """Every causal-LM model type of the installed transformers, with the reason when it is out of scope."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    out = []
    for model_type, class_name in sorted(_causal_lms().items()):
        config_cls = CONFIG_MAPPING[model_type]
        sub_configs = getattr(config_cls, "sub_configs", {}) or {}
        subs = sorted(k for k in sub_configs if any(w in k for w in OUT_OF_SCOPE_SUBCONFIG))
        reason = None
        if subs:
            reason = f"composite config (sub-configs {', '.join(subs)}): multimodal or wrapped models are a later issue"
        elif getattr(config_cls, "is_encoder_decoder", False) or _default(config_cls, "is_encoder_decoder"):
            reason = "the decoder of an encoder-decoder model (cross-attention)"
        elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            reason = "an encoder (masked LM) used as a decoder"
        out.append(Family(model_type, class_name, reason))
    return out


def _causal_lms() -> dict[str, str]:
    """``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, plus the text-only causal LMs listed only among the image-text-to-text
    models (Mistral4: a config without sub-configs, a ``...ForCausalLM`` class)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    extra = {
        t: c
        for t, c in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()
        if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and c.endswith("ForCausalLM")
        and not getattr(CONFIG_MAPPING[t], "sub_configs", None)
    }
    return {**MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, **extra}


def _default(config_cls, name: str):
    try:
        return getattr(config_cls(), name, None)
    except Exception:  # noqa: BLE001 - a config that can't build with defaults shows up later as "can't build"
        return None


# ----------------------------------------------------------------------------------------------------------------
# tiny models
# ----------------------------------------------------------------------------------------------------------------
def tiny_configs(model_type: str, router_logits: bool = True):
    """The family's config with every field of ``SHRINK`` it knows, and the fewest layers (>= 2) covering each of its
    layer types; per-layer lists and patterns are cut to that prefix. Shrink fields the family's validation rejects
    are dropped group by group (mixer sizes, then MLA, then MoE)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    default.allow_global_per_layer_attribute_access = True  # heterogeneous configs: read the global defaults
    known = set(default.to_dict()) | set(getattr(config_cls, "attribute_map", {}))
    kwargs = {
        k: v
        for k, v in SHRINK.items()
        if k in known and (_shrinkable(getattr(default, k, None), v) or k in DERIVED and getattr(default, k) is None)
    }
    kwargs |= FAMILY_EXTRA.get(model_type, {})
    if "output_router_logits" in kwargs:
        kwargs["output_router_logits"] = router_logits
    kwargs.update({k: 0.0 for k, v in default.to_dict().items() if _is_dropout(k, v)})  # same random draws: none
    n_default = default.num_hidden_layers
    per_layer = {k: v for k, v in default.to_dict().items() if isinstance(v, (list, str)) and len(v) == n_default > 2}
    ints = {k: v for k, v in per_layer.items() if all(isinstance(i, int) for i in v)}
    indices = {k: v for k, v in ints.items() if v == sorted(set(v))}  # e.g. full_attn_idxs
    per_layer = {k: v for k, v in per_layer.items() if k not in ints}  # per-layer sizes: derived from the shrunk ones
    if "layer_types" in known and getattr(default, "layer_types", None) is None:  # derived at model build
        per_layer["layer_types"] = ["full_attention"]
    if isinstance(per_layer.get("layer_types"), list):  # layer types the modeling code knows but the default lacks
        per_layer["layer_types"] = _all_layer_types(config_cls, per_layer["layer_types"])
    n_layers = 2
    for value in per_layer.values():
        while len(set(value[:n_layers])) < len(set(value)):
            n_layers += 1
    kwargs["num_hidden_layers"] = n_layers
    kwargs.update({k: v[:n_layers] for k, v in per_layer.items() if k not in FAMILY_EXTRA.get(model_type, {})})
    kwargs.update({k: [i for i in v if i < n_layers] for k, v in indices.items()})
    for k in ("first_k_dense_replace", "num_dense_layers"):  # keep one dense layer, route the rest
        if k in known and isinstance(getattr(default, k, None), int):
            kwargs[k] = min(getattr(default, k), 1)
    if "head_dim" in kwargs and getattr(default, "head_dim", None) == getattr(default, "qk_rope_head_dim", 0):
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA: head_dim is the rope part
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:  # MLA: every head has its own k and v
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    rope = getattr(default, "rope_parameters", None)
    if rope == {} and isinstance(kwargs.get("layer_types"), list):  # keyed by layer type, but empty by default
        kwargs["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in kwargs["layer_types"]}
    attempts = [kwargs]
    own = getattr(default, "layer_types", None)
    if "layer_types" in per_layer and isinstance(own, list) and per_layer["layer_types"] != own:  # its own types
        attempts.append({**kwargs, "layer_types": default.layer_types[:2], "num_hidden_layers": 2})
    for group in (_MIXER_KEYS, _MLA_KEYS, _MOE_KEYS):
        attempts += [{k: v for k, v in a.items() if k not in group} for a in list(attempts)]
    error = None
    for attempt in attempts:
        try:
            yield config_cls(**attempt)
        except Exception as exc:  # noqa: BLE001 - try the next, less shrunk variant
            error = error or exc
    if error is not None:
        raise error


def tiny_config(model_type: str):
    """The first config ``tiny_configs`` builds."""
    return next(tiny_configs(model_type))


_MIXER_KEYS = {k for k in SHRINK if k.startswith(("mamba_", "linear_", "conv_", "state_"))}
_MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "head_dim"}
_MOE_KEYS = {k for k in SHRINK if "expert" in k or k.startswith(("moe_", "n_group", "topk_"))}


def _all_layer_types(config_cls, default: list[str]) -> list[str]:
    """``default`` followed by the sequence-mixer layer types its modeling code names that ``default`` lacks."""
    import importlib
    import inspect

    from transformers.configuration_utils import ALLOWED_LAYER_TYPES

    module = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError):
        return default
    mixers = [t for t in ALLOWED_LAYER_TYPES if t not in ("moe", "dense", "sparse") and f'"{t}"' in source]
    extra = [t for t in mixers if t not in default]
    return list(dict.fromkeys(default))[:1] + extra + default[1:] if extra else default


def _is_dropout(name: str, value) -> bool:
    return ("dropout" in name or "pdrop" in name) and isinstance(value, float)


def _shrinkable(old, new) -> bool:
    """Only fields the family uses: a number replaces a number, a flag a flag (``None`` stays: a feature it lacks)."""
    if isinstance(new, bool) or isinstance(old, bool):
        return isinstance(new, bool) and isinstance(old, bool)
    return isinstance(old, (int, float))


def build_model(
    model_type: str,
    class_name: str,
    seed: int = 0,
    router_logits: bool = True,
    crossed: bool = False,
    float64: bool = False,
):
    """A tiny random-init fp32 model (``float64``: in float64, ``exactness.widened``): sdpa if the family
    supports it, else eager; every weight perturbed so that no zero-initialised projection hides a difference; in
    eval mode, so that no random draw differs between the runs (gradients are computed all the same). ``crossed``:
    with its length-dependent settings brought under the test rows (``length_crossing.cross_config``; the same
    weights), the settings in ``model.crossed_settings`` (empty: nothing to cross, the model is the default one)."""
    import transformers

    model_cls = getattr(transformers, class_name)
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    error = None
    for config in tiny_configs(model_type, router_logits):  # the first variant the model class builds from
        try:
            model = _instantiate(model_cls, config, attn, seed)
            break
        except Exception as exc:  # noqa: BLE001 - the next variant, else the first error
            error = error or exc
    else:
        raise error
    model.crossed_settings = {}
    if crossed:
        dims = rope_dims(model)
        for runtime_rope in (True, False):  # a rope type its rotary class refuses at build (RecurrentGemma): without
            config, settings = cross_config(model.config, dims, runtime_rope)
            if config is None:
                break
            try:
                crossed_model = _instantiate(model_cls, config, attn, seed)
            except Exception:  # noqa: BLE001 - without the runtime rope, else its error
                if not runtime_rope:
                    raise
                continue
            crossed_model.crossed_settings = settings
            return widened(crossed_model) if float64 else crossed_model
    return widened(model) if float64 else model


def _instantiate(model_cls, config, attn: str, seed: int):
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.02)
    weak_decay(model)
    unit_scale_temperature(model)
    return model.eval()  # no dropout, no training-time sampling (PhiMoE's sparsemixer): gradients all the same


def unit_scale_temperature(model) -> None:
    """Attention with scale 1 leaves the temperature to its learned q / k norms (Gemma3n, Gemma4); at their unit
    init the logits of a tiny model are ``sqrt(head_dim)`` wide and so sharp that fp32 round-off alone moves some
    gradients past the tolerance (fp64 runs agree to 3e-7). Scale those norms to the usual ``1 / sqrt(head_dim)``."""
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "scaling", None) == 1.0 and hasattr(m, "q_norm") and hasattr(m, "head_dim"):
                for norm in (m.q_norm, getattr(m, "k_norm", None)):
                    if getattr(norm, "weight", None) is not None:
                        norm.weight.mul_(m.head_dim**-0.25)


# ----------------------------------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------------------------------
def _tokens(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=g)


def _objective(model, shard: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's sum of token losses, and its share of the router aux loss (the model's ``aux_loss``) if any."""
    keys = ("input_ids", "position_ids", "attention_mask")  # the mask, where SP padded: 0 on its padding document
    out = model(**{k: shard[k] for k in keys if k in shard})
    shift_labels = shard["shift_labels"]
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), shift_labels.flatten(), reduction="sum")
    aux = getattr(out, "aux_loss", None)
    return loss, aux


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _reference(model, docs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Each document alone: sum of token losses, plus the aux loss of the whole row: the family's own
    ``load_balancing_loss_func`` over every document's router logits (token-weighted per-document aux losses where
    the family has no such function)."""
    import sys

    model.zero_grad(set_to_none=True)
    lbl = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    losses, logits, auxes = [], [], []
    for doc in docs:
        labels = torch.cat([doc[1:], torch.tensor([-100])]).unsqueeze(0)
        out = model(input_ids=doc.unsqueeze(0), position_ids=torch.arange(len(doc)).unsqueeze(0))
        losses.append(F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"))
        if getattr(out, "aux_loss", None) is not None:
            auxes.append(out.aux_loss * len(doc) / sum(len(d) for d in docs))
            logits.append(out.router_logits)
    total = sum(losses)
    if auxes and lbl is not None and hasattr(model, "num_experts_per_tok"):
        whole_row = tuple(torch.cat(layer) for layer in zip(*logits, strict=True))
        total = total + AUX_COEF * lbl(whole_row, model.num_experts, model.num_experts_per_tok, None)
    elif auxes:
        total = total + AUX_COEF * sum(auxes)
    total.backward()
    return total.item(), _grads(model)


def _sp_run(model, sp, docs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """The packed row under SP: each rank's token-loss sum plus ``AUX_COEF x`` its share of the router aux loss (the
    shares sum to the whole row's), gradients summed."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    ids = torch.cat(docs).unsqueeze(0)
    positions = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    labels = ids.clone()
    labels[positions == 0] = -100  # a document's last token predicts nothing (not the next document's first)
    shard = sp.shard_batch({"input_ids": ids, "position_ids": positions, "labels": labels})
    loss, aux = _objective(model, shard)
    if aux is not None:
        loss = loss + AUX_COEF * aux
    loss.backward()
    group = sp.topology.sp_group
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = _grads(model)
    flat = torch.cat([g.flatten() for g in grads.values()])
    dist.all_reduce(flat, group=group)
    out, i = {}, 0
    for name, g in grads.items():
        out[name] = flat[i : i + g.numel()].view_as(g)
        i += g.numel()
    return total.item(), out


compare = worst_error  # the name tests/interpreter/workers.py imports


def check_family(
    model_type: str,
    class_name: str,
    sp_size: int,
    ring_size: int | None,
    seed: int = 0,
    router_logits: bool = True,
    crossed: bool = False,
    prepared: dict | None = None,
    inject: tuple[float, bool] | None = None,
) -> dict:
    """One family on every rank of the default group, in fp32: the outcome as a dict (``status``, ``detail``);
    ``exact`` within ``EXACT``, ``over`` past it (``run_families`` then judges it by ``exactness.judge``, ``error`` /
    ``where`` the fp32 gap); ``crossed``: with its length-dependent settings under the rows (``crossed``: what,
    ``acts``: how much they change the reference, relative), or ``status`` "nothing to cross". ``prepared``: its
    ``references``, computed by another rank (``prepare_references``); else computed here. ``inject``: a negative
    control's SP error (``exactness.inject_error``'s size and ``fp32_only``)."""
    try:
        model = build_model(model_type, class_name, seed, router_logits, crossed)
    except Exception as exc:  # noqa: BLE001 - recorded as "can't build"
        return {"status": "can't build", "detail": _first_line(exc)}
    extra = {"crossed": model.crossed_settings} if crossed else {}
    if crossed and not model.crossed_settings:
        return {"status": "nothing to cross", "detail": ""}
    try:  # no collective: a model SP refuses needs no reference run
        _validate(model, sp_size, ring_size)
    except ValueError as exc:
        return {"status": "refused", "detail": _first_line(exc), **extra}
    rows = _rows(seed)
    if prepared is None or "refs" not in prepared and "error" not in prepared:
        prepared = references(model, model_type, class_name, rows, seed, router_logits, crossed)
    if "error" in prepared:  # the family doesn't run even without SP
        return {"status": "can't build", "detail": prepared["error"], **extra}
    if crossed:
        extra["acts"] = prepared["acts"]
    try:
        worst = _sp_gap(model, prepared["refs"], rows, sp_size, ring_size, inject)
    except ValueError as exc:
        return {"status": "refused", "detail": _first_line(exc), **extra}
    except Exception as exc:  # noqa: BLE001 - a crash, or a hang the gloo timeout turned into an error
        return {"status": "crash", "detail": f"{type(exc).__name__}: {_first_line(exc)}", **extra}
    status = "exact" if worst[0] <= EXACT else "over"
    return {"status": status, "detail": f"max rel err {worst[0]:.1e}", "error": worst[0], "where": worst[1], **extra}


def _sp_gap(model, refs: list, rows, sp_size: int, ring_size: int | None, inject) -> tuple[float, str]:
    """SP on ``model`` against the one-process ``refs`` of ``rows``: the worst relative error and where."""
    from hf_sp_trainer import apply_sequence_parallel

    sp = apply_sequence_parallel(model, sp_size, ring_size=ring_size)  # its behaviour checks in their own dtypes
    if inject is not None:
        inject_error(model, *inject)
    with float64_scope(model):
        return max(compare(ref, _sp_run(model, sp, docs)) for ref, docs in zip(refs, rows, strict=True))


def float64_gaps(model_type: str, class_name: str, sp_size: int, ring_size: int | None, crossed: bool,
                 refs32: list, inject: tuple[float, bool] | None = None) -> tuple[float, float]:  # fmt: skip
    """On every rank of the group: the family's SP gap wholly in float64, and its one-process fp32 run's (``refs32``)
    own distance from float64 (``exactness.judge``'s float64 run)."""
    model = build_model(model_type, class_name, crossed=crossed, float64=True)
    rows = _rows(0)
    reference = copy.deepcopy(model)
    with float64_scope(reference):
        refs64 = [_reference(reference, docs) for docs in rows]
    gap = _sp_gap(model, refs64, rows, sp_size, ring_size, inject)[0]
    return gap, max(compare(r64, r32)[0] for r64, r32 in zip(refs64, refs32, strict=True))


def judged(outcome: dict, model_type: str, class_name: str, sp_size: int, ring_size: int | None, crossed: bool,
           refs32: list | None, inject: tuple[float, bool] | None = None) -> dict:  # fmt: skip
    """An ``exact`` / ``over`` outcome (agreed by every rank) judged by ``exactness.judge``: collectives on every
    rank alike where the float64 run is wanted (past ``EXACT``, or a ``NEAR_THE_BAR`` family)."""
    if outcome["status"] not in ("exact", "over"):
        return outcome
    name = f"{model_type} sp{sp_size}" + (f" ring{ring_size}" if ring_size else "") + (" crossed" if crossed else "")
    rerun = lambda: float64_gaps(model_type, class_name, sp_size, ring_size, crossed, refs32, inject)  # noqa: E731
    verdict = judge(name, outcome["error"], rerun, outcome["where"], model_type in NEAR_THE_BAR, inject is not None)
    detail = f"max rel err {verdict.fp32:.1e}"
    if verdict.float64 is not None:
        detail += f" (float64 {verdict.float64:.1e}; fp32 round-off of one process {verdict.round_off:.1e})"
    if verdict.exact:
        return outcome | {"status": "exact", "detail": detail, "float64": verdict.float64}
    wrong = outcome | {"status": "wrong", "detail": f"{detail} at {verdict.where}", "float64": verdict.float64}
    if inject is None and getattr(build_model(model_type, class_name).config, "output_router_logits", False):
        alone = check_family(model_type, class_name, sp_size, ring_size, router_logits=False, crossed=crossed)
        wrong["aux_loss_only"] = alone["status"] == "exact"  # is it the router aux loss only? (fp32, informational)
    return wrong


def _validate(model, sp_size: int, ring_size: int | None) -> None:
    from hf_sp_trainer.parallel import default_kernel
    from hf_sp_trainer.validate import validate_model_for_sp

    validate_model_for_sp(model, sp_size, ring_size, default_kernel(model))


def _rows(seed: int) -> list[list[torch.Tensor]]:
    """The two packed rows every family runs: documents ``DOCS``, and one of ``LONG`` tokens."""
    g = torch.Generator().manual_seed(seed + 1)
    return [[_tokens(n, g) for n in DOCS], [_tokens(LONG, g)]]


def references(model, model_type: str, class_name: str, rows, seed: int, router_logits: bool, crossed: bool) -> dict:
    """What ``check_family`` compares the SP runs with: ``refs``, each row's documents alone through a copy of
    ``model`` in this process; ``acts`` (crossed): how far crossing moved them from the default model's; or
    ``error``, the reference run's failure."""
    try:
        reference = copy.deepcopy(model)
        with float64_scope(reference):
            out = {"refs": [_reference(reference, docs) for docs in rows]}
        if crossed:  # the default model's own reference: does crossing change anything at all?
            default = build_model(model_type, class_name, seed, router_logits)
            with float64_scope(default):
                out["acts"] = max(
                    compare(ref, _reference(default, docs))[0] for ref, docs in zip(out["refs"], rows, strict=True)
                )
    except Exception as exc:  # noqa: BLE001 - the family doesn't run even without SP
        return {"error": f"reference run: {_first_line(exc)}"}
    return out


def prepare_references(
    model_type: str, class_name: str, sp_size: int, ring_size: int | None, seed: int = 0, crossed: bool = False
) -> dict | None:
    """``check_family``'s ``references`` for one family, computed by one rank for all (the same model, the same
    rows, the same single-process run: the ranks only share out the work); None where ``check_family`` ends before
    it needs them (can't build, nothing to cross, refused)."""
    try:
        model = build_model(model_type, class_name, seed, True, crossed)
    except Exception:  # noqa: BLE001 - every rank's check_family records it
        return None
    if crossed and not model.crossed_settings:
        return None
    try:
        _validate(model, sp_size, ring_size)
    except ValueError:
        return None
    return references(model, model_type, class_name, _rows(seed), seed, True, crossed)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def run_families(
    names: list[tuple[str, str]],
    sp_size: int,
    ring_size: int | None,
    crossed: bool = False,
    inject: tuple[float, bool] | None = None,
) -> dict:
    """Run in a spawned group: every family in turn, as itself and (``crossed``) again with its length-dependent
    settings crossed (``{"default": ..., "crossed": ...}``); a family's outcome is agreed over all ranks (a
    ValueError counts as a refusal only when every rank raised it), then judged (``judged``). ``inject``: a
    negative control's SP error in every family (``exactness.inject_error``)."""
    import torch.distributed as dist
    from transformers.utils import logging

    logging.set_verbosity_error()
    if not dist.is_initialized():  # a case may run several sweeps in one group
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results: dict[str, dict] = {"default": {}, "crossed": {}}
    world, rank = dist.get_world_size(), dist.get_rank()
    for variant in ("default", "crossed") if crossed else ("default",):
        step = REFERENCES_PER_RANK * world
        for chunk in (names[i : i + step] for i in range(0, len(names), step)):
            # the single-process references of the next families, shared out over the ranks (rank r takes every
            # world-th one: many per rank, so one slow family's reference doesn't keep the other ranks waiting)
            mine = [prepare_references(*name, sp_size, ring_size, crossed=variant == "crossed")
                    for name in chunk[rank::world]]  # fmt: skip
            gathered: list = [None] * world
            try:
                dist.all_gather_object(gathered, mine)
            except Exception as exc:  # noqa: BLE001 - the group is gone: stop here
                results[variant][chunk[0][0]] = {"status": "crash", "detail": f"group lost: {_first_line(exc)}"}
                return results
            prepared = [gathered[j % world][j // world] for j in range(len(chunk))]
            for (model_type, class_name), ready in zip(chunk, prepared, strict=True):
                start = time.perf_counter()
                mine = check_family(model_type, class_name, sp_size, ring_size, crossed=variant == "crossed",
                                    prepared=ready, inject=inject)  # fmt: skip
                mine["seconds"] = round(time.perf_counter() - start, 2)
                everyone: list = [None] * world
                try:
                    dist.all_gather_object(everyone, mine)
                except Exception as exc:  # noqa: BLE001 - the group is gone: stop here
                    results[variant][model_type] = {"status": "crash", "detail": f"group lost: {_first_line(exc)}"}
                    return results
                statuses = {r["status"] for r in everyone}
                if len(statuses) > 1:
                    disagree = "ranks disagree: " + "; ".join(f"{r['status']}" for r in everyone)
                    mine = {"status": "crash", "detail": disagree}
                try:
                    refs32, crossing = (ready or {}).get("refs"), variant == "crossed"
                    mine = judged(mine, model_type, class_name, sp_size, ring_size, crossing, refs32, inject)
                except Exception as exc:  # noqa: BLE001 - the float64 run crashed (the group may be gone)
                    mine = {"status": "crash", "detail": f"float64 run: {type(exc).__name__}: {_first_line(exc)}"}
                results[variant][model_type] = mine
    return results
