"""Settings that switch on with sequence length, brought under the test rows (documents of 9-40 tokens, shards of
10-20): the "crossed" configs of the family suite and the VLM matrix.

A 40-token row with a default config proves nothing about a 4K sliding window, an 8K attention chunk or a rope
threshold at 4K. ``cross_config`` finds such settings generically, by attribute name (``CROSSED``) and in the rope
parameters, never by family name, and returns the config with each brought under the row:

- windows, attention chunks, temperature floors, sparse top-k and kernel chunk / block sizes: ``CROSSED``; a window
  the config can switch on (``use_sliding_window``, Qwen2 and its VLM decoders) switched on, from layer 1;
- rope: yarn / llama3 thresholds to 8 (static at init); a layer type on the default rope is switched to a runtime-length
  rope (longrope, or dynamic NTK where the config refuses longrope) with its threshold at 24: above the packed row's
  documents (<= 18 tokens) and the first sp-2 shard (positions < 20), below the 40-token document, so each document
  alone, one device and SP must all agree on which side of it a row is.

``tests/test_length_crossing.py`` checks that every length-like attribute of every decoder config of the installed
transformers is either crossed here or classified as not a threshold (``NOT_THRESHOLDS``) or as a setting of a
family SP refuses (``OF_REFUSED_FAMILIES``): a new release's new setting fails until it is classified.
"""

from __future__ import annotations

import copy
import re

import torch

# attribute -> the crossed value (applied wherever a config has it as a larger int)
CROSSED = {
    # mask windows: < 9, the shortest document, so every document is windowed and the window crosses shards
    "sliding_window": 7,
    "sliding_window_size": 7,
    "attention_window_size": 7,
    "local_attention_window_len": 7,
    "window_size": 7,
    "local_attention": 14,  # ModernBERT-decoder's window is half of it
    "keep_window_size": 6,  # Doge's dynamic mask, only past this many keys
    "attention_chunk_size": 8,  # Llama-4's chunked layers: 20 (a shard) is not a multiple of 8
    "floor_scale": 4,  # Llama-4's NoPE temperature steps every 4 positions
    "log_scaling_n_floor": 8,  # Inkling's temperature
    "rel_extent": 7,  # Inkling's relative-bias range (its window's)
    "original_max_position_embeddings": 24,  # a top-level rope threshold (Phi-3's wins over its rope dict's)
    # sparse attention: top-k keys / blocks under the documents' lengths
    "index_topk": 4,
    "index_kpool": 4,  # GLM5-next: index_topk % index_kpool == 0
    "index_topk_blocks": 2,
    "index_block_size": 4,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    # kernel blocking (no semantic effect): chunk boundaries that line up with neither shards nor documents
    "chunk_size": 8,
    "mamba_chunk_size": 8,
    "block_size": 8,
}
COMPANIONS = {"floor_scale": {"attn_scale": 1.0}}  # a temperature strong enough to see in fp32
KERNEL_BLOCKING = {"chunk_size", "mamba_chunk_size", "block_size"}  # crossed, but round-off only on one device
STATIC_ROPE_THRESHOLD = 8  # yarn / llama3: original_max_position_embeddings, used at init only
RUNTIME_ROPE_THRESHOLD = 24  # longrope's original_max_position_embeddings, dynamic NTK's max_position_embeddings
ROPE_KEYS = {"rope_parameters", "rope_scaling"}

# Matched by LENGTH_LIKE but not thresholds a row can cross: table and cache sizes, layer selection (the tiny configs
# list their layer_types), top-k over experts, initialisation ranges, inference-only sizes.
LENGTH_LIKE = re.compile(
    r"window|chunk|block_size|topk|top_k|floor|max_position|n_positions|n_ctx|max_seq|max_length|extent|budget|"
    r"compress|mem_len|clamp_len|keep_|local_attention|bucket|kpool|context_length|seq_len|span|index_local",
    re.I,
)
NOT_THRESHOLDS = {
    "max_position_embeddings": "a rope cache or position-table size (the dynamic-NTK threshold: set with that rope)",
    "model_max_length": "an alias of max_position_embeddings",
    "n_positions": "a position-table size",
    "n_ctx": "a position-table size",
    "max_seq_len": "a rope cache size",
    "max_window_layers": "selects the sliding layers; the tiny configs list their layer_types",
    "sliding_window_pattern": "selects the sliding layers; the tiny configs list their layer_types",
    "prefix_dense_sliding_window_pattern": "selects the sliding layers",
    "chunk_size_feed_forward": "feed-forward chunking, 0 (off)",
    "chunk_size_lm_head": "LM-head chunking",
    "moe_top_k": "top-k over experts",
    "moe_topk": "top-k over experts",
    "top_k_experts": "top-k over experts",
    "topk_group": "top-k over expert groups",
    "centroid_intermediate_top_k": "top-k over experts",
    "time_step_floor": "an SSM initialisation range",
    "linear_dt_init_floor": "an SSM initialisation range",
    "max_inference_chunksize": "inference-only chunking",
    "compress_rope_theta": "a rope base",
    "index_local_blocks": "a count of local blocks (crossed with index_block_size)",
    "image_seq_length": "placeholders per image (a VLM's processor)",
    "video_seq_length": "placeholders per video (a VLM's processor)",
    "audio_chunk_size": "the audio encoder's chunking, outside the text decoder",
    "seconds_per_chunk": "the audio encoder's chunking, outside the text decoder",
}
# Length settings of families SP refuses today (not crossed: a refused family never runs)
OF_REFUSED_FAMILIES = {
    "compress_rates": "DeepSeek-V4's compression ratios",
    "index_compression": "Kolibri-1.1's indexed attention (transformers 5.25; its own NVFP4 top-k mask)",
    "mem_len": "XLNet's memory",
    "clamp_len": "XLNet's relative positions",
    "context_length": "RWKV's kernel length",
    "num_buckets": "relative-position buckets",
    "position_bias_num_buckets": "relative-position buckets",
    "relative_attention_num_buckets": "relative-position buckets",
    "position_bias_max_distance": "relative-position range",
    "local_attn_chunk_length": "Reformer's local attention",
    "lsh_attn_chunk_length": "Reformer's LSH attention",
    "local_num_chunks_before": "Reformer",
    "local_num_chunks_after": "Reformer",
    "lsh_num_chunks_before": "Reformer",
    "lsh_num_chunks_after": "Reformer",
    "local_attention_probs_dropout_prob": "Reformer",
}


