"""SP state is held per model: models with different splits live in one process and run interleaved.

On 2 gloo ranks: a Llama split as Ulysses 2, another as a ring of 2, and an LFM2 hybrid (its convolutions exact across
the ranks) — all three attached at once — plus a single-process LFM2 keeping its packed documents apart (sp_size 1,
the same decoder pre-hook without a topology). Their forwards run one after the other, then the backwards in reverse
order; each model's loss and gradients (summed over its SP group) equal its single-process reference. With one
process-global attention or mixer context, the models attached first would run the last one's split.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.exactness import assert_exact
from tests.harness import run_distributed, synthetic_dataset, tiny_model, unwrap_results

SPLITS = {"llama_ulysses": ("llama", 1), "llama_ring": ("llama", 2), "lfm2_hybrid": ("lfm2", None)}


def interleaved_models() -> dict[str, float]:
    import torch.distributed as dist
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import apply_sequence_parallel
    from hf_sp_trainer.mixers.documents import keep_documents_apart
    from scripts._gpu_steps import grads, loss_sum, summed_over, worst

    dist.init_process_group("gloo")
    batch = DataCollatorWithFlattening(return_position_ids=True)(synthetic_dataset(3, seed=7, max_len=20))
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    shifted = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)

    models, references = {}, {}
    for seed, (name, (family, _)) in enumerate(SPLITS.items()):
        models[name] = tiny_model(family, seed=seed).train()
        references[name] = copy.deepcopy(models[name])
    apart = tiny_model("lfm2", seed=9).train()  # sp_size 1, documents kept apart, in the same process
    apart_reference = copy.deepcopy(apart)
    for reference in (*references.values(), apart_reference):
        keep_documents_apart(reference)  # the hybrid's one-device reference: each document alone (no-op for Llama)

    expected = {}
    for name, reference in {**references, "lfm2_apart": apart_reference}.items():
        loss = loss_sum(reference(**inputs).logits, shifted)
        loss.backward()
        expected[name] = (loss.item(), grads(reference))

    sps = {name: apply_sequence_parallel(models[name], 2, ring_size=ring) for name, (_, ring) in SPLITS.items()}
    assert keep_documents_apart(apart) is not None
    losses = {}
    for name, sp in sps.items():  # every forward first: each model's layers must find their own SP
        shard = sp.shard_batch(batch)
        logits = sp.model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        losses[name] = loss_sum(logits, shard["shift_labels"])
    losses["lfm2_apart"] = loss_sum(apart(**inputs).logits, shifted)
    out = {}
    for name in reversed(losses):
        losses[name].backward()
        group = sps[name].topology.sp_group if name in sps else None
        model = models.get(name, apart)
        out[name] = worst(expected[name], summed_over(group, losses[name].detach(), grads(model)))["worst"]
        topology = sps[name].topology if name in sps else None
        out[f"{name}_split"] = f"ulysses {topology.ulysses_size} x ring {topology.ring_size}" if topology else "sp 1"
    for sp in sps.values():
        sp.remove()
    return out


@pytest.mark.dist
def test_models_with_different_splits_in_one_process() -> None:
    for rank, result in enumerate(unwrap_results(run_distributed(2, interleaved_models, timeout=600))):
        for name in (*SPLITS, "lfm2_apart"):
            assert_exact(f"rank {rank} {name} ({result[f'{name}_split']})", {"worst": result[name]})
