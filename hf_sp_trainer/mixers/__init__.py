"""Sequence mixers other than attention under SP: hybrid models' convolutions and linear recurrences (Gated DeltaNet,
KDA, Mamba1 and Mamba2, lightning attention, the RG-LRU) run exactly (``swap.attach_mixers``: conv halo, state
summaries gathered across ranks into one carry loop, ``linear_state``; ``documents.keep_documents_apart`` at sp_size
1). Which mixers a model has, and which are refused, is a model fact (``model.mixers``)."""

from ..model.mixers import check_sequence_mixers, covered_mixers, sequence_mixers

__all__ = ["check_sequence_mixers", "covered_mixers", "sequence_mixers"]
