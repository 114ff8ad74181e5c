"""Every case the tier runs in spawned gloo worlds, by world size: each world is spawned once and serves all of its
cases (``workers.serve``); the session fixtures ``world2`` / ``world4`` (``conftest.py``) hold the results."""

from __future__ import annotations

from tests.harness import Case, run_distributed, unwrap_results
from tests.interpreter.workers import KINDS, serve

MAMBA_TRAIN = {"mamba2": True}  # training mode: the fused whole-layer call, switched off under SP, is reached
SP = {"sp1": dict(sp_size=1), "sp2": dict(sp_size=2), "sp2_ring2": dict(sp_size=2, ring_size=2)}
KERNEL_DOCS = [5, 11, 8]  # at sp 2 the middle document straddles the shards
MANY_DOCUMENTS = [4, 3, 5, 2, 7, 1, 4, 3, 5, 6]
# SPTrainer with fused_loss=True (Liger's kernel); intermediate 96: only the logits have VOCAB=128 columns
LIGER = dict(sp_overrides={"fused_loss": True}, model_overrides={"intermediate_size": 96})
LIGER_SP2 = Case("liger_fused_sp2", sp_size=2, world_size=2, **LIGER)

WORLD2 = [
    (f"{kind}_{name}", "sp", dict(kind=kind, train=MAMBA_TRAIN.get(kind, False), **sp))
    for kind in KINDS
    for name, sp in SP.items()
]
WORLD2 += [(f"{kind}_after_sp", "after_sp", dict(kind=kind, sp_size=2)) for kind in KINDS]
WORLD2 += [(f"{kind}_kernel_sp2", "kernel", dict(kernel=kind, docs=KERNEL_DOCS)) for kind in ("gdn", "kda")]
# FLA's cu_seqlens path: 10 documents, 3 to 7 segments per shard, in at most 3 kernel calls per rank
WORLD2 += [
    (f"{kind}_kernel_varlen_sp2", "kernel", dict(kernel=kind, docs=MANY_DOCUMENTS, varlen=True))
    for kind in ("gdn", "kda")
]
WORLD2 += [("gdn_kernel_varlen_ring2", "kernel", dict(kernel="gdn", docs=MANY_DOCUMENTS, varlen=True, ring_size=2))]
# mamba_ssm's seq_idx path: each run's segments in one call
WORLD2 += [
    (f"mamba2_kernel_varlen_{name}", "mamba2_kernel", dict(docs=MANY_DOCUMENTS, varlen=True, ring_size=ring))
    for name, ring in (("sp2", 1), ("ring2", 2))
]
WORLD2 += [(LIGER_SP2.name, "trainer", dict(case=LIGER_SP2))]
# Ulysses 2 x ring 2 on 4 ranks: Qwen3.5's GDN (each kernel's head split and ring relay are the 2-rank cases above)
WORLD4 = [
    (f"{kind}_sp4_ring2", "sp", dict(kind=kind, sp_size=4, ring_size=2, train=MAMBA_TRAIN.get(kind, False)))
    for kind in ("gdn",)
]
WORLDS = {2: WORLD2, 4: WORLD4}


def run_world(world: int) -> dict[str, dict]:
    """Spawn the ``world``-rank gloo group once; every one of its cases' results by name."""
    return unwrap_results(run_distributed(world, serve, WORLDS[world], timeout=1500))[0]
