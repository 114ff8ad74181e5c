"""A family's SP run against its single-process reference wholly in float64, where fp32 leaves a gap near ``EXACT``
that might be round-off or a real difference: in float64 round-off shrinks by ~1e-9, a real difference does not.

Some modeling code pins fp32 islands (HY-V4's hyper-connections and norms call ``.float()`` and build fp32
parameters); ``Float32AsFloat64`` runs them in float64 too, as a torch function mode (scoped, no patching).
"""

from __future__ import annotations

import copy
import datetime

import torch
from torch.overrides import TorchFunctionMode


def _wider(value):
    return torch.float64 if value is torch.float32 else value


class Float32AsFloat64(TorchFunctionMode):
    """Every fp32 a torch call asks for (``.float()``, a ``torch.float32`` argument) given as float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(_wider(a) for a in args)
        kwargs = {k: _wider(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def float64_errors(model_type: str, class_name: str, crossed: bool) -> dict[str, float]:
    """On every rank of a new default group: the family's worst relative error (``family_harness.worst_error``) at
    sp = the world size against each document alone, in fp32 (``fp32``) and wholly in float64 (``fp64``), and the fp32
    one-process run's own against the float64 one (``fp32_reference``)."""
    import torch.distributed as dist
    from transformers.utils import logging

    from hf_sp_trainer import apply_sequence_parallel
    from tests import family_harness as fh

    logging.set_verbosity_error()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=fh.COLLECTIVE_TIMEOUT_S))
    errors, refs = {}, {}
    for name in ("fp32", "fp64"):
        model = fh.build_model(model_type, class_name, crossed=crossed, float64=name == "fp64")
        reference = copy.deepcopy(model)
        sp = apply_sequence_parallel(model, dist.get_world_size())  # its behaviour checks in their own dtypes
        rows = fh._rows(0)
        with fh.float64_scope(model):
            refs[name] = [fh._reference(reference, docs) for docs in rows]
            runs = [fh._sp_run(model, sp, docs) for docs in rows]
        errors[name] = max(fh.compare(ref, run)[0] for ref, run in zip(refs[name], runs, strict=True))
        sp.remove()
    # how far the fp32 one-process run itself is from float64 (the same weights): fp32 round-off's own size
    errors["fp32_reference"] = max(fh.compare(r64, r32)[0] for r64, r32 in zip(refs["fp64"], refs["fp32"], strict=True))
    dist.barrier()
    dist.destroy_process_group()
    return errors


def vlm_float64_errors(family: str, layout: str, sp_size: int, ring: int | None = None) -> dict[str, tuple]:
    """On every rank of a new default group: a VLM matrix case's worst relative error and where (``multimodal_harness``:
    SP on the packed row against each document alone, loss and every gradient) in fp32 (``fp32``) and wholly in
    float64 (``fp64``: the model, its media and its pinned fp32 islands; its experts on the eager path, as torch's
    grouped_mm takes no float64)."""
    import contextlib

    import torch.distributed as dist
    from transformers.utils import logging

    from hf_sp_trainer import SPMultimodalCollator, apply_sequence_parallel
    from tests.harness import worst_error
    from tests.multimodal_harness import LAYOUTS, build_vlm, make_examples, reference, sp_run

    logging.set_verbosity_error()
    dist.init_process_group("gloo")
    errors = {}
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        model = build_vlm(family).to(dtype)
        if dtype == torch.float64:
            model.set_experts_implementation("eager")
        examples = [
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in example.items()}
            for example in make_examples(LAYOUTS[layout], family)
        ]
        scope = Float32AsFloat64 if dtype == torch.float64 else contextlib.nullcontext
        with scope():
            ref = reference(model, examples)
        batch = SPMultimodalCollator(model)(examples)
        with apply_sequence_parallel(model, sp_size, ring_size=ring) as sp:  # its checks in their own dtypes
            with scope():
                errors[name] = worst_error(ref, sp_run(model, sp, batch))
    dist.barrier()
    return errors
