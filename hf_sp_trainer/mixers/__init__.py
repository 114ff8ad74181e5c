"""Sequence mixers other than attention (convolutions, SSMs, linear attention): detection now, SP support later."""

from .detect import check_sequence_mixers, sequence_mixers

__all__ = ["check_sequence_mixers", "sequence_mixers"]
