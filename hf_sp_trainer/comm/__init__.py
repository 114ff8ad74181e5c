"""Every collective of sequence parallelism, each a named (autograd) op beside the buffers it needs.

- ``all_to_all``: Ulysses' head <-> sequence exchange (``all_to_all_op``, a dispatcher op; ``all_to_all_many``: q, k
  and v in one collective, ``all_to_all_packed_op``), ``all_gather_along``;
- ``ring_shift``: the point-to-point K/V shift around a ring group;
- ``gather``: the hybrid mixers' all-gather of small per-rank summaries (conv halos, recurrent states);
- ``reduce``: the sum of sequence-level terms over the SP group with autograd (TRL's preference and RL losses).

gloo writes garbage into non-contiguous buffers: every input and output handed to a collective here is contiguous.
"""

# eager: ``all_to_all`` shares its name with its module, which would otherwise shadow it once imported
from .all_to_all import all_gather_along, all_to_all, all_to_all_many, all_to_all_op, all_to_all_packed_op
from .gather import all_gather_stack
from .reduce import SequenceAllReduce, sequence_all_reduce
from .ring_shift import GRAD_TAG, KV_TAG, PendingShift, ring_shift

__all__ = [
    "GRAD_TAG",
    "KV_TAG",
    "PendingShift",
    "SequenceAllReduce",
    "all_gather_along",
    "all_gather_stack",
    "all_to_all",
    "all_to_all_many",
    "all_to_all_op",
    "all_to_all_packed_op",
    "ring_shift",
    "sequence_all_reduce",
]
