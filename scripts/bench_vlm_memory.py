"""Benchmark: per-rank peak memory and step time of one long multimodal row under SP, against one process.

One real ``SPTrainer`` step (forward, backward, AdamW; after a short warm-up step) on a Qwen2-VL-shaped model
(text: hidden 256, 4 layers; vision: patch 14, hidden 128, 2 blocks) per rank at sp 1 / 2 / 4. The row is one
document of ``--lengths`` tokens, ``--image-share`` of them image placeholders (images of ``--grid`` patches, 4
patches per placeholder after the 2x2 merge). Whole media, the VLM path's default: every rank encodes every image
of the row, so the vision tower's activations do not shrink with sp, the decoder's do; ``--media split`` (split media,
``sp_split_media``) splits the images over the ranks instead. ``--tower frozen`` trains the decoder only (the tower
runs under ``no_grad``), ``trained`` trains both. ``--medium video``: the placeholders are one long video instead
(``--grid`` patches per frame side), which split media spreads over the ranks by frame. CPU peak = VmHWM of the measured
step (glibc told to return freed memory). Writes ``vlm_memory.csv/json/png`` (videos: ``vlm_video_memory.*``) to
``--out``.

    python scripts/bench_vlm_memory.py --sp 1 2 4 --lengths 4096 16384 --tower trained frozen --media whole split \
        --out docs/benchmarks/vlm
    python scripts/bench_vlm_memory.py --medium video --sp 1 2 4 --lengths 16384 --tower trained frozen \
        --media whole split --out docs/benchmarks/vlm
    python scripts/bench_vlm_memory.py --smoke            # tests/test_scripts.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _bench_common import end_spawned_worker, free_port, pyplot, set_malloc_env, write_table
from bench_memory import _step_callback

IMG, VID, VSTART, VEND = 1000, 1001, 1002, 1003
PATCH, TEMPORAL, MERGE = 14, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def vlm_config(layers: int = 4):
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    text = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1 << 20,
                rope_parameters=rope)  # fmt: skip
    vision = dict(depth=2, embed_dim=128, hidden_size=256, num_heads=4, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, in_channels=3)  # fmt: skip
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                         vision_start_token_id=VSTART, vision_end_token_id=VEND)  # fmt: skip


def long_row(length: int, image_share: float, grid: int, generator: torch.Generator, video: bool = False) -> dict:
    """One document of ``length`` tokens: text runs and ``<vision_start> <image>*n <vision_end>`` images, or
    (``video``) text around one ``<vision_start> <video>*n <vision_end>`` video of as many frames as fit."""
    if video:
        frames = max(1, int(length * image_share) // (grid * grid // MERGE**2))
        count = frames * grid * grid // MERGE**2
        before = (length - count - 2) // 2
        ids = torch.randint(3, IMG, (before,), generator=generator).tolist() + [VSTART] + [VID] * count + [VEND]
        ids += torch.randint(3, IMG, (length - len(ids),), generator=generator).tolist()
        row = {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
        row["pixel_values_videos"] = torch.randn(frames * grid * grid, PATCH_DIM, generator=generator)
        row["video_grid_thw"] = torch.tensor([[frames, grid, grid]])
        return row
    per_image = grid * grid // MERGE**2
    images = int(length * image_share) // (per_image + 2)
    text = length - images * (per_image + 2)
    gaps = [text // (images + 1)] * (images + 1)
    gaps[-1] += text - sum(gaps)
    ids: list[int] = []
    for i, gap in enumerate(gaps):
        ids += torch.randint(3, IMG, (gap,), generator=generator).tolist()
        if i < images:
            ids += [VSTART] + [IMG] * per_image + [VEND]
    row = {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
    if images:
        row["pixel_values"] = torch.randn(images * grid * grid, PATCH_DIM, generator=generator)
        row["image_grid_thw"] = torch.tensor([[1, grid, grid]] * images)
    return row


def measure(opts, sp: int, tower: str, length: int, media: str, out_dir: str) -> dict:
    from torch.utils.data import SequentialSampler
    from transformers import PrinterCallback, Qwen2VLForConditionalGeneration

    from hf_sp_trainer import SPMultimodalCollator, SPTrainer, TrainingArguments

    class Trainer(SPTrainer):
        def _get_train_sampler(self, train_dataset=None):  # the short warm-up row first
            return SequentialSampler(self.train_dataset)

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration._from_config(vlm_config(opts.layers), attn_implementation="sdpa")
    if tower == "frozen":
        model.model.visual.requires_grad_(False)
    args = TrainingArguments(
        output_dir=out_dir, sp_size=sp, max_steps=2, per_device_train_batch_size=1, optim="adamw_torch",
        learning_rate=1e-5, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=10, use_cpu=True,
        ddp_backend="gloo" if sp > 1 else None, dataloader_num_workers=0, remove_unused_columns=False,
        sp_throughput_logging=False, sp_split_media=media == "split",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(length)
    video = opts.medium == "video"
    rows = [long_row(min(512, length), opts.image_share, opts.grid, generator, video)]
    rows.append(long_row(length, opts.image_share, opts.grid, generator, video))
    images = int(rows[1]["video_grid_thw"][0, 0]) if video else len(rows[1].get("image_grid_thw", []))
    image_tokens = int((rows[1]["input_ids"] == (VID if video else IMG)).sum())
    record = {"sp": sp, "tower": tower, "media": media, "length": length, "images": images}
    record["image_tokens"] = image_tokens
    trainer = Trainer(
        model=model, args=args, train_dataset=rows, data_collator=SPMultimodalCollator(model),  # sp 1 too: one row
        callbacks=[_step_callback("cpu", 1, record)],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    del trainer, model
    gc.collect()
    return record


def _worker(rank: int, world: int, port: int, opts, jobs: list, out_path: str) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import transformers

    transformers.logging.set_verbosity_error()
    results = [measure(opts, world, *job, out_dir=os.path.join(os.path.dirname(out_path), "trainer")) for job in jobs]
    gathered = [results]
    if torch.distributed.is_initialized():
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        for i, rec in enumerate(results):
            per_rank = [g[i] for g in gathered]
            rec.update(peak_mb=round(max(r["peak_mb"] for r in per_rank), 1),
                       base_mb=round(max(r["base_mb"] for r in per_rank), 1),
                       step_s=round(max(r["step_s"] for r in per_rank), 3))  # fmt: skip
        with open(out_path, "w") as f:
            json.dump(results, f)
    end_spawned_worker()


def run(opts, sp: int, jobs: list[tuple[str, int]]) -> list[dict]:
    out_path = os.path.join(tempfile.gettempdir(), "bench_vlm_memory", f"sp{sp}_{time.time_ns()}.json")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    mp.spawn(_worker, args=(sp, free_port(), opts, jobs, out_path), nprocs=sp)
    with open(out_path) as f:
        rows = json.load(f)
    for r in rows:
        what = f"sp={r['sp']} tower {r['tower']:>7} {r['media']:>5} len {r['length']:>6}"
        kind = "frames" if opts.medium == "video" else "images"
        print(f"{what} ({r['images']} {kind}, {r['image_tokens']} media tokens): peak {r['peak_mb']:7.0f} MB/rank  "
              f"step {r['step_s']:6.2f} s", flush=True)  # fmt: skip
    return rows


def save(opts, rows: list[dict]) -> None:
    base = {(r["tower"], r["length"]): r["peak_mb"] for r in rows if r["sp"] == 1}
    for r in rows:
        ref = base.get((r["tower"], r["length"]))
        r["peak_vs_sp1"] = round(r["peak_mb"] / ref, 3) if ref else None
    meta = {"date": time.strftime("%Y-%m-%d"), "threads": os.cpu_count(), "image_share": opts.image_share,
            "grid": opts.grid, "layers": opts.layers, "medium": opts.medium}  # fmt: skip
    name = "vlm_video_memory" if opts.medium == "video" else "vlm_memory"
    write_table(opts.out, name, rows, meta)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for tower, media in dict.fromkeys((r["tower"], r["media"]) for r in rows):
        for length in sorted({r["length"] for r in rows}):
            key = (tower, media, length)
            pick = [r for r in rows if (r["tower"], r["length"]) == (tower, length) and r["sp"] == 1]
            pick += [r for r in rows if (r["tower"], r["media"], r["length"]) == key and r["sp"] > 1]
            pick.sort(key=lambda r: r["sp"])
            style = "--" if media == "split" else "-"
            ax.plot([r["sp"] for r in pick], [r["peak_mb"] for r in pick], style, marker="o",
                    label=f"{tower}, {media}, {length}")  # fmt: skip
    what = "one long video" if opts.medium == "video" else "one long multimodal row"
    ax.set(xlabel="sp", ylabel="peak MB per rank", title=f"{what} (Qwen2-VL-shaped)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(opts.out, f"{name}.png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tower", nargs="+", default=["trained", "frozen"], choices=["trained", "frozen"])
    parser.add_argument(
        "--media",
        nargs="+",
        default=["whole"],
        choices=["whole", "split"],
        help="whole: every rank encodes all images (whole media); split: sp_split_media (split media)",
    )
    parser.add_argument("--medium", default="image", choices=["image", "video"], help="images, or one long video")
    parser.add_argument("--image-share", type=float, default=0.5, help="the share of the row's media tokens")
    parser.add_argument("--grid", type=int, default=16, help="patches per image side (grid**2 / 4 placeholders)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="docs/benchmarks/vlm")
    parser.add_argument("--smoke", action="store_true", help="sp 1 and 2, 1024 tokens, 1 layer")
    opts = parser.parse_args()
    if opts.smoke:
        opts.sp, opts.lengths, opts.tower, opts.layers, opts.grid = [1, 2], [1024], ["trained"], 1, 8
    os.makedirs(opts.out, exist_ok=True)
    set_malloc_env()
    rows = []
    for sp in opts.sp:
        media = opts.media if sp > 1 else ["whole"]  # one process has nothing to split
        rows += run(opts, sp, [(t, n, m) for t in opts.tower for n in opts.lengths for m in media])
    save(opts, rows)


if __name__ == "__main__":
    main()
