"""Padding-free packing: a list of examples becomes one row, kept apart by ``position_ids``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sharding import IGNORE_INDEX


def _as_list(x: Any) -> list[int]:
    return x.tolist() if hasattr(x, "tolist") else list(x)


@dataclass
class SPDataCollator:
    """Pack examples into a single row with ``position_ids`` restarting at 0 for each document (no attention_mask).

    Labels follow ``transformers.DataCollatorWithFlattening``: the first token of every document gets ``-100``, so
    no document predicts the next one. Already-packed examples (with their own ``position_ids``) keep their
    documents. The collator only packs: shifting, padding and slicing for SP happen once, in
    ``hf_sp_trainer.sharding``.
    """

    separator_id: int = IGNORE_INDEX

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids: list[int] = []
        labels: list[int] = []
        position_ids: list[int] = []
        for feature in features:
            ids = _as_list(feature["input_ids"])
            if not ids:
                continue
            pos = _as_list(feature["position_ids"]) if feature.get("position_ids") is not None else range(len(ids))
            lab = _as_list(feature["labels"]) if feature.get("labels") is not None else ids
            for t, p in enumerate(pos):
                starts_document = t == 0 or p != pos[t - 1] + 1
                labels.append(self.separator_id if starts_document else lab[t])
            input_ids += ids
            position_ids += list(pos)
        if not input_ids:
            raise ValueError("SPDataCollator received a batch in which every example is empty.")
        return {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([position_ids], dtype=torch.long),
        }
