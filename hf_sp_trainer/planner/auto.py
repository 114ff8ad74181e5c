"""``sp_size="auto"``: the smallest sp whose predicted per-rank peak fits the memory budget.

``choose_sp`` is the whole policy: among the sp dividing the world size (ascending: the largest data-parallel degree,
the least SP communication), the first whose ``estimate`` at the longest row fits ``budget_bytes``; its Ulysses x
ring split is ``split_sp_size``'s (the trainers' default). Nothing fitting is a ``ValueError`` naming the row, the
budget, the world size, the best peak, and what would fit. ``model_shape`` turns a transformers config into the
planner's ``ModelShape`` (``hf-sp-plan`` uses it too). The trainers' side (the row, the budget, the setting from the
arguments) is ``trainers/auto_sp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..topology import split_sp_size
from .memory_model import GIB, ModelShape, Setting, estimate
from .search import granularity, longest_length
from .sparse import check_setting
from .vision import VisionShape

# What the refusal tries, cumulatively, on top of the setting (the argument that switches each on, its fields)
FIXES: tuple[tuple[str, dict], ...] = (
    ("activation_checkpointing=True (gradient_checkpointing before transformers 5.24)", {"checkpointing": "full"}),
    ("fused_loss=True", {"fused_loss": True}),
    ("tiled_mlp=True", {"tiled_mlp": True}),
    ("checkpoint_offloading=True", {"offload": True}),
    ("ZeRO-3 (fsdp='full_shard' or DeepSpeed stage 3)", {"zero": 3}),
)


def vision_params(config) -> int:
    """A VLM's parameters outside its text decoder and LM head (vision tower, projector), counted on the meta
    device."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from ..model.vlm import text_decoder

    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type])
    with torch.device("meta"):
        model = cls(config)
    text = {id(p) for p in text_decoder(model).parameters()}
    text |= {id(p) for p in model.get_output_embeddings().parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in text)


def model_shape(config, name: str = "") -> ModelShape:
    """The planner's shape of a transformers config (a VLM's: its text decoder plus its vision tower). A
    ``ValueError`` for a config the memory model has no count for."""
    shape = ModelShape.from_config(config, name=name)
    vision = VisionShape.from_config(config, vision_params(config)) if hasattr(config, "vision_config") else None
    return replace(shape, vision=vision) if vision else shape


@dataclass(frozen=True)
class SPPlan:
    """``choose_sp``'s answer: the split, the predicted per-rank peak (bytes) at ``length`` tokens, the budget, and
    the predicted peak of every sp tried (smaller sp did not fit)."""

    sp: int
    ulysses: int
    ring: int
    peak: float
    length: int
    budget: float
    world_size: int
    peaks: dict[int, float]

    def describe(self) -> str:
        return (
            f"sp_size={self.sp} (ulysses {self.ulysses} x ring {self.ring}, dp {self.world_size // self.sp}) for "
            f"{self.length:,}-token rows: predicted peak {self.peak / GIB:.2f} GiB per rank of {self.budget / GIB:.2f} "
            f"GiB (tried: {', '.join(f'sp {sp}: {p / GIB:.2f} GiB' for sp, p in self.peaks.items())})"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _smallest_fitting(shape: ModelShape, setting: Setting, length: int, budget: float) -> tuple[int, float] | None:
    for sp in divisors(setting.gpus):
        peak = estimate(shape, replace(setting, sp=sp, ring=None), length).peak
        if peak <= budget:
            return sp, peak
    return None


def _what_fits(shape: ModelShape, setting: Setting, length: int, budget: float) -> str:
    """The refusal's advice: the longest row at the largest sp, and the first cumulative ``FIXES`` that fit."""
    largest = replace(setting, sp=setting.gpus, ring=None)
    longest = longest_length(shape, largest, budget)
    advice = [
        f"At sp {setting.gpus} the longest row that fits is {longest:,} tokens"
        if longest
        else f"At sp {setting.gpus} not even a {granularity(shape, largest):,}-token row fits"
    ]
    names, fields = [], {}
    for name, fix in FIXES:
        if all(getattr(setting, k) == v for k, v in fix.items()):
            continue  # on already
        if fix.get("offload") and (setting.device != "cuda" or shape.sparse is not None):
            continue  # a no-op on CPU; not counted with routed experts / sparse attention
        names, fields = [*names, name], {**fields, **fix}
        found = _smallest_fitting(shape, replace(setting, **fields), length, budget)
        if found:
            advice.append(f"with {', '.join(names)} it fits at sp {found[0]} ({found[1] / GIB:.2f} GiB)")
            break
    else:
        advice.append(f"more GPUs (a larger sp){', LoRA' if not setting.lora else ''} or shorter rows are needed")
    return "; ".join(advice)


def choose_sp(
    shape: ModelShape, length: int, budget_bytes: float, world_size: int, setting: Setting | None = None
) -> SPPlan:
    """The smallest sp dividing ``world_size`` whose predicted peak at ``length`` tokens (the longest row a rank
    group trains on at once) fits ``budget_bytes`` per rank, split as ``split_sp_size`` splits it by default.

    ``setting``: the memory stack, dtype, device, ZeRO stage, LoRA (its ``gpus``, ``sp`` and ``ring`` are replaced;
    default: full checkpointing, bf16, CUDA). The predicted peak includes the planner's runtime reserve
    (``CUDA_OVERHEAD_GIB`` / ``CPU_RUNTIME_MIB``), so ``budget_bytes`` is the whole device. Raises a ``ValueError``
    when no sp fits, or when the memory model has no count for the model or setting."""
    if length < 1 or budget_bytes <= 0 or world_size < 1:
        raise ValueError(f"choose_sp: length {length}, budget {budget_bytes} and world size {world_size} must be > 0.")
    setting = replace(setting or Setting(gpus=world_size, sp=1), gpus=world_size, sp=1, ring=None)
    setting.validate()
    check_setting(shape, setting)
    peaks: dict[int, float] = {}
    for sp in divisors(world_size):
        peaks[sp] = estimate(shape, replace(setting, sp=sp), length).peak
        if peaks[sp] <= budget_bytes:
            ulysses, ring = split_sp_size(sp, shape.heads)
            return SPPlan(sp, ulysses, ring, peaks[sp], length, budget_bytes, world_size, peaks)
    best = min(peaks, key=lambda sp: (peaks[sp], -sp))  # ties (static memory only): the largest sp
    ulysses, ring = split_sp_size(best, shape.heads)
    raise ValueError(
        f"sp_size='auto': {shape.name or 'the model'} does not fit {length:,}-token rows in {budget_bytes / GIB:.2f} "
        f"GiB per rank on {world_size} rank(s) at any sp: the best, sp {best} (ulysses {ulysses} x ring {ring}), "
        f"needs {peaks[best] / GIB:.2f} GiB (predicted). {_what_fits(shape, setting, length, budget_bytes)}. "
        "hf-sp-plan prints the whole table."
    )


__all__ = ["FIXES", "SPPlan", "choose_sp", "divisors", "model_shape", "vision_params"]
