"""Whether an installed kernel keeps packed segments apart in one call, for the SP recurrences' batched paths
(``linear_state.SegmentBatch``): FLA's delta rules with ``cu_seqlens`` (``varlen_capable``), mamba_ssm's Mamba2 scan
with ``seq_idx`` (``seq_idx_capable``). Each runs the kernel as it will run for the model (``dispatch_device``) on two
small packed segments against a call on each; transformers' torch paths refuse both arguments (then the SP versions
call them segment by segment).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .check_parts import close, dispatch_device, on_device


def varlen_capable(fn: Callable, device: torch.device | str, channel_decay: bool = False) -> bool:
    """Whether the installed delta-rule kernel ``fn`` runs, for a model on ``device``, many segments in one call
    (``cu_seqlens``: FLA's kernels, where they run, ``dispatch_device``), as ``_varlen_ok`` checks; transformers' torch
    path refuses ``cu_seqlens``: the SP delta rule then calls it once per segment."""
    target = dispatch_device(device)
    return target is not None and _varlen_ok(fn, target, channel_decay)


@functools.cache
def _varlen_ok(fn: Callable, device: str, channel_decay: bool) -> bool:
    """Two segments (6 and 4 tokens) laid end to end in one call with ``cu_seqlens``, each from its own initial
    state: their outputs and final states equal one call on each."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, 10, 2, 16, generator=gen)
    v, s0 = torch.randn(1, 10, 2, 16, generator=gen), torch.randn(2, 2, 16, 16, generator=gen)
    g = -torch.rand(1, 10, 2, *((16,) if channel_decay else ()), generator=gen)
    beta, cu = torch.rand(1, 10, 2, generator=gen), torch.tensor([0, 6, 10])
    q, k, v, s0, g, beta = on_device(device, q, k, v, s0, g, beta)
    run = functools.partial(fn, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        try:
            out, final = run(q, k, v, g=g, beta=beta, initial_state=s0, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
        except (ValueError, TypeError, NotImplementedError):  # transformers' torch path: "can't keep ... apart"
            return False
        alone = [
            run(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=s0[i : i + 1])
            for i, (a, b) in enumerate(((0, 6), (6, 10)))
        ]
    expected_out, expected_final = torch.cat([o for o, _ in alone], 1), torch.cat([f for _, f in alone])
    if out.shape != expected_out.shape or final is None or final.shape != expected_final.shape:
        return False
    return close(out, expected_out) and close(final, expected_final)


def seq_idx_capable(fn: Callable, device: torch.device | str) -> bool:
    """Whether the installed Mamba2 scan ``fn`` runs, for a model on ``device``, a run's segments in one call
    (``seq_idx``: mamba_ssm's kernel, where it runs), as ``_seq_idx_ok`` checks; transformers' torch path refuses
    ``seq_idx``: the SP scan then calls it once per segment."""
    target = dispatch_device(device)
    return target is not None and _seq_idx_ok(fn, target)


@functools.cache
def _seq_idx_ok(fn: Callable, device: str) -> bool:
    """Two segments (5 and 6 tokens, chunks of 8: the cut inside one) in one call with ``seq_idx``: the outputs of a
    call on each, and the second one's final state."""
    gen = torch.Generator().manual_seed(1)
    x, dt = torch.randn(1, 11, 2, 8, generator=gen), torch.randn(1, 11, 2, generator=gen)
    A, (B, C) = -torch.rand(2, generator=gen) - 0.5, torch.randn(2, 1, 11, 1, 16, generator=gen)
    D, bias = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
    seq_idx = torch.tensor([[0] * 5 + [1] * 6], dtype=torch.int32)
    x, dt, A, B, C, D, bias, seq_idx = on_device(device, x, dt, A, B, C, D, bias, seq_idx)
    opts = dict(A=A, D=D, chunk_size=8, dt_bias=bias, dt_softplus=True, return_final_states=True)
    with torch.no_grad():
        try:
            out, final = fn(x, dt=dt, B=B, C=C, seq_idx=seq_idx, **opts)  # past x by name: mamba_ssm's differs
        except (ValueError, TypeError, NotImplementedError):  # transformers' torch path: "can't keep ... apart"
            return False
        alone = [fn(x[:, a:b], dt=dt[:, a:b], B=B[:, a:b], C=C[:, a:b], **opts) for a, b in ((0, 5), (5, 11))]
    expected = torch.cat([o for o, _ in alone], 1)
    if out.shape != expected.shape or final is None or final.shape != alone[1][1].shape:
        return False
    return close(out, expected) and close(final, alone[1][1])
