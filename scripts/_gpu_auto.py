"""``gpu_check.py`` check (h): ``checkpoint_policy="auto"`` on the GPU.

A Llama-3.1-8B-shaped stack of 4 layers (sp 1, bf16, AdamW, tiled MLP and fused loss) trains the same rows under
``full``, ``sequence_aware`` and ``auto`` with a budget halfway between what the first two need. Each policy's fifth
step (a short warm-up, then four at the length: ``auto`` measures in its first two) is reported: its peak
(``max_memory_allocated``; CPU dry run: VmHWM), its time, the layers ``auto`` kept, and how far its losses are from
``full``'s (the policies train identically: a kept output is the recomputed one). A fourth run, ``auto_offload``, has
a budget below full checkpointing's peak (half the layers' checkpoints less): ``auto`` then offloads that many layers'
checkpoints to host memory (``offloaded_layers``). Balanced data parallel needs two GPUs: not here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

LAYERS, TOKENS, STEPS = 4, 65536, 4


def auto_checks(ctx: Any, small_llama: Callable) -> dict:
    """``ctx``: ``gpu_check.py``'s (device, dry run, ``measure``); ``small_llama(ctx, layers, **config)`` builds the
    model (checkpointing on)."""
    from bench_memory import LLAMA3_8B

    from hf_sp_trainer.memory.keep_budget import sequence_aware_kept_bytes

    shape = {k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}
    tokens = TOKENS
    if ctx.dry:
        shape.update(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
        shape["vocab_size"], tokens = 256, 512
    per_layer_mb = sequence_aware_kept_bytes(tokens, shape["hidden_size"], 2 if ctx.cuda else 4) / 2**20
    runs = {"full": _policy_run(ctx, small_llama, shape, tokens, "full")}
    runs["sequence_aware"] = _policy_run(ctx, small_llama, shape, tokens, "sequence_aware")
    budget = runs["full"]["peak_mb"] + LAYERS / 2 * per_layer_mb  # about half the layers' outputs fit
    runs["auto"] = _policy_run(ctx, small_llama, shape, tokens, "auto", budget * 2**20) | {"budget_mb": budget}
    checkpoint_mb = tokens * shape["hidden_size"] * (2 if ctx.cuda else 4) / 2**20  # a layer's checkpointed input
    low = runs["full"]["peak_mb"] - LAYERS / 2 * checkpoint_mb  # below full checkpointing: offload about half
    runs["auto_offload"] = _policy_run(ctx, small_llama, shape, tokens, "auto", low * 2**20) | {"budget_mb": low}
    for policy in ("sequence_aware", "auto", "auto_offload"):
        pairs = zip(runs[policy]["losses"], runs["full"]["losses"], strict=True)
        runs[policy]["loss_max_rel_vs_full"] = max(abs(a - b) / abs(b) for a, b in pairs)
    out: dict[str, Any] = {"layers": LAYERS, "tokens": tokens, "kept_mb_per_layer": per_layer_mb, "runs": runs}
    out["auto_within_budget"] = runs["auto"]["peak_mb"] <= budget
    out["auto_offload_within_budget"] = runs["auto_offload"]["peak_mb"] <= low
    if not ctx.cuda:
        out["note"] = "CPU dry run: VmHWM peaks of a tiny model (runtime-dominated); only the wiring is checked"
    return out


def _policy_run(ctx: Any, small_llama: Callable, shape: dict, tokens: int, policy: str, budget: float | None = None):
    """The fifth step (peak MiB, seconds, kept layers) and every step's loss of one policy, from a fresh model."""
    from _bench_common import rss_mb

    from hf_sp_trainer.memory import enable_memory_features
    from hf_sp_trainer.memory.checkpointing import KEEP_BUDGET_MARK

    memory = SimpleNamespace(tiled_mlp=True, tiled_mlp_num_shards=None, fused_loss=True, gradient_checkpointing=True,
                             checkpoint_offloading=False, checkpoint_policy=policy, checkpoint_memory_budget=budget,
                             bf16=False, device=ctx.device)  # fmt: skip
    model = small_llama(ctx, LAYERS, max_position_embeddings=tokens, **shape)
    enable_memory_features(model, memory)
    keep = getattr(model, KEEP_BUDGET_MARK, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=ctx.cuda)

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    steps = []
    for n in [tokens // 8] + [tokens] * STEPS:
        torch.manual_seed(n + len(steps))  # the same rows under every policy
        ids = torch.randint(0, shape["vocab_size"], (1, n), device=ctx.device)
        if keep is not None:  # what the trainer's KeepBudgetCallback hands over
            keep.start_step(torch.cuda.memory_allocated() if ctx.cuda else rss_mb() * 2**20)
        loss, peak, seconds = ctx.measure(lambda ids=ids: step(ids))
        if keep is not None:
            keep.end_step(peak * 2**20)
        steps.append({"peak_mb": peak, "step_s": seconds, "loss": loss})
    kept = keep.kept_layers[-1] if keep is not None else (0 if policy == "full" else LAYERS)
    offloaded = keep.offloaded_layers[-1] if keep is not None and keep.offloaded_layers else 0
    if ctx.cuda:
        torch.cuda.empty_cache()
    return {**steps[-1], "kept_layers": kept, "offloaded_layers": offloaded, "losses": [s["loss"] for s in steps]}
