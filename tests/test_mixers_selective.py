"""Mamba1's selective scan under SP (``hf_sp_trainer/mixers/selective_scan.py``): the layouts its kernel-level cases
run (in ``tests/test_mixers.py``'s spawned groups, against transformers' ``mamba_selective_scan`` on each document
alone), and, in process, the closed-form correction, the swap's kernel check, and the SP scope that reaches a scan
called without ``**kwargs`` (also in a checkpoint's recompute). The Mamba1 families: ``tests/test_model_families.py``;
Trainer-level: ``tests/test_equivalence_hybrid.py``."""

from __future__ import annotations

import pytest
import torch
from transformers.models.jamba import modeling_jamba as jamba

from hf_sp_trainer.mixers.checks import _selective_ok
from hf_sp_trainer.mixers.selective_scan import discretised_steps, state_output
from tests.test_mixers_mamba2 import layouts

pytestmark = pytest.mark.unit  # in-process

SCAN = getattr(jamba.mamba_selective_scan, "_hf_sp_original", jamba.mamba_selective_scan)


def selective_cases(world: int, ring: int) -> list[tuple[str, str, dict]]:
    """``tests/test_mixers.py`` cases: every layout of ``test_mixers_mamba2``, a relayed one, and the negative control
    (``control_``: no state carried across runs)."""
    cases = layouts(world, ring)
    out = []
    for name, docs in cases.items():
        out.append(
            (f"selective_w{world}_ring{ring}_{name.replace(' ', '_')}", "selective", dict(docs=docs, ring_size=ring))
        )
    docs = cases["one document across every run"]
    relay = dict(docs=cases["start inside the second run"], ring_size=ring, relay=True)
    out.append((f"relay_selective_w{world}_ring{ring}_start_inside_second_run", "selective", relay))
    control = dict(docs=docs, ring_size=ring, carry_state=False)
    out.append((f"control_selective_w{world}_ring{ring}_no_state_passing", "selective", control))
    return out


def _state_output_inputs(length: int, channels: int = 5, state: int = 3):
    gen = torch.Generator().manual_seed(0)
    A = -0.1 - 0.4 * torch.rand(channels, state, generator=gen)
    steps = torch.rand(1, channels, length, generator=gen) * 0.3
    C = torch.randn(1, state, length, generator=gen)
    h = torch.randn(1, channels, state, generator=gen)
    return [t.requires_grad_() for t in (A, steps, C, h)]


def test_state_output_is_the_scan_of_zeros_from_the_state() -> None:
    """``state_output`` equals stepping ``h <- exp(dt A) h``, ``y = C h`` from the state (no input)."""
    A, steps, C, h = (t.detach() for t in _state_output_inputs(9))
    state, expected = h[0].clone(), []
    for t in range(9):
        state = torch.exp(steps[0, :, t, None] * A) * state
        expected.append(state @ C[0, :, t])
    torch.testing.assert_close(state_output(A, steps, C, h)[0], torch.stack(expected, -1), rtol=1e-5, atol=1e-6)


def test_state_output_tiles_equal_one_block() -> None:
    """Tiled (recomputed in the backward, 5 tiles of 2 steps and one of 1) equals one block, values and gradients."""
    one, tiled = _state_output_inputs(11), _state_output_inputs(11)
    weight = torch.randn(1, 5, 11, generator=torch.Generator().manual_seed(1))
    (state_output(*one) * weight).sum().backward()
    out = state_output(*tiled, tile_elements=2 * 5 * 3)
    (out * weight).sum().backward()
    torch.testing.assert_close(out, state_output(*(t.detach() for t in one)))
    for a, b in zip(one, tiled, strict=True):
        torch.testing.assert_close(b.grad, a.grad)


def test_kernel_check_holds_the_kernel_to_its_steps_and_gate() -> None:
    """The swap's check passes transformers' scan and fails one that drops ``delta_bias`` or the gate (what the
    closed-form correction relies on)."""
    assert _selective_ok(SCAN)

    def unbiased(*args, delta_bias=None, **kwargs):
        return SCAN(*args, **kwargs)

    def ungated(*args, z=None, **kwargs):
        return SCAN(*args, **kwargs)

    assert not _selective_ok(unbiased)
    assert not _selective_ok(ungated)
    assert discretised_steps(torch.zeros(1, 2, 3), None, False).dtype == torch.float32


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_checkpoint_recompute_runs_under_the_forward_scope(family: str, monkeypatch) -> None:
    """Mamba's layers get no kwargs and Jamba's mixer passes none to its scan: the scan finds SP's documents in the
    decoder's scope. With reentrant checkpointing the recompute runs in the backward, outside that scope: it runs
    under the scope of its forward, so the gradients equal each document alone; without that (the negative control)
    they do not."""
    import hf_sp_trainer.memory.checkpointing as checkpointing
    from hf_sp_trainer.documents import detach_documents
    from hf_sp_trainer.mixers.documents import keep_documents_apart
    from tests.harness import tiny_model

    model = tiny_model(family, attn="eager", output_router_logits=False).train()
    ids = torch.randint(3, 100, (1, 21), generator=torch.Generator().manual_seed(0))
    lengths = (8, 13)

    def gradients(packed: bool) -> torch.Tensor:
        model.zero_grad()
        if packed:
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            logits = model(input_ids=ids, position_ids=positions).logits
        else:
            logits = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
        logits.square().mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    alone = gradients(packed=False)
    keep_documents_apart(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    rel = lambda g: float((g - alone).norm() / alone.norm())  # noqa: E731
    assert rel(gradients(packed=True)) < 1e-5
    monkeypatch.setattr(checkpointing, "run_in_scope", lambda scope, function, *a, **k: function(*a, **k))
    assert rel(gradients(packed=True)) > 1e-3
    detach_documents(model)
