"""Where the documents of a packed row begin and end, over the full (gathered) sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DocumentLayout:
    """Documents of each row of a packed batch, from its full-sequence ``position_ids``.

    A document starts wherever ``position_ids[t] != position_ids[t - 1] + 1`` (the rule of
    ``transformers.masking_utils.find_packed_sequence_indices``), so padding numbered from 0 forms a document of its
    own that no real token attends to.
    """

    position_ids: torch.Tensor  # [batch, seq]
    segments: list[list[tuple[int, int]]]  # per row: [(start, end), ...]
    _mask_cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> DocumentLayout:
        pos = position_ids.detach().to("cpu", torch.long)
        seq = pos.shape[1]
        starts_flag = torch.ones_like(pos, dtype=torch.bool)
        starts_flag[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        segments = []
        for row in starts_flag:
            starts = row.nonzero().flatten().tolist()
            segments.append(list(zip(starts, starts[1:] + [seq], strict=True)))
        return cls(position_ids=position_ids, segments=segments)

    def document_ids(self) -> torch.Tensor:
        """``[batch, seq]`` index of the document each token belongs to."""
        ids = torch.empty(self.position_ids.shape, dtype=torch.long)
        for r, row in enumerate(self.segments):
            for d, (start, end) in enumerate(row):
                ids[r, start:end] = d
        return ids.to(self.position_ids.device)

    def cu_seq_lens(self) -> tuple[torch.Tensor, int]:
        """Cumulative document lengths over the rows laid end to end (varlen kernels), and the longest document."""
        seq = self.position_ids.shape[1]
        bounds = [r * seq + s for r, row in enumerate(self.segments) for s, _ in row]
        bounds.append(len(self.segments) * seq)
        lengths = [e - s for row in self.segments for s, e in row]
        cu = torch.tensor(bounds, dtype=torch.int32, device=self.position_ids.device)
        return cu, max(lengths)

    def cached(self, key, build):
        """Build once per layout (i.e. once per forward step) what every layer would otherwise rebuild."""
        if key not in self._mask_cache:
            self._mask_cache[key] = build()
        return self._mask_cache[key]
