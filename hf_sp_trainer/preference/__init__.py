"""Exact sequence parallelism for TRL's preference trainers (DPO, reward, KTO): sequence-level terms computed over
shards and summed over the SP group with autograd (``reduce.sequence_all_reduce``)."""

from .reduce import SequenceAllReduce, sequence_all_reduce

__all__ = ["SequenceAllReduce", "sequence_all_reduce"]
