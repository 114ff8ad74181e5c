"""The memory planner: what fits on a GPU for a model, a sequence length and a stack of memory features
(``memory_model``; the searches over it: ``search``), with the per-token and fixed costs of hybrid mixers
(``mixers``), of routed experts, latent and DeepSeek sparse attention (``sparse``) and of a VLM's vision tower
(``vision``). ``hf-sp-plan`` (``cli/plan.py``) prints its tables."""

from ..topology import split_sp_size
from .memory_model import (
    CPU_RUNTIME_MIB,
    CUDA_OVERHEAD_GIB,
    GIB,
    MAX_LENGTH,
    MIB,
    Breakdown,
    ModelShape,
    Setting,
    estimate,
)
from .search import STACKS, AutoKeep, auto_kept_layers, granularity, longest_length, plan_table, sp_options

__all__ = [
    "CPU_RUNTIME_MIB",
    "CUDA_OVERHEAD_GIB",
    "GIB",
    "MAX_LENGTH",
    "MIB",
    "STACKS",
    "Breakdown",
    "ModelShape",
    "Setting",
    "AutoKeep",
    "auto_kept_layers",
    "estimate",
    "granularity",
    "longest_length",
    "plan_table",
    "sp_options",
    "split_sp_size",
]
