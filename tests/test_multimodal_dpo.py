"""DPO on TRL's vision preference data under SP: ``SPDPOTrainer`` against ``trl.DPOTrainer`` on one process."""

from __future__ import annotations

import tempfile

import pytest

from tests.harness import run_distributed, unwrap_results

TOL = 1e-5


def _dpo_job(sp_size: int) -> dict:
    from tests.multimodal_harness import dpo_vlm

    with tempfile.TemporaryDirectory() as out:
        return dpo_vlm(sp_size, out)


def test_sp_dpo_on_vision_preferences_matches_trl(sp_size: int = 2) -> None:
    """TRL's vision preference format (``images`` + ``prompt`` / ``chosen`` / ``rejected``, a processor as
    ``processing_class``; TRL's collator pads chosen and rejected rows, each with its images; the hooks pack them into
    one row per step and every rank encodes the images, keeping its own placeholders' rows), LLaVA with a reference
    model: every logged metric of three SGD steps of two micro-batches (loss, grad_norm, rewards, log-probs, logits),
    every eval metric and the policy's weights, vision tower included."""
    from tests.multimodal_harness import dpo_vlm
    from tests.preference_harness import metric_diffs

    with tempfile.TemporaryDirectory() as out:
        ref = dpo_vlm(1, out)
    got = unwrap_results(run_distributed(sp_size, _dpo_job, sp_size))[0]
    assert len(got["logs"]) == len(ref["logs"]) == 3
    diffs = metric_diffs(ref, got)  # rewards and margins relative to beta x the log-probs they come from
    assert {"loss", "grad_norm", "rewards/margins", "logps/chosen", "eval_loss", "eval_rewards/margins"} <= set(diffs)
    assert max(diffs.values()) <= TOL, {k: v for k, v in diffs.items() if v > TOL}
    assert ref["logs"][0]["rewards/margins"] != ref["logs"][-1]["rewards/margins"]  # the steps trained
    diff = sum(float((got["params"][n] - ref["params"][n]).pow(2).sum()) for n in ref["params"]) ** 0.5
    norm = sum(float(ref["params"][n].pow(2).sum()) for n in ref["params"]) ** 0.5
    assert diff / norm <= TOL, diff / norm
    assert any("vision_tower" in n for n in ref["params"])


def _refused_job(family: str, trainer: str) -> str:
    import torch.distributed as dist
    from datasets import Dataset

    import hf_sp_trainer
    from hf_sp_trainer.data.tiny_vlm import tiny_llava_processor
    from tests.harness import quiet_args
    from tests.multimodal_harness import build_vlm, vision_preferences

    dist.init_process_group("gloo")
    config_cls, trainer_cls = {"dpo": ("DPOConfig", "SPDPOTrainer"), "kto": ("KTOConfig", "SPKTOTrainer")}[trainer]
    rows = vision_preferences(4)
    if trainer == "kto":
        rows = [{"images": r["images"], "prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows]
    with tempfile.TemporaryDirectory() as out:
        args = getattr(hf_sp_trainer, config_cls)(**quiet_args(out, 1), sp_size=2, bf16=False, ddp_backend="gloo")
        extra = {"ref_model": build_vlm(family)}  # else TRL loads one by the policy's (empty) hub id
        try:
            getattr(hf_sp_trainer, trainer_cls)(
                model=build_vlm(family), args=args, train_dataset=Dataset.from_list(rows),
                processing_class=tiny_llava_processor(), **extra,
            )  # fmt: skip
        except ValueError as exc:
            return str(exc)
    return "not refused"


@pytest.mark.parametrize(
    "family,trainer,match",
    [("qwen2_vl", "dpo", "3-D rotary positions"), ("llava", "kto", r"text tokens only \(vision data: SPDPOTrainer\)")],
)
def test_vision_preference_data_refused_where_not_exact(family: str, trainer: str, match: str) -> None:
    """Qwen-VL's multimodal rotary positions (per sequence, before packing) and KTO on vision data: a clear error on
    every rank at construction."""
    import re

    for message in unwrap_results(run_distributed(2, _refused_job, family, trainer)):
        assert re.search(match, message), message
