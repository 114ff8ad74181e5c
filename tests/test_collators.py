"""SPDataCollator: position_ids packing with DataCollatorWithFlattening's label semantics."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_sp_trainer import SPDataCollator

pytestmark = pytest.mark.unit  # in-process

FEATURES = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [10, 11, 12, 13]}]


@pytest.mark.parametrize("with_labels", [False, True])
def test_same_packing_as_data_collator_with_flattening(with_labels):
    features = [dict(f) for f in FEATURES]
    if with_labels:
        for f in features:
            f["labels"] = [-100] + f["input_ids"][1:]
    ours = SPDataCollator()(features)
    theirs = DataCollatorWithFlattening(return_position_ids=True)(features)
    for key in ("input_ids", "labels", "position_ids"):
        assert ours[key].tolist() == theirs[key].tolist(), key
    assert "attention_mask" not in ours


def test_collator_only_packs():
    """Labels are not shifted and the row is not padded here: that happens once, in hf_sp_trainer.sharding."""
    batch = SPDataCollator()(FEATURES)
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 11, 12, 13]]
    assert set(batch) == {"input_ids", "labels", "position_ids"}


def test_already_packed_rows_keep_their_documents():
    packed = {"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]}
    batch = SPDataCollator()([packed, {"input_ids": torch.tensor([10, 11])}])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 11]]


def test_user_labels_are_kept():
    batch = SPDataCollator()([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}])
    assert batch["labels"].tolist() == [[-100, -100, 7, 8]]


def test_empty_examples():
    assert SPDataCollator()([{"input_ids": []}, {"input_ids": [4, 5]}])["input_ids"].tolist() == [[4, 5]]
    with pytest.raises(ValueError, match="every example is empty"):
        SPDataCollator()([{"input_ids": []}])
