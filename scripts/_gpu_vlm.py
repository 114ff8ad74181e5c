"""GPU check of a whole VLM step under SP (``hf_sp_trainer.multimodal``), for ``gpu_check.py``.

exact_*: a Qwen2-VL-shaped model (``bench_vlm_memory.vlm_config``: multimodal rope, a vision tower with its own
kernel) on one packed row of three documents (images, one text-only document) through ``SPMultimodalCollator`` and
``apply_sequence_parallel``; the loss and every gradient, the vision tower's included, against each document alone
through the model's own forward (sdpa) on the same device and dtype. sp 1 runs the SP kernel on one rank (varlen on
CUDA for bf16); sp 2 is two processes sharing the one GPU over gloo (NCCL refuses two ranks on one device), Ulysses,
with the images whole on every rank and split over the ranks (``split_media``).
long_row: one long document (half of it image placeholders) through a 2-layer Qwen2-VL-7B-shaped decoder and a
4-block tower, forward + backward, bf16: peak memory per rank at sp 1 and 2 (sp 2's two ranks share the GPU, so
its time is not a speed figure).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from _gpu_steps import grads, loss_sum, run_worlds, start_rank, summed_over, within_tol, worst


def _examples(gen: torch.Generator, grid: int, lengths: tuple[int, ...], shares: tuple[float, ...]) -> list[dict]:
    from bench_vlm_memory import IMG, long_row

    out = []
    for length, share in zip(lengths, shares, strict=True):
        row = long_row(length, share, grid, gen)
        row.pop("labels")
        row["mm_token_type_ids"] = (row["input_ids"] == IMG).long()
        out.append(row)
    return out


def _model(layers: int, device: torch.device, dtype: torch.dtype, big: bool):
    from bench_vlm_memory import vlm_config
    from transformers import Qwen2VLForConditionalGeneration

    config = vlm_config(layers)
    if big:  # Qwen2-VL-7B's decoder widths, a 4-block tower of its width
        config.text_config.update(dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                       num_key_value_heads=4, vocab_size=32768))  # fmt: skip
        config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]  # Qwen2-VL-7B's: head dim 128
        config.vision_config.update(dict(depth=4, embed_dim=1280, num_heads=16, hidden_size=3584))
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).train()


def _reference(model, examples: list[dict], device) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for ex in examples:
        ids = ex["input_ids"][None].to(device)
        media = {k: (v[None] if k == "mm_token_type_ids" else v).to(device) for k, v in ex.items() if k != "input_ids"}
        if "pixel_values" in media:
            media["pixel_values"] = media["pixel_values"].to(model.dtype)
        logits = model(input_ids=ids, **media).logits
        total = total + loss_sum(logits, F.pad(ids[:, 1:], (0, 1), value=-100))
    total.backward()
    return total.item(), grads(model)


def _sp_step(model, sp, batch: dict, device) -> tuple[torch.Tensor, dict]:
    """This rank's shard forward + backward: (its loss sum, its gradients), not yet reduced."""
    model.zero_grad(set_to_none=True)
    shard = {k: v.to(device) if torch.is_tensor(v) else v for k, v in sp.shard_batch(batch).items()}
    labels = shard.pop("shift_labels")
    shard.pop("labels")
    if "pixel_values" in shard:
        shard["pixel_values"] = shard["pixel_values"].to(model.dtype)
    loss = loss_sum(model(**shard).logits, labels)
    loss.backward()
    return loss.detach(), grads(model)


def _exact(world: int, device, dtype: torch.dtype, split: bool, dry: bool) -> dict[str, Any]:

    from hf_sp_trainer import SPMultimodalCollator, apply_sequence_parallel

    model = _model(2, device, dtype, big=False)
    lengths = (120, 40, 200) if dry else (1500, 300, 2300)
    examples = _examples(torch.Generator().manual_seed(1), 8, lengths, (0.6, 0.0, 0.5))
    ref = _reference(model, examples, device)
    batch = SPMultimodalCollator(model)(examples)
    with apply_sequence_parallel(model, world, split_media=split) as sp:
        loss, per_param = _sp_step(model, sp, batch, device)
        kernel, exchanged = sp.attention.kernel, sp.media.exchanged
        got = summed_over(sp.topology.sp_group, loss, per_param)
    rec = worst(ref, got) | {"kernel": kernel, "tokens": int(batch["input_ids"].shape[1]), "media_split": exchanged}
    return within_tol(rec, dtype)


def _long_row(world: int, device, tokens: int, dry: bool) -> dict[str, Any]:
    from bench_vlm_memory import long_row

    from hf_sp_trainer import SPMultimodalCollator, apply_sequence_parallel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _model(1 if dry else 2, device, dtype, big=not dry)
    row = long_row(tokens, 0.5, 8 if dry else 16, torch.Generator().manual_seed(2))
    row.pop("labels")
    batch = SPMultimodalCollator(model)([row])
    with apply_sequence_parallel(model, world) as sp:
        _sp_step(model, sp, batch, device)  # warm-up: the gradients' memory is allocated
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        _sp_step(model, sp, batch, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    images = len(row["image_grid_thw"])
    return {"tokens": tokens, "images": images, "peak_mb": peak, "step_s": seconds, "dtype": str(dtype)}


def _worker(rank: int, world: int, port: int, device: str, dry: bool, long_tokens: int, out_path: str) -> None:
    import torch.distributed as dist
    from _bench_common import end_spawned_worker

    dev = start_rank(rank, world, port, device)
    dtypes = [torch.float32, torch.bfloat16] if dev.type == "cuda" else [torch.float32]
    out: dict[str, Any] = {}
    cases = [(dtype, split) for dtype in dtypes for split in ((False, True) if world > 1 else (False,))]
    for dtype, split in cases:
        name = f"exact_sp{world}_{str(dtype).removeprefix('torch.')}{'_split' if split else ''}"
        try:
            out[name] = _exact(world, dev, dtype, split, dry)
        except Exception as exc:  # noqa: BLE001 - recorded; the next case still runs
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    try:
        out[f"long_row_sp{world}"] = _long_row(world, dev, long_tokens, dry)
    except Exception as exc:  # noqa: BLE001 - an OOM or a failure: recorded
        out[f"long_row_sp{world}"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    gathered: list[Any] = [out]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, out)
        for key, rec in out.items():  # the peak of the busiest rank
            peaks = [g[key].get("peak_mb") for g in gathered]
            if key.startswith("long_row") and None not in peaks:
                rec["peak_mb"] = max(peaks)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f, default=str)
    end_spawned_worker()


def vlm_checks(device: torch.device, dry: bool) -> dict[str, Any]:
    """sp 1 and sp 2 (two processes on the device), each in freshly spawned processes: ``{case: figures}``."""
    tokens = 1024 if dry else 32768
    out: dict[str, Any] = {"model": "Qwen2-VL-shaped (bench_vlm_memory.vlm_config)", "long_row_tokens": tokens}
    out |= run_worlds(_worker, device, dry, tokens)
    ones, twos = out.get("long_row_sp1", {}), out.get("long_row_sp2", {})
    if ones.get("peak_mb") and twos.get("peak_mb"):
        out["long_row_peak_sp2_vs_sp1"] = twos["peak_mb"] / ones["peak_mb"]
    exact = [v for k, v in out.items() if k.startswith("exact_")]
    out["within_tol"] = bool(exact) and all(v.get("within_tol") for v in exact)
    return out
