"""The packing of TRL's padded preference batches into SP shards, and the SP refusals of the preference configs."""

import pytest
import torch

from hf_sp_trainer.sharding import SequenceSharding
from hf_sp_trainer.trainers.scoring.layout import (
    last_token_slots,
    pack_and_shard,
    real_token_mask,
    scatter_to_grid,
    token_slots,
)

pytestmark = pytest.mark.unit  # in-process


def padded_batch():
    lengths, seq = [9, 4, 7, 3], 9
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for n, length in enumerate(lengths):
        ids[n, :length] = torch.arange(3, 3 + length) + 10 * n
        mask[n, :length] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a two-token prompt
    return ids, mask, labels


@pytest.mark.parametrize("sp_size,ring", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_shards_rebuild_the_padded_batch(sp_size, ring):
    """Summing every rank's scattered per-token results gives the padded batch's, each token exactly once."""
    ids, mask, labels = padded_batch()
    rows, seq = ids.shape
    sharding = SequenceSharding(sp_size, ring)
    slots = token_slots(rows, seq, ids.device)
    total_ids, total_labels, seen, unmasked = 0, 0, 0, 0
    for rank in range(sp_size):
        shard = pack_and_shard(sharding, rank, ids, mask, slots, (rows, seq - 1), labels, pad_token_id=0)
        local_len = shard.inputs["input_ids"].shape[1]
        assert local_len * sp_size % sharding.multiple == 0 and shard.slots.shape == (local_len,)
        unmasked += int(shard.inputs.get("attention_mask", torch.ones(1, local_len)).sum())  # 0: the SP padding
        total_ids = total_ids + scatter_to_grid(shard.inputs["input_ids"][0].double(), shard.slots, shard.grid)
        total_labels = total_labels + scatter_to_grid(shard.inputs["shift_labels"][0].double(), shard.slots, shard.grid)
        seen = seen + scatter_to_grid(torch.ones(local_len, dtype=torch.double), shard.slots, shard.grid)
    assert unmasked == int(mask.sum())  # only the SP padding is masked: every real token counts
    real = mask[:, :-1].bool()
    assert torch.equal(seen.view(rows, seq - 1), real.double())  # every real token once, padding never
    assert torch.equal(total_ids.view(rows, seq - 1)[real], ids[:, :-1][real].double())
    expected = labels[:, 1:].masked_fill(~real, 0).double()  # the next token's label, shifted on the padded rows
    assert torch.equal(total_labels.view(rows, seq - 1).masked_fill(~real, 0), expected)


def test_positions_restart_per_sequence_and_completion_crosses_shards():
    ids, mask, labels = padded_batch()
    sharding = SequenceSharding(4)
    slots = token_slots(*ids.shape, ids.device)
    shards = [pack_and_shard(sharding, r, ids, mask, slots, (4, 8), labels) for r in range(4)]
    positions = torch.cat([s.inputs["position_ids"][0] for s in shards])
    assert positions[:9].tolist() == list(range(9)) and positions[9:13].tolist() == list(range(4))
    with_completion = [bool((s.inputs["shift_labels"] != -100).any()) for s in shards]
    assert all(with_completion[:3])  # the first sequence's completion spans shards 0 and 1


def test_last_token_slots_follow_transformers():
    ids, mask, _ = padded_batch()
    slots = last_token_slots(ids, pad_token_id=0)
    assert [int((row >= 0).nonzero()) for row in slots] == [8, 3, 6, 2]
    assert slots.max() == 3


def test_left_padding_refused():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="not right padding"):
        real_token_mask(torch.ones_like(mask), mask)


@pytest.mark.parametrize("config", ["DPOConfig", "KTOConfig"])
def test_precompute_ref_log_probs_refused(config, tmp_path):
    import hf_sp_trainer

    cls = getattr(hf_sp_trainer, config)
    with pytest.raises(ValueError, match=r"precompute_ref_log_probs=True.*Set precompute_ref_log_probs=False"):
        cls(output_dir=str(tmp_path), sp_size=2, precompute_ref_log_probs=True, report_to="none", use_cpu=True)