def rope_dims(model: torch.nn.Module) -> dict[str | None, int]:
    """The rotary frequencies of ``model`` per layer type (``None``: a rotary for every layer)."""
    dims: dict[str | None, int] = {}
    for m in model.modules():
        for name, buf in m.named_buffers(recurse=False):
            if name.endswith("inv_freq") and not name.endswith("original_inv_freq") and "long" not in name:
                layer_type = name[: -len("_inv_freq")] if name != "inv_freq" else None
                dims.setdefault(layer_type, buf.numel())
    return dims


def cross_config(config, dims: dict[str | None, int], runtime_rope: bool = True):
    """``config`` with its length-dependent settings crossed (``dims``: ``rope_dims`` of a model built from it), and
    what was crossed as ``{setting: value}``; ``(None, {})`` when nothing is. ``runtime_rope``: switch a default rope
    to longrope, else dynamic NTK, else none, as the config's validation allows (off where a row mixes documents on
    both sides of its threshold: one device decides per row, the reference per document)."""
    base = {k: v for k, v in config.to_dict().items() if k not in ("transformers_version", "architectures")}
    for rope in ("longrope", "dynamic", None) if runtime_rope else (None,):
        values, crossed = _crossed_dict(base, dims, rope)
        if not crossed:
            return None, {}
        try:
            new = type(config)(**values)
        except Exception:  # noqa: BLE001 - the config refuses this rope type: the next
            continue
        new._attn_implementation_internal = getattr(config, "_attn_implementation_internal", None)
        return new, crossed
    return None, {}


def _crossed_dict(values: dict, dims: dict[str | None, int], runtime_rope: str | None) -> tuple[dict, dict]:
    values = copy.deepcopy(values)
    crossed: dict[str, object] = {}
    for name, value in CROSSED.items():
        old = values.get(name)
        if isinstance(old, int) and not isinstance(old, bool) and old > value:
            values[name] = value
            crossed[name] = value
            for companion, setting in COMPANIONS.get(name, {}).items():
                values[companion] = setting
                crossed[companion] = setting
    if values.get("use_sliding_window") is False and "sliding_window" in values:  # a window the user can switch on
        values.update(use_sliding_window=True, sliding_window=CROSSED["sliding_window"])
        crossed["sliding_window"] = CROSSED["sliding_window"]
        if "max_window_layers" in values and values.get("num_hidden_layers", 0) > 1:  # layers >= 1 slide
            values.update(max_window_layers=1, layer_types=None)
            crossed["max_window_layers"] = 1
    rope = values.get("rope_parameters")
    per_type = isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values())
    for layer_type, params in sorted(rope.items()) if per_type else [(None, rope)] if isinstance(rope, dict) else []:
        kind = params.get("rope_type", "default")
        where = f"rope[{layer_type}]" if layer_type else "rope"
        if kind in ("yarn", "llama3") and params.get("original_max_position_embeddings", 0) > STATIC_ROPE_THRESHOLD:
            params["original_max_position_embeddings"] = STATIC_ROPE_THRESHOLD
            crossed[f"{where} {kind} threshold"] = STATIC_ROPE_THRESHOLD
        elif kind == "longrope":
            params["original_max_position_embeddings"] = RUNTIME_ROPE_THRESHOLD
            crossed[f"{where} longrope threshold"] = RUNTIME_ROPE_THRESHOLD
        elif kind == "default" and runtime_rope and dims.get(layer_type, dims.get(None)):
            _switch_rope(params, runtime_rope, dims.get(layer_type, dims.get(None)))
            crossed[f"{where} {runtime_rope} threshold"] = RUNTIME_ROPE_THRESHOLD
            if runtime_rope == "dynamic":
                for name in ("max_position_embeddings", "model_max_length"):
                    if name in values:
                        values[name] = RUNTIME_ROPE_THRESHOLD
    if crossed.get("original_max_position_embeddings") and not any("longrope" in k for k in crossed):
        del crossed["original_max_position_embeddings"]  # Phi-3's own field acts only with longrope
    return values, crossed


def _switch_rope(params: dict, kind: str, dim: int) -> None:
    """A default rope dict (theta, partial factor, multimodal sections: kept) switched to ``kind``."""
    params.update(rope_type=kind, factor=4.0)
    if kind == "longrope":
        params.update(
            original_max_position_embeddings=RUNTIME_ROPE_THRESHOLD,
            short_factor=[1.0] * dim,
            long_factor=[1.0 + 0.5 * i for i in range(dim)],
        )


def describe(crossed: dict) -> str:
    """``crossed`` as one short line for ``docs/models.md``."""
    return ", ".join(f"{k} {v}" if not k.endswith("threshold") else f"{k[: -len(' threshold')]} at {v}" for k, v in
                     crossed.items())  # fmt: skip
