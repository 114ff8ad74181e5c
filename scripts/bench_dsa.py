"""Bytes DeepSeek sparse attention (DSA) moves under SP, per layer and rank (``hf_sp_trainer/attention/dsa.py``).

Under SP a DSA layer runs Ulysses' all-to-alls (q, k, v and the output, and their gradients) plus two all-gathers
with no gradient: the indexer keys (``index_head_dim`` values per token) and the top-k selections (``index_topk``
int32 per token). This script

1. tabulates those bytes (sent + received per rank, forward + backward, bf16 activations, no recompute) for the real
   shapes of the DSA families SP runs (their transformers default configs: DeepSeek-V3.2, GLM-5, AXK2) over sp and
   length, next to the all-to-alls alone (the same layer without the indexer, i.e. dense MLA under Ulysses); and with
   a ring of 2 (sp = ulysses x 2): the all-to-alls over the Ulysses group plus the all-gather path's K/V of the ring
   group (``dsa.ring_gather``: gathered in the forward, their gradients reduce-scattered in the backward);
2. checks the formulas against the bytes counted in a run: a one-layer tiny DeepSeek-V3.2 on ``sp`` gloo processes,
   every ``all_to_all_single``, ``all_gather`` and the ring path's gather / reduce-scatter of the attention's
   forward and of the backward counted (Ulysses at sp 2, ring 2 at sp 2, Ulysses 2 x ring 2 at sp 4).

    python scripts/bench_dsa.py --out docs/benchmarks/dsa            # the table + the counted checks
    python scripts/bench_dsa.py --smoke --out /tmp/dsa              # small (tests)

Writes ``dsa_bytes.{csv,json}``, ``dsa_counted.json`` and ``dsa_bytes.png`` to ``--out``; prints markdown.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bench  # noqa: E402

FAMILIES = {"deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig", "axk2": "AXK2Config"}


@dataclass
class DSAShape:
    name: str
    heads: int
    qk_dim: int  # q / k head size (nope + rope)
    v_dim: int
    index_dim: int
    topk: int


def shape_of(config, name: str) -> DSAShape:
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    return DSAShape(name, config.num_attention_heads, qk, config.v_head_dim, config.index_head_dim, config.index_topk)


def real_shapes() -> list[DSAShape]:
    import transformers

    return [shape_of(getattr(transformers, cls)(), name) for name, cls in FAMILIES.items()]


def layer_bytes(m: DSAShape, sp: int, length: int, act: int = 2, ring: int = 1) -> dict[str, float]:
    """Bytes sent + received per rank for one layer's forward + backward: an all-to-all over ``U = sp / ring`` ranks
    moves ``2 (U-1)/U`` of its local input, an all-gather (or its gradient's reduce-scatter) ``2 (G-1)`` times the
    part of each of its ``G`` ranks (each rank's part to and from every other). With a ring, each rank gathers its
    ring group's K/V of its ``heads / U`` heads over the ring portions (``length / ring`` tokens each)."""
    local, ulysses = length // sp, sp // ring
    per_token = m.heads * (2 * m.qk_dim + 2 * m.v_dim) * act  # q, k, v in; the output back
    all_to_all = 2 * (2 * (ulysses - 1) / ulysses * local * per_token)  # forward, and the gradients in the backward
    ring_part = length // ring * m.heads // ulysses * (m.qk_dim + m.v_dim) * act  # a rank's K/V after the all-to-all
    ring_kv = 2 * (2 * (ring - 1) * ring_part)  # gathered forward, reduce-scattered backward
    index_keys = 2 * (sp - 1) * local * m.index_dim * act
    selections = 2 * (sp - 1) * local * m.topk * 4
    return {"all_to_all": all_to_all, "ring_kv": ring_kv, "index_keys": index_keys, "selections": selections}


def table(shapes: list[DSAShape], sps: list[int], lengths: list[int]) -> list[dict]:
    """Per shape, sp and length: Ulysses alone and with a ring of 2; ``dsa_over_a2a`` against Ulysses' all-to-alls
    alone at the same sp (the dense layer's)."""
    rows = []
    for m in shapes:
        for sp in sps:
            for ring in (1, 2) if sp > 2 else (1,):
                for length in lengths:
                    b, dense = layer_bytes(m, sp, length, ring=ring), layer_bytes(m, sp, length)["all_to_all"]
                    total = sum(b.values())
                    rows.append({
                        "model": m.name, "sp": sp, "ring": ring, "length": length, "a2a_mb": b["all_to_all"] / 2**20,
                        "ring_kv_mb": b["ring_kv"] / 2**20, "index_keys_mb": b["index_keys"] / 2**20,
                        "selections_mb": b["selections"] / 2**20, "total_mb": total / 2**20,
                        "dsa_over_a2a": total / dense,
                    })  # fmt: skip
    return rows


class Counted:
    """Bytes of the ``all_to_all_single`` / ``all_gather`` calls made while ``on`` (the formulas' conventions)."""

    def __init__(self):
        from hf_sp_trainer.comm import gather as stack  # the ring path's gather and its gradient's reduce-scatter

        self.bytes, self.on, self._stack = collections.Counter(), False, stack
        self._a2a, self._gather = dist.all_to_all_single, dist.all_gather
        self._gather_into, self._reduce_scatter = stack._gather_into, stack._reduce_scatter

    def __enter__(self):
        def size(group) -> int:
            return dist.get_world_size(group)

        def a2a(out, x, *args, group=None, **kwargs):
            if self.on:
                self.bytes["all_to_all"] += 2 * (size(group) - 1) * x.nbytes // size(group)
            return self._a2a(out, x, *args, group=group, **kwargs)

        def gather(parts, x, *args, group=None, **kwargs):
            if self.on:
                key = "index_keys" if x.is_floating_point() else "selections"
                self.bytes[key] += 2 * (size(group) - 1) * x.nbytes
            return self._gather(parts, x, *args, group=group, **kwargs)

        def gather_into(out, x, group=None, **kwargs):
            if self.on:
                self.bytes["ring_kv"] += 2 * (size(group) - 1) * x.nbytes
            return self._gather_into(out, x, group=group, **kwargs)

        def reduce_scatter(out, x, group=None, **kwargs):
            if self.on:
                self.bytes["ring_kv"] += 2 * (size(group) - 1) * out.nbytes
            return self._reduce_scatter(out, x, group=group, **kwargs)

        dist.all_to_all_single, dist.all_gather = a2a, gather
        self._stack._gather_into, self._stack._reduce_scatter = gather_into, reduce_scatter
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_gather = self._a2a, self._gather
        self._stack._gather_into, self._stack._reduce_scatter = self._gather_into, self._reduce_scatter


def tiny_v32(length: int):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=max(1, length // 8), first_k_dense_replace=1,
        max_position_embeddings=4 * length, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV32ForCausalLM(config).float(), config


def _count_worker(rank: int, world: int, port: int, length: int, ring: int, results) -> None:
    from hf_sp_trainer import apply_sequence_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, config = tiny_v32(length)
    sp = apply_sequence_parallel(model, world, ring_size=ring)
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(0))
    batch = sp.shard_batch({"input_ids": ids, "position_ids": torch.arange(length)[None], "labels": ids})
    attention = model.model.layers[0].self_attn
    with Counted() as counted:
        attention.register_forward_pre_hook(lambda *a: setattr(counted, "on", True))
        attention.register_forward_hook(lambda *a: setattr(counted, "on", False))
        loss = model(**batch).loss
        counted.on = True  # the backward: one layer, so every collective in it is the attention's
        loss.backward()
        counted.on = False
    if rank == 0:
        m = DSAShape("tiny", config.num_attention_heads, 16, 16, config.index_head_dim, config.index_topk)
        formula = {k: v for k, v in layer_bytes(m, world, length, act=4, ring=ring).items() if v}
        results.append({"sp": world, "ring": ring, "length": length, "counted": dict(counted.bytes),
                        "formula": formula})  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def counted_check(sp: int, length: int, ring: int = 1) -> dict:
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_count_worker, args=(sp, bench.free_port(), length, ring, results), nprocs=sp)
        return results[0]


def markdown(rows: list[dict], lengths: list[int]) -> str:
    out = ["| model | sp | ring | length | all-to-alls MB | ring K/V MB | index keys MB | selections MB | "
           "DSA / Ulysses all-to-alls |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        if r["length"] in lengths:
            out.append(
                f"| {r['model']} | {r['sp']} | {r['ring']} | {r['length']} | {r['a2a_mb']:.0f} | "
                f"{r['ring_kv_mb']:.0f} | {r['index_keys_mb']:.0f} | {r['selections_mb']:.0f} | "
                f"{r['dsa_over_a2a']:.3f} |"
            )
    return "\n".join(out)


def plot(rows: list[dict], out: str) -> None:
    plt = bench.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    length = max(r["length"] for r in rows)  # the ratio does not depend on the length
    for name in dict.fromkeys(r["model"] for r in rows):
        for ring in (1, 2):
            pts = [r for r in rows if r["model"] == name and r["length"] == length and r["ring"] == ring]
            label = name if ring == 1 else f"{name}, ring 2"
            ax.plot([r["sp"] for r in pts], [r["dsa_over_a2a"] for r in pts], marker="o", label=label,
                    linestyle="-" if ring == 1 else "--")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sp (ranks per sequence)")
    ax.set_ylabel("DSA bytes / Ulysses all-to-all bytes")
    ax.set_title("DSA under SP vs the dense layer's all-to-alls (dashed: a ring of 2, its K/V gathered)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "dsa_bytes.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="dsa_bench")
    parser.add_argument("--smoke", action="store_true", help="a small table and a 64-token counted run")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sps, lengths = ([2, 8], [1 << 15, 1 << 17]) if args.smoke else ([2, 4, 8, 16], [1 << k for k in range(15, 21)])
    shapes = real_shapes()
    rows = table(shapes, sps, lengths)
    bench.write_table(args.out, "dsa_bytes", rows, {"shapes": [asdict(m) for m in shapes], "activations": "bf16"})
    length = 64 if args.smoke else 512
    splits = [(2, 1), (2, 2)] + ([] if args.smoke else [(4, 2)])
    checks = [counted_check(sp, length, ring) for sp, ring in splits]
    bench.write_table(args.out, "dsa_counted", checks, {"model": "tiny DeepSeek-V3.2, one layer, fp32"})
    plot(rows, args.out)
    print(markdown(rows, lengths[-2:]))
    for check in checks:
        print(f"counted vs formula (bytes, sp {check['sp']}, ring {check['ring']}):", check)


if __name__ == "__main__":
    main()
