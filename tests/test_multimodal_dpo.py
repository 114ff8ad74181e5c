"""DPO and KTO on TRL's vision preference data under SP: ``SPDPOTrainer`` / ``SPKTOTrainer`` against
``trl.DPOTrainer`` / ``trl.KTOTrainer`` on one process."""

from __future__ import annotations

import tempfile

import pytest

from tests.exactness import assert_exact
from tests.harness import params_rel, run_distributed, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not


def _job(sp_size: int, family: str, kind: str) -> dict:
    from tests.multimodal_harness import dpo_vlm

    with tempfile.TemporaryDirectory() as out:
        return dpo_vlm(sp_size, out, family=family, kind=kind)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "kind,family,sp_size",
    [
        ("dpo", "llava", 2),
        ("dpo", "qwen2_vl", 2),
        ("dpo", "qwen3_vl", 2),  # deepstack levels, interleaved rotary sections
        ("dpo", "glm4v", 2),
        ("dpo", "qwen2_vl", 4),
        ("kto", "llava", 2),
        ("kto", "qwen2_vl", 2),
    ],
)
def test_sp_preferences_on_vision_data_match_trl(kind: str, family: str, sp_size: int) -> None:
    """TRL's vision preference formats (``images`` + ``prompt`` / ``chosen`` / ``rejected``; KTO: ``completion`` +
    ``label``), a processor as ``processing_class``: TRL's vision collators pad the rows, each with its images; the
    hooks pack them into one row per forward and every rank encodes the images, keeping its own placeholders' rows.
    A reference model given: every logged metric of three SGD steps of two micro-batches (loss, grad_norm, rewards,
    log-probs, logits; KTO's KL), every eval metric and the policy's weights, vision tower included. LLaVA: 1-D
    positions; Qwen-VL / GLM-4V: their multimodal rotary positions computed by their own ``get_rope_index`` on the
    padded rows, then packed behind the text row."""
    from tests.multimodal_harness import dpo_vlm
    from tests.preference_harness import metric_diffs

    with tempfile.TemporaryDirectory() as out:
        ref = dpo_vlm(1, out, family=family, kind=kind)
    got = unwrap_results(run_distributed(sp_size, _job, sp_size, family, kind))[0]
    assert len(got["logs"]) == len(ref["logs"]) == 3
    diffs = metric_diffs(ref, got)  # rewards and margins relative to beta x the log-probs they come from
    assert {"loss", "grad_norm", "rewards/margins", "logps/chosen", "eval_loss", "eval_rewards/margins"} <= set(diffs)
    if kind == "kto":  # KL estimated from mismatched pairs (clamped at 0: the tiny Qwen-VL pair's stays there)
        assert {"kl", "eval_kl"} <= set(diffs) and (family != "llava" or any(e["kl"] for e in ref["logs"]))
    weights = params_rel(got["params"], ref["params"])
    print(
        kind, family, sp_size, f"worst {max(diffs.values()):.1e} ({max(diffs, key=diffs.get)}); weights {weights:.1e}"
    )
    assert_exact(f"{kind} {family} sp{sp_size}", diffs | {"params": weights})
    assert ref["logs"][0]["rewards/margins"] != ref["logs"][-1]["rewards/margins"]  # the steps trained
    assert any(n.startswith(("model.vision_tower.", "model.visual.")) for n in ref["params"]), list(ref["params"])


def test_hook_positions_are_the_models_own_and_need_token_types() -> None:
    """The preference hooks' positions of a padded Qwen2-VL batch (rows of different lengths, right-padded) are what
    its own ``compute_3d_position_ids`` gives that batch; grids without ``mm_token_type_ids`` raise (in the pre-hook,
    before any collective), as the model's own forward does."""
    import torch

    from hf_sp_trainer.model.vlm import vlm_base
    from hf_sp_trainer.trainers.scoring.hooks import LogProbHooks
    from tests.multimodal_harness import LAYOUTS, build_vlm, make_examples, pad_rows

    model = build_vlm("qwen2_vl")
    hooks = LogProbHooks(sp=None, pad_token_id=0)
    hooks.attach(model)
    batch = pad_rows(make_examples(LAYOUTS["mixed"]))
    got = hooks.rope_positions(batch)
    base = vlm_base(model)
    base.rope_deltas = None
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "video_grid_thw")
    want = base.compute_3d_position_ids(inputs_embeds=None, **{k: batch[k] for k in keys})
    mask = batch["attention_mask"].bool()
    assert torch.equal(got[:, mask], want[:, mask])
    assert not torch.equal(got[0], got[1])  # the h / w rows differ from the time row: images in the batch
    with pytest.raises(ValueError, match="without mm_token_type_ids"):
        hooks.rope_positions({k: v for k, v in batch.items() if k != "mm_token_type_ids"})
    hooks.remove()
