"""hf-sp-plan: the analytical memory model against scripts/bench_memory.py measurements, its arithmetic, and the CLI.

The CPU comparison predicts the whole per-process peak (VmHWM) of a bench_memory step: the planner's ``device='cpu'``
mode adds the Python/torch/Trainer runtime as one constant measured once (``planner.CPU_RUNTIME_MIB``). Each row is
also checked without that constant: the step's own memory (peak minus the RSS at the step's start, ``base_mb``)
against the predicted peak minus the predicted start (runtime + weights + AdamW states + DDP buckets).
"""

import argparse
import contextlib
import io
import json
import os
import sys
from dataclasses import replace

import pytest
import torch
import transformers

from hf_sp_trainer import planner
from hf_sp_trainer.cli.plan import load_shape, main
from hf_sp_trainer.planner import MIB, ModelShape, Setting, estimate, longest_length

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "hf_sp_trainer", "data", "tiny_llama.json")
MEASUREMENTS = ("docs/benchmarks/tiny_16k/memory.json", "docs/benchmarks/memory.json",
                "docs/benchmarks/100m_search/memory.json")  # fmt: skip
TOLERANCE = 0.15
STEP_FLOOR_MB = 50  # the step's own memory is only compared where it is larger than allocator noise
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
QWEN2_SMALL = dict(  # a Qwen2: q/k/v projections with biases
    hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
)


def bench_memory():
    scripts = os.path.join(ROOT, "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import bench_memory

    return bench_memory


def shapes() -> dict[str, ModelShape]:
    llama_100m = transformers.LlamaConfig(**bench_memory().LLAMA_100M)
    return {"tiny": load_shape(TINY), "100m": ModelShape.from_config(llama_100m, "100m")}


def bench_setting(row: dict) -> Setting:
    """The planner's setting of a bench_memory row (its combo's TrainingArguments fields, fp32 on CPU)."""
    fields = bench_memory().COMBOS[row["combo"]]
    checkpointing = fields.get("checkpoint_policy", "full") if fields.get("gradient_checkpointing") else "none"
    return Setting(gpus=row["sp"], sp=row["sp"], ring=row.get("ring"), tiled_mlp=fields.get("tiled_mlp", False),
                   fused_loss=fields.get("fused_loss", False), checkpointing=checkpointing,
                   offload=fields.get("checkpoint_offloading", False), dtype="fp32", device="cpu")  # fmt: skip


def compare(shape: ModelShape, row: dict) -> dict:
    """Predicted vs measured peak (MiB), and the step's own memory (peak minus the memory at the step's start)."""
    e = estimate(shape, bench_setting(row), row["length"])
    start = (e.runtime + e.weights + e.optimizer_states + e.comm_buffers) / MIB
    out = {"predicted": e.peak / MIB, "measured": row["peak_mb"], "step_predicted": e.peak / MIB - start,
           "step_measured": row["peak_mb"] - row["base_mb"]}  # fmt: skip
    out["error"] = out["predicted"] / out["measured"] - 1
    out["step_error"] = out["step_predicted"] / out["step_measured"] - 1
    return out


def stored_rows() -> list[dict]:
    """Every measured (model, sp, combo, length) of the stored benchmark files, once per file."""
    rows = {}
    for rel in MEASUREMENTS:
        with open(os.path.join(ROOT, rel)) as f:
            data = json.load(f)
        for row in data["rows"] + [m for s in data.get("searches", []) for m in s.get("measured", [])]:
            rows[(rel, row["model"], row["sp"], row["combo"], row["length"])] = row | {"file": rel}
    return list(rows.values())


def test_stored_measurements_within_tolerance():
    models, failures, lines = shapes(), [], []
    rows = stored_rows()
    assert len(rows) >= 90
    for row in rows:
        c = compare(models[row["model"]], row)
        lines.append(f"{row['file']:<40} {row['model']:>5} sp{row['sp']} {row['combo']:>15} {row['length']:>6}: "
                     f"measured {c['measured']:6.0f} predicted {c['predicted']:6.0f} MiB ({c['error']:+.1%}); step "
                     f"{c['step_measured']:5.0f} vs {c['step_predicted']:5.0f} ({c['step_error']:+.1%})")  # fmt: skip
        if abs(c["error"]) > TOLERANCE:
            failures.append(lines[-1])
        if c["step_measured"] >= STEP_FLOOR_MB and abs(c["step_error"]) > TOLERANCE:
            failures.append("step memory: " + lines[-1])
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


@pytest.mark.e2e
def test_fresh_measurement_within_tolerance(monkeypatch):
    """One 2-process sp 2 bench_memory run of the tiny model at 8K tokens (plain and checkpointed), now."""
    bm = bench_memory()
    from _bench_common import MALLOC_ENV

    for key, value in MALLOC_ENV.items():  # what set_malloc_env does, undone after the test
        monkeypatch.setenv(key, value)
    opts = argparse.Namespace(device="cpu", attn="sdpa", doc_len=0, long_steps=1, auto_budget_gib=None)
    rows = bm.run_jobs(opts, "tiny", 2, [("plain", 8192), ("ckpt_full", 8192)])
    tiny = load_shape(TINY)
    for row in rows:
        c = compare(tiny, row)
        print(row["combo"], c)
        assert abs(c["error"]) <= TOLERANCE, (row, c)
        assert abs(c["step_error"]) <= TOLERANCE, (row, c)
    assert rows[1]["peak_mb"] < rows[0]["peak_mb"]  # checkpointing saves memory


def _meta_params(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(**LLAMA_8B),
        transformers.Qwen2Config(**QWEN2_SMALL),
        transformers.AutoConfig.from_pretrained(TINY),
    ],
    ids=["llama-8b", "qwen2-bias", "tiny-tied"],
)
def test_parameter_count_matches_the_model(config):
    assert ModelShape.from_config(config).params == _meta_params(config)


