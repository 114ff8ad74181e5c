"""What ``gpu_check.py``'s whole-model checks share: a step's loss and gradients, their comparison, the sum over the SP
group, and the spawned worlds (sp 1 on the device; sp 2 as two processes sharing the one GPU over gloo)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # on the worst relative error (fp32: TF32 off)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")


def worst(ref: tuple[float, dict], got: tuple[float, dict]) -> dict[str, Any]:
    """The worst relative error over the loss and every gradient (a gradient against its norm, floored at 1e-3 of
    the typical gradient's), and where."""
    error, where = abs(got[0] - ref[0]) / abs(ref[0]), "loss"
    norms = {n: g.norm().item() for n, g in ref[1].items()}
    floor = 1e-3 * (sum(v * v for v in norms.values()) / len(norms)) ** 0.5
    for name, g in ref[1].items():
        err = (got[1][name] - g).norm().item() / max(norms[name], floor)
        if err > error:
            error, where = err, name
    return {"worst": error, "where": where, "params": len(ref[1])}


def within_tol(rec: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return rec | {"within_tol": rec["worst"] <= TOL[str(dtype).removeprefix("torch.")]}


def summed_over(group, loss: torch.Tensor, per_param: dict[str, torch.Tensor]) -> tuple[float, dict]:
    """This rank's loss and gradients summed over the SP ``group`` (``None``: one rank, as they are)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return loss.item(), per_param
    names = sorted(per_param)
    flat = torch.cat([per_param[n].flatten() for n in names]).contiguous()
    dist.all_reduce(flat, group=group)
    dist.all_reduce(loss, group=group)
    sizes = [per_param[n].numel() for n in names]
    return loss.item(), {n: g.view_as(per_param[n]) for n, g in zip(names, flat.split(sizes), strict=True)}


def start_rank(rank: int, world: int, port: int, device: str) -> torch.device:
    """A spawned rank's process group (NCCL for one rank on CUDA; gloo for two ranks sharing one GPU) and device."""
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    backend = "nccl" if device == "cuda" and world == 1 else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device(device)


def run_worlds(worker: Callable, device: torch.device, *args: Any) -> dict[str, Any]:
    """``worker(rank, world, port, device type, *args, out_path)`` at sp 1 and sp 2, each in freshly spawned
    processes; rank 0 writes its ``{case: figures}`` to ``out_path``; the two merged (a crashed world recorded)."""
    from _bench_common import free_port

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            path = os.path.join(tmp, f"sp{world}.json")
            try:
                mp.spawn(worker, args=(world, free_port(), device.type, *args, path), nprocs=world)
                with open(path) as f:
                    out |= json.load(f)
            except Exception as exc:  # noqa: BLE001 - a crashed rank: recorded, sp 1's result kept
                out[f"sp{world}"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    return out
