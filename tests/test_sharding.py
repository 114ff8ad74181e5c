"""The one owner of the batch layout: shift labels first, pad to the SP multiple, zigzag for a ring, equal slices,
and back."""

import pytest
import torch

from hf_sp_trainer.sharding import SequenceSharding, add_shift_labels, check_sp_padding, pad_to_multiple

pytestmark = pytest.mark.unit  # in-process


def _batch(length=11):
    ids = torch.arange(3, 3 + length).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).unsqueeze(0)}


@pytest.mark.parametrize("sp,ring", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (4, 4), (6, 3)])
def test_shards_reassemble_the_padded_batch(sp, ring):
    sharding = SequenceSharding(sp, ring)
    full = pad_to_multiple(add_shift_labels(_batch()), sharding.multiple)
    shards = [sharding.shard_batch(_batch(), rank) for rank in range(sp)]
    assert len({s["input_ids"].shape[1] for s in shards}) == 1
    for key in full:
        gathered = torch.cat([s[key] for s in shards], dim=1)
        assert torch.equal(sharding.unshard(gathered), full[key]), key


@pytest.mark.parametrize("sp,ring", [(2, 2), (4, 2), (4, 4)])
def test_ring_ranks_hold_zigzag_chunks(sp, ring):
    """Ring rank i holds chunks i and 2R-1-i; its Ulysses ranks split that portion in order."""
    sharding, length = SequenceSharding(sp, ring), 8 * sp
    chunk, ulysses = length // (2 * ring), sp // ring
    for ring_rank in range(ring):
        portion = torch.cat([sharding.positions(length, ring_rank * ulysses + u) for u in range(ulysses)])
        first, second = ring_rank, 2 * ring - 1 - ring_rank
        expected = [*range(first * chunk, (first + 1) * chunk), *range(second * chunk, (second + 1) * chunk)]
        assert portion.tolist() == expected


def test_shard_boundary_keeps_its_prediction():
    first, second = (SequenceSharding(2).shard_batch(_batch(10), rank) for rank in range(2))
    assert first["shift_labels"][0, -1] == second["input_ids"][0, 0]  # last token of shard 0 predicts shard 1


def test_length_not_divisible_is_padded_not_truncated():
    shards = [SequenceSharding(4).shard_batch(_batch(11), rank) for rank in range(4)]
    assert sum(s["input_ids"].shape[1] for s in shards) == 12
    assert shards[-1]["shift_labels"][0, -2:].tolist() == [-100, -100]
    padded = pad_to_multiple(add_shift_labels(_batch(11)), 4)
    assert padded["position_ids"][0, 11:].tolist() == [0]  # padding is a document of its own
    assert padded["labels"][0, 11:].tolist() == [-100]


def test_ring_pads_to_twice_sp():
    assert SequenceSharding(2, 2).multiple == 4 and SequenceSharding(4, 1).multiple == 4
    shards = [SequenceSharding(2, 2).shard_batch(_batch(11), rank) for rank in range(2)]
    assert [s["input_ids"].shape[1] for s in shards] == [6, 6]


def test_attention_mask():
    ones = {**_batch(12), "attention_mask": torch.ones(1, 12, dtype=torch.long)}
    assert "attention_mask" not in SequenceSharding(2).shard_batch(ones, 0)
    odd = {**_batch(11), "attention_mask": torch.ones(1, 11, dtype=torch.long)}
    masks = [SequenceSharding(2).shard_batch(odd, rank)["attention_mask"] for rank in range(2)]
    assert torch.cat(masks, 1).tolist() == [[1] * 11 + [0]]  # only the SP padding is masked
    padded = {**_batch(), "attention_mask": torch.tensor([[1] * 9 + [0] * 2])}
    with pytest.raises(ValueError, match="2 padding zeros"):
        SequenceSharding(2).shard_batch(padded, 0)


def test_unpadded_shard_refuses_uneven_length():
    with pytest.raises(ValueError, match="not a multiple of 2"):
        SequenceSharding(2).shard(_batch(11), 0)


def test_only_the_sp_padding_may_be_masked():
    padded = pad_to_multiple(_batch(13), 4)
    check_sp_padding(padded["position_ids"], padded["attention_mask"], 4)  # 3 trailing tokens numbered 0, 1, 2
    positions = torch.arange(16).unsqueeze(0)
    for mask, pos, multiple in [
        (padded["attention_mask"], positions, 4),  # masked tokens continuing the last document
        (padded["attention_mask"], padded["position_ids"], 2),  # more padding than SP adds
        (torch.tensor([[0] + [1] * 15]), padded["position_ids"], 4),  # a hole, not trailing
    ]:
        with pytest.raises(ValueError, match="padded batches are not supported"):
            check_sp_padding(pos, mask, multiple)