def test_lora_parameter_count_matches_peft():
    import peft

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    assert load_shape(TINY).lora_params(8) == lora.get_nb_trainable_parameters()[0]


def test_breakdown_by_hand():
    """Weights, gradients and AdamW states (mixed precision 2 + 2 + 12 bytes, ZeRO sharding over all ranks, LoRA) and
    the saved activations of the tiny model without checkpointing."""
    m = ModelShape.from_config(transformers.LlamaConfig(**LLAMA_8B))
    p, n = m.params, 8
    base = Setting(gpus=n, sp=8)
    for zero, (w, g, o) in {0: (p * 2, p * 2, p * 12), 1: (p * 2, p * 2, p * 12 / n), 2: (p * 2, p * 2 / n, p * 12 / n),
                            3: (p * 2 / n, p * 2 / n, p * 12 / n)}.items():  # fmt: skip
        e = estimate(m, replace(base, zero=zero), 65536)
        assert (e.weights, e.gradients, e.optimizer_states) == pytest.approx((w, g, o))
        assert e.comm_buffers == (p * 2 if zero == 0 else 0)
    e = estimate(m, replace(base, lora=True, lora_r=16), 65536)
    assert e.weights == (p + m.lora_params(16)) * 2 and e.gradients == m.lora_params(16) * 2
    assert e.optimizer_states == m.lora_params(16) * 12

    tiny = load_shape(TINY)  # hidden 64, intermediate 256, 2 layers, vocab 128, kv = heads, fp32
    e = estimate(tiny, Setting(gpus=1, sp=1, checkpointing="none", dtype="fp32", device="cpu"), 1024)
    per_token_layer = 2 * 64 * 12 + (3 * 64 + 2 * 64) * 4 + 4 * 256 * 4  # norms, q k v out o_in, MLP
    assert e.saved_activations == 2 * per_token_layer * 1024
    assert e.weights == tiny.params * 4 and e.optimizer_states == tiny.params * 8


def test_longest_length_is_the_boundary():
    m = ModelShape.from_config(transformers.LlamaConfig(**LLAMA_8B))
    budget = 80 * planner.GIB
    for setting in (Setting(gpus=8, sp=8, zero=3), Setting(gpus=8, sp=4, lora=True, fused_loss=True),
                    Setting(gpus=8, sp=8, ring=2, zero=3, tiled_mlp=True, checkpointing="sequence_aware")):  # fmt: skip
        longest, step = longest_length(m, setting, budget), planner.granularity(m, setting)
        assert longest > 0 and longest % step == 0
        assert estimate(m, setting, longest).peak <= budget < estimate(m, setting, longest + step).peak
    assert longest_length(m, Setting(gpus=8, sp=8, zero=0), budget) == 0  # 16 bytes/param of 8B: never fits


def test_memory_stack_and_sharding_only_lengthen():
    m = ModelShape.from_config(transformers.LlamaConfig(**LLAMA_8B))
    budget = 80 * planner.GIB
    for lora, zero in ((True, 0), (False, 3)):
        base = Setting(gpus=8, sp=8, lora=lora, zero=zero)
        stacks = [longest_length(m, replace(base, **fields), budget) for fields in list(planner.STACKS.values())[:5]]
        assert stacks == sorted(stacks) and stacks[0] > 0, stacks
        # pure Ulysses: half the tokens per rank at twice the sp, about twice the length
        sp4 = longest_length(m, replace(base, sp=4), budget)
        assert 1.8 < stacks[1] / sp4 <= 2.05
    zeros = [longest_length(m, Setting(gpus=8, sp=8, zero=z, fused_loss=True), budget) for z in (1, 2, 3)]
    assert zeros == sorted(zeros)


