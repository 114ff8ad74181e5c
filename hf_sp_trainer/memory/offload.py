"""Host offload of the tensors a checkpointed layer saves (its input hidden states), as ``saved_tensors_hooks``.

Forward (``pack``): each saved device tensor is copied into a pinned host buffer on a side stream, which first waits
for the compute stream (the tensor is ready) and is recorded on the tensor (its device memory is not reused before the
copy has read it); the device tensor is then released. Backward (``unpack``): the compute stream waits for that copy's
event and copies the buffer back (pinned, so asynchronously to the host). Parameters and small tensors stay put.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _OnHost:
    host: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None  # recorded on the side stream after the device-to-host copy


class HostOffload:
    """``pack`` / ``unpack`` hooks moving saved ``device_type`` tensors of at least ``min_bytes`` to host memory.

    ``device_type="cuda"`` is the real use (pinned buffers, a side stream per device); ``"cpu"`` copies into a fresh
    host buffer synchronously, which exercises the same hooks where no accelerator exists (tests).
    """

    def __init__(self, device_type: str = "cuda", min_bytes: int = 1 << 16):
        self.device_type, self.min_bytes = device_type, min_bytes
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.packed = 0  # tensors moved so far (instrumentation)

    def _moves(self, t: torch.Tensor) -> bool:
        return (
            t.device.type == self.device_type
            and not isinstance(t, torch.nn.Parameter)
            and t.numel() * t.element_size() >= self.min_bytes
        )

    def pack(self, t: torch.Tensor):
        if not self._moves(t):
            return t
        self.packed += 1
        if self.device_type != "cuda":
            return _OnHost(t.detach().to("cpu", copy=True), t.device, None)
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        t.record_stream(stream)
        return _OnHost(host, t.device, copied)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.copied is None:
            return packed.host.to(packed.device, copy=True)
        torch.cuda.current_stream(packed.device).wait_event(packed.copied)
        return packed.host.to(packed.device, non_blocking=True)
