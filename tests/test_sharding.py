"""Sharding a batch along the sequence: shift labels first, pad to a multiple of sp, equal contiguous slices."""

import pytest
import torch

from hf_sp_trainer.sharding import add_shift_labels, pad_to_multiple, prepare_sp_batch, shard_sequence


def _batch(length=11):
    ids = torch.arange(3, 3 + length).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).unsqueeze(0)}


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_shards_reassemble_the_padded_batch(sp):
    full = pad_to_multiple(add_shift_labels(_batch()), sp)
    shards = [prepare_sp_batch(_batch(), rank, sp) for rank in range(sp)]
    for key in full:
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), full[key]), key
    assert len({s["input_ids"].shape[1] for s in shards}) == 1


def test_shard_boundary_keeps_its_prediction():
    first, second = (prepare_sp_batch(_batch(10), rank, 2) for rank in range(2))
    assert first["shift_labels"][0, -1] == second["input_ids"][0, 0]  # last token of shard 0 predicts shard 1


def test_length_not_divisible_is_padded_not_truncated():
    shards = [prepare_sp_batch(_batch(11), rank, 4) for rank in range(4)]
    assert sum(s["input_ids"].shape[1] for s in shards) == 12
    assert shards[-1]["shift_labels"][0, -2:].tolist() == [-100, -100]


def test_attention_mask():
    ones = {**_batch(), "attention_mask": torch.ones(1, 11, dtype=torch.long)}
    assert "attention_mask" not in prepare_sp_batch(ones, 0, 2)
    padded = {**_batch(), "attention_mask": torch.tensor([[1] * 9 + [0] * 2])}
    with pytest.raises(ValueError, match="2 padding zeros"):
        prepare_sp_batch(padded, 0, 2)


def test_unpadded_shard_refuses_uneven_length():
    with pytest.raises(ValueError, match="not a multiple of sp_size=2"):
        shard_sequence(_batch(11), 0, 2)