def test_auto_keeps_fewer_layers_as_rows_grow_and_none_at_the_longest():
    """``checkpoint_policy="auto"``: every attention layer keeps its outputs on short rows, fewer as the row grows,
    none at full checkpointing's longest length; the predicted peak stays within the budget."""
    m = ModelShape.from_config(transformers.LlamaConfig(**LLAMA_8B))
    budget = 80 * planner.GIB
    setting = Setting(gpus=8, sp=8, zero=3, tiled_mlp=True, fused_loss=True)
    longest = longest_length(m, setting, budget)
    step = planner.granularity(m, setting)
    kept = [
        planner.auto_kept_layers(m, setting, n, budget) for n in range(step, longest + 1, longest // 16 // step * step)
    ]
    assert kept[0].kept_layers == m.attention_layers and planner.auto_kept_layers(m, setting, longest, budget)[0] == 0
    layers = [k.kept_layers for k in kept]
    assert layers == sorted(layers, reverse=True) and 0 < kept[-4].kept_layers < m.layers
    assert all(k.peak <= budget for k in kept)
    # the all-to-all results on the shortest rows, only where every layer keeps its outputs, fewer as rows grow
    exchanges = [k.kept_exchanges for k in kept]
    assert exchanges[0] == m.attention_layers and exchanges == sorted(exchanges, reverse=True)
    assert all(k.kept_exchanges == 0 for k in kept if k.kept_layers < m.attention_layers)
    assert any(0 < k.kept_exchanges < m.attention_layers for k in kept)
    sequence_aware = longest_length(m, replace(setting, checkpointing="sequence_aware"), budget)
    assert sequence_aware < longest  # what auto adds: sequence_aware's savings where they fit, full's length
    code, out = _run_cli("--model", TINY, "--gpus", "2", "--gpu-memory-gib", "1", "--device", "cpu", "--dtype",
                         "fp32", "--table-zero", "0", "--checkpointing", "auto", "--length", "1024")  # fmt: skip
    assert code == 0 and "checkpoint_policy=auto (budget 1 GiB)" in out and "attention layers keep" in out


def _run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_cli_json_on_the_shipped_config():
    code, out = _run_cli("--model", TINY, "--gpus", "2", "--gpu-memory-gib", "1", "--device", "cpu", "--dtype",
                         "fp32", "--table-zero", "0", "--json")  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert data["model"]["params"] == load_shape(TINY).params and data["model"]["hidden"] == 64
    assert data["prediction"]["length"] == data["longest_length"] > 0
    assert data["prediction"]["peak"] <= planner.GIB
    assert [row["stack"] for row in data["table"]] == [s for s in planner.STACKS if s != "+ activation offload"]
    assert list(data["table"][0]["longest"]) == ["1 (1x1)", "2 (2x1)"]
    assert data["constants"]["CPU_RUNTIME_MIB"] == planner.CPU_RUNTIME_MIB


def test_cli_text_on_a_local_config_json(tmp_path):
    config = dict(LLAMA_8B, model_type="qwen2", num_attention_heads=28, hidden_size=3584, num_key_value_heads=4)
    path = tmp_path / "qwen-like" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    code, out = _run_cli("--model", str(path), "--gpus", "8", "--gpu-memory-gib", "80", "--zero", "3", "--lora",
                         "--fused-loss", "--tiled-mlp", "--length", "131072", "--table-zero", "3")  # fmt: skip
    assert code == 0
    assert out.startswith("qwen-like: ")
    assert "(a) predicted per-GPU peak at 131,072 tokens (16,384 per rank)" in out
    assert "sp 8 (ulysses 4 x ring 2)" in out  # 28 heads: SPTrainer's split
    assert "(b) longest trainable length" in out and "sp 8 (4x2)" in out
    for part in ("weights", "optimizer states", "gradients", "saved activations", "one layer's working set",
                 "logits / loss"):  # fmt: skip
        assert part in out


def test_cli_refuses_an_impossible_split(capsys):
    assert main(["--model", TINY, "--gpus", "8", "--sp", "3", "--gpu-memory-gib", "80"]) == 2
    assert "sp=3 must divide" in capsys.readouterr().err
    assert main(["--model", TINY, "--gpus", "8", "--sp", "8", "--ring", "3", "--gpu-memory-gib", "80"]) == 2


def qwen35_tiny() -> dict:
    """3 Gated DeltaNet layers + 1 attention layer, Qwen3.5's layout at a small size (bench_memory's qwen35-tiny)."""
    return bench_memory().QWEN35_TINY


def assert_within_tolerance(rows: list[dict], shape_of) -> None:
    """Every measured row's peak and (above ``STEP_FLOOR_MB``) step memory within ``TOLERANCE`` of the planner's
    prediction for ``shape_of(row)``; the table printed, the failing rows named."""
    failures, lines = [], []
    for row in rows:
        c = compare(shape_of(row), row)
        ring = f" ring {row['ring']}" if row.get("ring") else ""
        lines.append(f"{row.get('model', ''):>13} sp{row['sp']}{ring} {row['combo']:>12} {row['length']:>6}: measured "
                     f"{c['measured']:6.0f} predicted {c['predicted']:6.0f} MiB ({c['error']:+.1%}); step "
                     f"{c['step_measured']:5.0f} vs {c['step_predicted']:5.0f} ({c['step_error']:+.1%})")  # fmt: skip
        if abs(c["error"]) > TOLERANCE or (c["step_measured"] >= STEP_FLOOR_MB and abs(c["step_error"]) > TOLERANCE):
            failures.append(lines[-1])
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


QWEN35_TINY = qwen35_tiny()
HYBRID_MEASUREMENTS = os.path.join(ROOT, "docs", "benchmarks", "hybrid", "memory.json")


def test_hybrid_measurements_within_tolerance():
    """scripts/bench_memory.py on the Qwen3.5-shaped model (sp 1 and 2; plain, checkpointed, the memory stack): the
    whole peak and the step's own memory, as for the dense rows."""
    shape = ModelShape.from_config(transformers.Qwen3_5TextConfig(**QWEN35_TINY), "qwen35-tiny")
    with open(HYBRID_MEASUREMENTS) as f:
        rows = json.load(f)["rows"]
    assert {r["sp"] for r in rows} == {1, 2} and len(rows) >= 12
    assert_within_tolerance(rows, lambda row: shape)


@pytest.mark.parametrize(
    "model_type", ["bamba", "granitemoehybrid", "minimax", "kimi_linear", "nemotron_h", "falcon_h1"]
)
def test_unmodeled_hybrid_layers_are_refused(model_type):
    """Mamba2, lightning and Kimi delta attention layers (typed ``linear_attention`` by transformers, like GDN) and
    MLP-only layers have no count in the memory model: refused by name, never estimated as attention or GDN."""
    from tests.family_harness import tiny_config

    with pytest.raises(ValueError, match="the memory model has no count for its layer types"):
        ModelShape.from_config(tiny_config(model_type))


@pytest.mark.parametrize(
    "config, part",
    [
        (transformers.PhimoeConfig(), r"routed experts \(num_local_experts=16\)"),
        (transformers.DeepseekV2Config(), r"routed experts \(n_routed_experts=64\) and multi-head latent attention"),
        (transformers.Glm4MoeLiteConfig(), "routed experts .* and multi-head latent attention"),
    ],
    ids=["phimoe", "deepseek_v2", "glm4_moe_lite"],
)
def test_experts_and_latent_attention_are_refused(config, part):
    """Routed experts and multi-head latent attention outside the measured families (``planner.sparse.MODELED``:
    DeepSeek-V3, V3.2, GLM-5, Mixtral, Qwen3-MoE) have no validated count: refused by name, never estimated as dense
    layers."""
    with pytest.raises(ValueError, match=f"no count for its {part}"):
        ModelShape.from_config(config)


# -- routed experts, latent attention, DeepSeek sparse attention (planner.sparse) --------------------------------------
DSA_MEASUREMENTS = os.path.join(ROOT, "docs", "benchmarks", "dsa_memory", "memory.json")


QWEN3_MOE_TINY = dict(  # MoE every second layer but the last (decoder_sparse_step, mlp_only_layers); q / k norms
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, vocab_size=1000, decoder_sparse_step=2, mlp_only_layers=[3],
)  # fmt: skip


def _sparse_configs() -> dict:
    bm = bench_memory()
    small = {"vocab_size": 512, "num_hidden_layers": 3}
    return {
        "dsv3-small": transformers.DeepseekV3Config(**bm.DSV3_SMALL),
        "dsv32-small": transformers.DeepseekV32Config(**bm.DSV32_SMALL),
        "dsv3-q-proj-bias": transformers.DeepseekV3Config(
            **(bm.DSV3_SMALL | small | {"q_lora_rank": None, "attention_bias": True})
        ),
        "dsv32-mlp-types": transformers.DeepseekV32Config(
            **(bm.DSV32_SMALL | small | {"mlp_layer_types": ["sparse", "dense", "sparse"]})
        ),
        "glm5-shared-indexers": transformers.GlmMoeDsaConfig(
            **(bm.DSV32_SMALL | {"num_hidden_layers": 5}), index_topk_freq=2
        ),
        "mixtral": transformers.MixtralConfig(**bm.MIXTRAL_SMALL),
        "qwen3_moe": transformers.Qwen3MoeConfig(**QWEN3_MOE_TINY),
    }


@pytest.mark.parametrize("name", ["dsv3-small", "dsv32-small", "dsv3-q-proj-bias", "dsv32-mlp-types",
                                  "glm5-shared-indexers", "mixtral", "qwen3_moe"])  # fmt: skip
def test_sparse_parameter_count_matches_the_model(name):
    """MLA (with / without q_lora_rank, biases), MoE after dense layers (first_k_dense_replace, mlp_layer_types), DSA
    indexers (GLM-5's shared layers have none), Mixtral / Qwen3-MoE experts: exactly what transformers builds."""
    config = _sparse_configs()[name]
    m = ModelShape.from_config(config)
    assert m.sparse is not None and m.params == _meta_params(config)
    if name == "glm5-shared-indexers":
        assert (m.sparse.indexers, m.sparse.dsa_layers) == (3, 5)


@pytest.mark.parametrize(
    "config, billions", [(transformers.DeepseekV3Config(), 671.03), (transformers.DeepseekV32Config(), 671.88),
                         (transformers.GlmMoeDsaConfig(), 743.91)], ids=["deepseek_v3", "deepseek_v32", "glm5"],
)  # fmt: skip
def test_full_size_moe_parameters(config, billions):
    """The default configs: DeepSeek-V3 671B (V3.2 + its 61 indexers), GLM-5 744B; not the 40B / 50B a dense count of
    the same fields gives."""
    m = ModelShape.from_config(config)
    assert m.params / 1e9 == pytest.approx(billions, abs=0.01)
    assert replace(m, sparse=None).params < m.params / 10  # counted as dense layers


def test_sparse_lora_is_refused():
    """PEFT's all-linear on an MoE model wraps the experts' 3D tensors and the router (version-dependent): not
    modeled, refused rather than counted as the attention's linears."""
    m = ModelShape.from_config(transformers.DeepseekV32Config(**bench_memory().DSV32_SMALL))
    with pytest.raises(ValueError, match="LoRA on routed-expert models is not modeled"):
        estimate(m, Setting(gpus=1, sp=1, lora=True), 4096)


def test_dsa_selection_grows_with_sp():
    """Under SP a DSA layer keeps the whole sequence's top-k selection (int32) on every rank: at a fixed length its
    saved activations shrink with sp less than the model without DSA's, by the selection's ``length x topk x 4``
    bytes per layer; at sp 1 transformers' DSA is O(s^2) (its [s, s] masks and indexer scores)."""
    configs = _sparse_configs()
    dsa, mla = (ModelShape.from_config(configs[n]) for n in ("dsv32-small", "dsv3-small"))
    length, topk, layers = 16384, dsa.sparse.index_topk, dsa.layers
    for sp in (2, 4, 8):
        s = Setting(gpus=sp, sp=sp, checkpointing="none", dtype="fp32", device="cpu")
        extra = estimate(dsa, s, length).saved_activations - estimate(mla, s, length).saved_activations
        assert extra == pytest.approx(layers * length * (topk * 4 + 8) - layers * dsa.heads * 48 * 4 * length / sp)
    one = Setting(gpus=1, sp=1, checkpointing="none", dtype="fp32", device="cpu")
    grow = [estimate(dsa, one, n).peak - estimate(mla, one, n).peak for n in (2048, 4096, 8192)]
    assert grow[2] / grow[1] > 3 and grow[1] / grow[0] > 3  # quadratic at sp 1


def test_sparse_measurements_within_tolerance():
    """scripts/bench_memory.py on the DeepSeek-V3-shaped (MLA + MoE), V3.2-shaped (+ DSA), Mixtral- and
    Qwen3-MoE-shaped (MoE behind grouped-query attention; q / k norms, a dense layer) small models, sp 1 and 2 (the
    V3.2 one with a ring of 2 too at sp 2 and 4: DSA's all-gather path), plain and checkpointed: the whole peak and
    the step's own memory, as for the dense rows."""
    with open(DSA_MEASUREMENTS) as f:
        rows = json.load(f)["rows"]
    bm = bench_memory()
    shapes = {name: ModelShape.from_config(bm.model_config(name, 1024), name) for name in {r["model"] for r in rows}}
    assert set(shapes) == {"dsv3-small", "dsv32-small", "mixtral-small", "qwen3moe-small"}
    assert {r["sp"] for r in rows} == {1, 2, 4}
    assert len(rows) >= 30 and any(r.get("ring") == 2 for r in rows)
    assert_within_tolerance(rows, lambda row: shapes[row["model"]])


def test_cli_text_on_a_sparse_config(tmp_path):
    transformers.DeepseekV32Config(**bench_memory().DSV32_SMALL).save_pretrained(tmp_path / "dsv32-small")
    code, out = _run_cli("--model", str(tmp_path / "dsv32-small"), "--gpus", "2", "--gpu-memory-gib", "4", "--device",
                         "cpu", "--dtype", "fp32", "--table-zero", "0")  # fmt: skip
    assert code == 0, out
    assert "sparse: latent attention (q rank 128, kv rank 64, q/k head 32+16, v head 48); 3 MoE layers (16 " in out
    assert "4 DSA layers (4 indexers of 4 x 32, top-256)" in out


def test_pure_state_space_models_are_refused():
    with pytest.raises(ValueError, match="Mamba2Config has no attention heads .* no count for it"):
        ModelShape.from_config(transformers.Mamba2Config(num_heads=4, head_dim=16, hidden_size=32, expand=2))


def test_hybrid_shape_and_parameters():
    config = transformers.Qwen3_5TextConfig(**QWEN35_TINY)
    m = ModelShape.from_config(config)
    assert (m.gdn_layers, m.conv_layers, m.attention_layers) == (3, 0, 1)
    assert (m.linear_k_heads, m.linear_v_heads, m.linear_k_dim, m.linear_v_dim, m.conv_width) == (2, 4, 32, 32, 4)
    assert m.conv_channels == 2 * 2 * 32 + 4 * 32
    assert m.params == _meta_params(config)
    lfm2 = ModelShape.from_config(
        transformers.Lfm2Config(num_hidden_layers=3, layer_types=["conv", "conv", "full_attention"])
    )
    assert (lfm2.conv_layers, lfm2.attention_layers, lfm2.conv_width) == (2, 1, 3)


def test_hybrid_layers_cost_more_than_attention():
    """A Qwen3.5-shaped model saves more than the attention-only model of the same dims (the fp32 delta-rule core),
    more still under SP (the core runs twice: on ``[v | 0]`` and for the incoming state), plus the SP summaries,
    which do not grow with the length; dense models are unchanged (the other tests)."""
    m = ModelShape.from_config(transformers.Qwen3_5TextConfig(**QWEN35_TINY))
    dense = replace(m, gdn_layers=0)
    for sp in (1, 2, 4):
        for checkpointing in ("none", "full", "sequence_aware"):
            s = Setting(gpus=sp, sp=sp, checkpointing=checkpointing, dtype="fp32", device="cpu")
            hybrid, attention = estimate(m, s, 8192), estimate(dense, s, 8192)
            assert hybrid.peak > attention.peak
            if checkpointing == "none":
                assert hybrid.saved_activations > 2 * attention.saved_activations
            else:  # the same checkpoints (sequence_aware keeps attention tensors only), a larger working set
                assert hybrid.saved_activations <= attention.saved_activations
                assert checkpointing != "full" or hybrid.saved_activations == attention.saved_activations
                assert hybrid.layer_working_set > attention.layer_working_set
    s1, s2 = Setting(gpus=1, sp=1, checkpointing="none"), Setting(gpus=2, sp=2, checkpointing="none")
    per_token = [estimate(m, s1, n).saved_activations / n for n in (4096, 8192)]
    assert per_token[0] == pytest.approx(per_token[1])  # sp 1: linear in the length, no summaries
    fixed = 2 * estimate(m, s2, 8192).saved_activations - estimate(m, s2, 16384).saved_activations
    summary = 3 * 4 * 32 * (32 + 32) * 4 + 3 * m.conv_channels * 3 * 2  # (sp + 1) x (state summary + bf16 halo)
    assert fixed == pytest.approx(3 * summary)  # one per GDN layer, independent of the length


def test_cli_text_on_a_hybrid_config(tmp_path):
    path = tmp_path / "qwen35-tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(dict(QWEN35_TINY, model_type="qwen3_5_text")))
    code, out = _run_cli("--model", str(path), "--gpus", "2", "--gpu-memory-gib", "4", "--device", "cpu", "--dtype",
                         "fp32", "--table-zero", "0")  # fmt: skip
    assert code == 0
    assert "hybrid: 1 attention + 3 Gated DeltaNet (Hk 2, Hv 4, K 32, V 32, conv 4) layers" in out


# -- VLMs: the vision tower (planner_vision) --------------------------------------------------------------------------
VLM_MEASUREMENTS = os.path.join(ROOT, "docs", "benchmarks", "vlm", "vlm_memory.json")


def bench_vlm_shape() -> ModelShape:
    scripts = os.path.join(ROOT, "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from bench_vlm_memory import vlm_config

    from hf_sp_trainer.cli.plan import vision_params
    from hf_sp_trainer.planner.vision import VisionShape

    config = vlm_config()
    return replace(ModelShape.from_config(config, "vlm"), vision=VisionShape.from_config(config, vision_params(config)))


def test_vlm_one_process_measurements_within_tolerance():
    """scripts/bench_vlm_memory.py's one-process rows (a Qwen2-VL-shaped model, one long multimodal row, the tower
    trained or frozen, the images whole or split over the ranks): the whole peak and the step's own memory (less the
    row's pixels, which the batch holds before the step) within the tolerance. At sp 2 and 4 the planner is 7-35% low
    on the step memory of these rows and 12-30% on the peak (one extra pixel copy at sp > 1 located, in the base; the
    rest not): printed here, not yet held to a bound (docs/benchmarks/vlm)."""
    with open(VLM_MEASUREMENTS) as f:
        rows = json.load(f)["rows"]
    m, lines, failures = bench_vlm_shape(), [], []
    assert m.vision is not None and {r["sp"] for r in rows} >= {1, 2, 4}
    for row in rows:
        s = Setting(gpus=row["sp"], sp=row["sp"], checkpointing="none", dtype="fp32", device="cpu", image_share=0.5,
                    vision_trained=row["tower"] == "trained", split_media=row.get("media") == "split")  # fmt: skip
        e = estimate(m, s, row["length"])
        pixels = row["image_tokens"] * m.vision.patches_per_token * m.vision.patch_dim * 4 / MIB
        step = (e.peak - e.runtime - e.weights - e.optimizer_states - e.comm_buffers) / MIB - pixels
        error, step_error = e.peak / MIB / row["peak_mb"] - 1, step / (row["peak_mb"] - row["base_mb"]) - 1
        what = f"sp{row['sp']} {row['tower']:>7} {row.get('media', 'whole'):>5} {row['length']:>6}"
        lines.append(f"{what}: peak {error:+.1%}, step {step_error:+.1%}")
        if row["sp"] == 1 and max(abs(error), abs(step_error)) > TOLERANCE:
            failures.append(lines[-1])
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


def test_vlm_tower_memory_is_per_row_and_frozen_costs_less():
    """The tower's share is the whole row's on every rank (whole media: it doesn't shrink with sp); a frozen tower keeps
    only the pixels, a trained one its saved activations, gradients and AdamW states too."""
    m = bench_vlm_shape()
    frozen, trained = (Setting(gpus=4, sp=4, checkpointing="none", image_share=0.5, vision_trained=t) for t in (0, 1))
    for s in (frozen, trained):
        one, four = estimate(m, replace(s, gpus=1, sp=1), 16384), estimate(m, s, 16384)
        assert one.vision_activations == four.vision_activations > 0
        assert estimate(m, replace(s, image_share=0.0), 16384).vision_activations == 0
    f, t = estimate(m, frozen, 16384), estimate(m, trained, 16384)
    assert t.vision_activations > 3 * f.vision_activations and t.optimizer_states > f.optimizer_states
    text_only = estimate(replace(m, vision=None), frozen, 16384)
    assert f.weights == t.weights == text_only.weights + m.vision.params * 2  # bf16 weights of the tower added
    lora = estimate(m, replace(trained, lora=True, vision_trained=None), 16384)
    assert lora.vision_activations == f.vision_activations  # LoRA: the tower is frozen


def test_vlm_split_media_divides_the_towers_activations():
    """``sp_split_media``: a trained tower's saved activations are a quarter at sp 4 (the pixels stay whole in every
    rank's batch); a frozen tower saves none, so nothing changes; one process has nothing to split."""
    m = bench_vlm_shape()
    trained = Setting(gpus=4, sp=4, checkpointing="none", image_share=0.5, vision_trained=True)
    frozen = replace(trained, vision_trained=False)
    pixels = estimate(m, frozen, 16384).vision_activations
    whole, split = (estimate(m, replace(trained, split_media=x), 16384).vision_activations for x in (False, True))
    assert split - pixels == pytest.approx((whole - pixels) / 4, rel=1e-3) and split < whole
    assert estimate(m, replace(frozen, split_media=True), 16384).vision_activations == pixels
    one = replace(trained, gpus=1, sp=1)
    assert (
        estimate(m, replace(one, split_media=True), 16384).vision_activations
        == estimate(m, one, 16384).vision_activations
    )


def test_cli_text_on_a_vlm_config(tmp_path):
    scripts = os.path.join(ROOT, "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from bench_vlm_memory import vlm_config

    vlm_config().save_pretrained(tmp_path / "tiny-vl")
    code, out = _run_cli("--model", str(tmp_path / "tiny-vl"), "--gpus", "2", "--gpu-memory-gib", "8", "--device",
                         "cpu", "--dtype", "fp32", "--table-zero", "0", "--image-share", "0.5")  # fmt: skip
    assert code == 0, out
    assert "vision tower: 0.9M parameters, 2 blocks of 128; 50% of the row image placeholders (4 patches each)" in out
    assert "of which the vision tower's" in out


def test_auto_offloads_the_first_layers_past_full_checkpointings_longest():
    """Past full checkpointing's longest length ``auto`` keeps nothing and offloads the first layers' checkpointed
    inputs, more as rows grow, the peak within the budget up to the longest length with every layer offloaded (the
    planner's "+ activation offload" row); none at full checkpointing's longest, none on CPU (a no-op there)."""
    m = ModelShape.from_config(transformers.LlamaConfig(**LLAMA_8B))
    budget = 80 * planner.GIB
    setting = Setting(gpus=8, sp=8, zero=3, tiled_mlp=True, fused_loss=True)
    longest, step = longest_length(m, setting, budget), planner.granularity(m, setting)
    offloaded_longest = longest_length(m, replace(setting, offload=True), budget)
    assert offloaded_longest > longest + 8 * step
    assert planner.auto_kept_layers(m, setting, longest, budget).offloaded_layers == 0
    plans = [
        planner.auto_kept_layers(m, setting, n, budget) for n in range(longest + step, offloaded_longest + 1, step)
    ]
    counts = [p.offloaded_layers for p in plans]
    assert counts == sorted(counts) and 0 < counts[0] < counts[-1] <= m.layers
    assert all(p.kept_layers == 0 and p.peak <= budget for p in plans)
    last = plans[-1]
    assert last.peak == pytest.approx(estimate(m, replace(setting, offload=True), offloaded_longest).peak, rel=1e-9)
    cpu = replace(setting, device="cpu", zero=0, gpus=1, sp=1)
    assert planner.auto_kept_layers(m, cpu, 2 * longest_length(m, cpu, budget), budget).offloaded_layers == 0
    cuda = ("--model", TINY, "--gpus", "2", "--gpu-memory-gib", "6", "--table-zero", "0", "--checkpointing", "auto")
    code, out = _run_cli(*cuda, "--json")
    longest = json.loads(out)["longest_length"]  # full checkpointing's, where auto keeps nothing
    code, out = _run_cli(*cuda, "--length", str(longest + 16384))
    assert longest and code == 0 and "layers offload their checkpointed inputs" in out, out


def test_sequence_aware_auto_and_offload_are_refused_for_sparse_models():
    """What ``sequence_aware`` (and ``auto``) keeps of MoE / MLA / DSA layers, and offloading, is not counted: refused
    by name, in estimates and in ``hf-sp-plan``; the table leaves those rows out."""
    m = ModelShape.from_config(transformers.DeepseekV32Config())
    for setting in (Setting(gpus=8, sp=8, checkpointing="sequence_aware"), Setting(gpus=8, sp=8, offload=True)):
        with pytest.raises(ValueError, match="no count for checkpoint_policy='sequence_aware'"):
            estimate(m, setting, 8192)
    with pytest.raises(ValueError, match="no count for checkpoint_policy='sequence_aware' / 'auto'"):
        planner.auto_kept_layers(m, Setting(gpus=8, sp=8), 8192, 80 * planner.GIB)
    stacks = {row["stack"] for row in planner.plan_table(m, Setting(gpus=8, sp=8, zero=3), 80 * planner.GIB, [3])}
    assert "all, sequence_aware" not in stacks and "+ activation offload" not in stacks and "checkpointing" in stacks


def test_grpo_reference_model_and_colocated_engine():
    """GRPO / RLOO: TRL's reference copy of the weights (ZeRO-3: sharded; none with LoRA, whose reference is the
    adapter off) and a colocated vLLM engine's reservation (throughout, or with sleep mode only beside the trainer's
    weights and optimizer states) are added to the peak; the longest row shrinks accordingly."""
    m = ModelShape.from_config(transformers.LlamaConfig(**LLAMA_8B))
    p, n, budget = m.params, 8, 80 * planner.GIB
    for zero, shards in ((0, 1), (3, n)):
        base = Setting(gpus=n, sp=8, zero=zero, fused_loss=True)
        plain, ref = estimate(m, base, 65536), estimate(m, replace(base, reference_model=True), 65536)
        assert ref.reference_weights == p * 2 / shards and ref.peak - plain.peak == pytest.approx(p * 2 / shards)
    lora = Setting(gpus=n, sp=8, lora=True, reference_model=True)
    assert estimate(m, lora, 65536).reference_weights == 0
    base = Setting(gpus=n, sp=8, zero=3, fused_loss=True)
    engine = replace(base, engine_bytes=0.3 * budget)
    plain, colocated = estimate(m, base, 65536), estimate(m, engine, 65536)
    assert colocated.peak - plain.peak == pytest.approx(0.3 * budget) and colocated.engine == 0.3 * budget
    asleep = estimate(m, replace(engine, engine_sleeps=True), 65536)
    static = asleep.runtime + asleep.weights + asleep.optimizer_states
    assert asleep.peak == max(plain.peak, static + 0.3 * budget)
    assert longest_length(m, engine, budget) < longest_length(m, replace(engine, engine_sleeps=True), budget)
    assert longest_length(m, replace(engine, engine_sleeps=True), budget) <= longest_length(m, base, budget)
    with pytest.raises(ValueError, match="engine_bytes"):
        Setting(gpus=1, sp=1, device="cpu", engine_bytes=1.0).validate()


def test_cli_grpo_flags(capsys):
    code = main(["--model", TINY, "--gpus", "2", "--gpu-memory-gib", "8", "--reference-model",
                 "--vllm-gpu-memory-utilization", "0.25", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prediction"]["engine"] == 0.25 * 8 * planner.GIB and out["prediction"]["reference_weights"] > 0
