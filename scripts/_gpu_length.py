"""GPU check of the length-dependent settings under SP (``attention/position_rules.py``), for ``gpu_check.py``.

A whole model step on one packed row of three documents, against each document alone through the model's own forward
(sdpa) on the same device and dtype: the loss and every gradient. On CUDA SP's kernel is torch's varlen attention
(one call per layer, ``cu_seqlens`` from the layout, the chunk layout on Llama-4's chunked layers), which the CPU
tests can't run.

- llama4: chunked attention (chunk 64; 8 dry) and the NoPE temperature (floor 64; 4 dry, ``attn_scale`` 1), documents
  crossing both;
- phi3_longrope: longrope with its threshold between the first shard's positions and the longest document, one
  document per row (one device decides per row).

sp 1 runs on one rank; sp 2 is two processes sharing the one GPU over gloo, Ulysses.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # on the worst relative error (fp32: TF32 off)


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
    return cls._from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).train()


def _rows(case: str, dry: bool) -> list[list[int]]:
    """Document lengths per row: Llama-4 one packed row; longrope one document per row, past the threshold."""
    if case == "llama4":
        return [[40, 13, 60]] if dry else [[700, 150, 1200]]
    return [[40]] if dry else [[1800]]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")


def _worst(ref: tuple[float, dict], got: tuple[float, dict]) -> dict[str, Any]:
    worst, where = abs(got[0] - ref[0]) / abs(ref[0]), "loss"
    norms = {n: g.norm().item() for n, g in ref[1].items()}
    floor = 1e-3 * (sum(v * v for v in norms.values()) / len(norms)) ** 0.5
    for name, g in ref[1].items():
        err = (got[1][name] - g).norm().item() / max(norms[name], floor)
        if err > worst:
            worst, where = err, name
    return {"worst": worst, "where": where}


def _exact(case: str, world: int, device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_sp_trainer import apply_sequence_parallel

    model = _model(case, dry, device, dtype)
    gen = torch.Generator().manual_seed(1)
    rows = [[torch.randint(3, 256, (n,), generator=gen) for n in docs] for docs in _rows(case, dry)]
    model.zero_grad(set_to_none=True)
    total = 0.0
    for docs in rows:  # each document alone
        for doc in docs:
            ids = doc[None].to(device)
            total = total + _loss_sum(model(input_ids=ids).logits, F.pad(ids[:, 1:], (0, 1), value=-100))
    total.backward()
    ref = (total.item(), _grads(model))
    model.zero_grad(set_to_none=True)
    with apply_sequence_parallel(model, world) as sp:
        loss = torch.zeros((), device=device)
        for docs in rows:
            ids = torch.cat(docs)[None]
            positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
            labels = ids.masked_fill(positions == 0, -100)
            shard = sp.shard_batch({"input_ids": ids, "position_ids": positions, "labels": labels})
            shard = {k: v.to(device) for k, v in shard.items() if torch.is_tensor(v)}
            step = _loss_sum(
                model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits, shard["shift_labels"]
            )
            step.backward()
            loss = loss + step.detach()
        kernel = sp.attention.kernel
        grads = _grads(model)
        if world > 1:
            names = sorted(grads)
            flat = torch.cat([grads[n].flatten() for n in names]).contiguous()
            dist.all_reduce(flat, group=sp.topology.sp_group)
            dist.all_reduce(loss, group=sp.topology.sp_group)
            sizes = [grads[n].numel() for n in names]
            grads = {n: g.view_as(grads[n]) for n, g in zip(names, flat.split(sizes), strict=True)}
    rec = _worst(ref, (loss.item(), grads)) | {"kernel": kernel, "documents": _rows(case, dry)}
    return rec | {"within_tol": rec["worst"] <= TOL[str(dtype).removeprefix("torch.")]}


def _worker(rank: int, world: int, port: int, device: str, dry: bool, out_path: str) -> None:
    import torch.distributed as dist
    import transformers
    from _bench_common import end_spawned_worker

    transformers.logging.set_verbosity_error()
    backend = "nccl" if device == "cuda" and world == 1 else "gloo"  # gloo: two ranks on one GPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = [torch.float32, torch.bfloat16] if dev.type == "cuda" else [torch.float32]
    out: dict[str, Any] = {}
    for case in ("llama4", "phi3_longrope"):
        for dtype in dtypes:
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
    """sp 1 and sp 2 (two processes on the device), each in freshly spawned processes: ``{case: figures}``."""
    from _bench_common import free_port

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            path = os.path.join(tmp, f"sp{world}.json")
            try:
                mp.spawn(_worker, args=(world, free_port(), device.type, dry, path), nprocs=world)
                with open(path) as f:
                    out |= json.load(f)
            except Exception as exc:  # noqa: BLE001 - a crashed rank: recorded, sp 1's result kept
                out[f"sp{world}"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    cases = [v for v in out.values() if isinstance(v, dict) and "worst" in v]
    out["within_tol"] = bool(cases) and len(cases) == len(out) and all(v["within_tol"] for v in cases)
    return out
