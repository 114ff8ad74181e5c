"""Point-to-point shift around a ring process group: send to the next ring rank, receive from the previous one.

Notes (checked with gloo on torch 2.13, including strided subgroups such as ``{0, 2}`` and ``{1, 3}``):
- ``P2POp`` takes GLOBAL peer ranks; ``dist.get_global_rank(group, r)`` translates a ring rank.
- gloo writes garbage into non-contiguous buffers: we send a contiguous tensor and receive into a fresh one.
- Messages between the same two ranks are matched in posting order (per tag). Several shifts may be in flight at
  once (K/V and dK/dV in the backward): every rank posts them in the same order, and each stream has its own tag
  (gloo honours tags; NCCL ignores them and relies on the order alone).
- With a ring of 2 the next and previous ranks are the same process; the send and the receive still pair up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

KV_TAG = 11  # the K/V blocks travelling forward around the ring
GRAD_TAG = 12  # the dK/dV accumulators travelling with them in the backward


class PendingShift:
    """A ring shift in flight: ``wait()`` returns the tensor received from the previous ring rank."""

    def __init__(self, received: torch.Tensor, works: list, sent: torch.Tensor):
        self._received, self._works, self._sent = received, works, sent  # keep the send buffer alive until done

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None
        return self._received


def ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup, tag: int = KV_TAG) -> PendingShift:
    """Post an async send of ``tensor`` to ring rank ``r + 1`` and a receive from ``r - 1`` (into a new contiguous
    buffer of the same shape and dtype). Every rank of ``group`` must call it, in the same order as its other shifts."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send = tensor.contiguous()
    received = torch.empty_like(send, memory_format=torch.contiguous_format)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group, tag),
        dist.P2POp(dist.irecv, received, prev, group, tag),
    ]
    return PendingShift(received, dist.batch_isend_irecv(ops), send)
