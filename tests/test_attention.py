"""Ulysses attention: the all-to-all primitive, and the SP forward equal to the single-process forward."""

import pytest
import torch

from hf_sp_trainer.attention.kernels import _document_mask
from hf_sp_trainer.attention.ulysses import kv_replication
from hf_sp_trainer.documents import DocumentLayout
from tests.harness import EXACT, run_distributed, synthetic_dataset, tiny_model, unwrap_results

pytestmark = pytest.mark.unit  # in-process; the tests marked otherwise below are not

RINGS = {2: (1, 2), 4: (1, 2, 4)}  # ring sizes checked at each sp: Ulysses only, hybrid, ring only
FORWARD_CASES = [
    "llama_sdpa_packed",
    "llama_eager_packed",
    "llama_sdpa_two_rows",
    "llama_kv1_packed",
    "llama_one_token_docs",
    "mistral_window_packed",
    "gemma3_eager_packed",
    "llama_3_heads_packed",
]


# -- in-process unit tests ---------------------------------------------------------------------------------------
def test_layout_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    layout = DocumentLayout.from_position_ids(pos)
    assert layout.segments == [[(0, 3), (3, 5), (5, 9), (9, 10)], [(0, 10)]]
    assert layout.document_ids()[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    cu, longest = layout.cu_seq_lens()
    assert cu.tolist() == [0, 3, 5, 9, 10, 20] and longest == 10


@pytest.mark.parametrize("kv,sp,expected", [(8, 2, 1), (2, 4, 2), (1, 4, 4), (2, 8, 4), (6, 4, 2)])
def test_kv_replication(kv, sp, expected):
    assert kv_replication(kv, sp) == expected
    assert (kv * expected) % sp == 0


def test_sdpa_documents_need_no_dense_mask():
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    assert _document_mask("sdpa", module, 4096, None, torch.float32, "cpu") is None
    assert _document_mask("sdpa", module, 64, 128, torch.float32, "cpu") is None  # window wider than document
    window = _document_mask("sdpa", module, 6, 3, torch.float32, "cpu")
    assert window.shape[-2:] == (6, 6) and window[0, 0, 5].tolist() == [False, False, False, True, True, True]


# -- distributed ---------------------------------------------------------------------------------------------------
def _sp_logits(sp, batch):
    shard = sp.shard_batch(batch)
    with torch.no_grad():
        logits = sp.model(**{k: v for k, v in shard.items() if k in ("input_ids", "position_ids")}).logits
    return sp.gather_sequence(logits)[:, : batch["input_ids"].shape[1]]


def forward_checks(sp_size):
    """Max |SP logits - single-process logits| for several models, kernels and batch shapes."""
    import torch.distributed as dist
    from transformers import DataCollatorWithFlattening

    from hf_sp_trainer import apply_sequence_parallel
    from hf_sp_trainer.comm import all_to_all, all_to_all_many
    from hf_sp_trainer.topology import sp_topology

    dist.init_process_group("gloo")
    group = sp_topology(sp_size).sp_group
    out = {}
    torch.manual_seed(0)  # the same inputs on every rank

    # all-to-all: inverse of itself, and its backward is the inverse all-to-all
    x = torch.randn(2, 8, 6, 4, requires_grad=True)
    y = all_to_all(x, 1, 2, group)
    out["a2a_shape"] = list(y.shape)
    out["a2a_roundtrip"] = float((all_to_all(y, 2, 1, group) - x).abs().max())
    weight = torch.randn_like(y)
    (y * weight).sum().backward()
    out["a2a_grad"] = float((x.grad - all_to_all(weight, 2, 1, group)).abs().max())

    # q, k, v in one collective: each equals its own all-to-all, gradients too, whatever the layout. q and k as
    # transformers hands them over ([b, h, s, d] views of [b, s, h, d]), GQA's fewer kv heads, MLA's other v size.
    q = torch.randn(2, 6, 8, 4).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 6, 4, 4).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 4, 6, 3, requires_grad=True)
    many = all_to_all_many((q, k, v), 1, 2, group)
    each = [all_to_all(t, 1, 2, group) for t in (q, k, v)]
    out["a2a_many"] = max(float((a - b).abs().max()) for a, b in zip(many, each, strict=True))
    weights = [torch.randn_like(t) for t in each]
    fused = torch.autograd.grad(sum((a * w).sum() for a, w in zip(many, weights, strict=True)), (q, k, v))
    plain = torch.autograd.grad(sum((a * w).sum() for a, w in zip(each, weights, strict=True)), (q, k, v))
    out["a2a_many_grad"] = max(float((a - b).abs().max()) for a, b in zip(fused, plain, strict=True))

    packed = DataCollatorWithFlattening(return_position_ids=True)(synthetic_dataset(3, seed=5, max_len=30))
    rows = torch.randint(3, 100, (2, 4 * sp_size + 3))
    unpacked = {"input_ids": rows, "position_ids": torch.arange(rows.shape[1]).expand(2, -1)}
    tiny_docs = DataCollatorWithFlattening(return_position_ids=True)(  # 1-token documents among longer ones
        [{"input_ids": [5]}, {"input_ids": list(range(3, 20))}, {"input_ids": [7]}, {"input_ids": [8, 9]}]
    )
    three_heads = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    cases = {
        "llama_sdpa_packed": ("llama", "sdpa", {}, packed),
        "llama_eager_packed": ("llama", "eager", {}, packed),
        "llama_sdpa_two_rows": ("llama", "sdpa", {}, unpacked),
        "llama_kv1_packed": ("llama", "sdpa", {"num_key_value_heads": 1}, packed),
        "llama_one_token_docs": ("llama", "sdpa", {}, tiny_docs),
        "mistral_window_packed": ("mistral", "sdpa", {}, packed),
        "gemma3_eager_packed": ("gemma3", "eager", {}, packed),
        "llama_3_heads_packed": ("llama", "sdpa", three_heads, packed),
    }
    for name, (family, attn, overrides, batch) in cases.items():
        reference = tiny_model(family, attn=attn, **overrides)
        with torch.no_grad():
            ref = reference(**batch).logits
        heads = overrides.get("num_attention_heads", 4)
        for ring in [r for r in RINGS[sp_size] if heads % (sp_size // r) == 0]:
            model = tiny_model(family, attn=attn, **overrides)
            sp = apply_sequence_parallel(model, sp_size, ring_size=ring, attn_implementation=attn)
            out[f"{name}_ring{ring}"] = float((_sp_logits(sp, batch) - ref).abs().max() / ref.abs().max())
            sp.remove()
    return out


@pytest.fixture(scope="module")
def checks():
    return {sp: unwrap_results(run_distributed(sp, forward_checks, sp, timeout=300)) for sp in (2, 4)}


@pytest.mark.dist
@pytest.mark.parametrize("sp", [2, 4])
def test_all_to_all(sp, checks):
    for rank_result in checks[sp]:
        assert rank_result["a2a_shape"] == [2, 8 // sp, 6 * sp, 4]
        assert rank_result["a2a_roundtrip"] == 0.0
        assert rank_result["a2a_grad"] == 0.0
        assert rank_result["a2a_many"] == 0.0 and rank_result["a2a_many_grad"] == 0.0


@pytest.mark.dist
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_sp_forward_matches_single_process(sp, case, checks):
    """Ulysses, Ulysses x Ring and ring-only splits of the same sp give the single-process logits."""
    for rank_result in checks[sp]:
        measured = {k: v for k, v in rank_result.items() if k.startswith(case + "_ring")}
        assert measured, f"no split of sp={sp} ran for {case}"
        for name, diff in measured.items():
            assert diff <= EXACT, f"sp={sp} {name}: relative difference {diff:.2e}"


# -- flex_attention: forward and evaluation only (no flex backward on CPU in torch 2.13) ------------------------------
def flex_eval(tmp):
    from hf_sp_trainer import SPTrainer, TrainingArguments

    model = tiny_model("llama", attn="sdpa")
    args = TrainingArguments(
        output_dir=tmp,
        sp_size=2,
        sp_attn_implementation="flex_attention",
        per_device_eval_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo",
    )
    trainer = SPTrainer(model=model, args=args, eval_dataset=synthetic_dataset(4, seed=2))
    return trainer.evaluate()["eval_loss"]


@pytest.mark.dist
def test_flex_attention_eval_matches_single_process(tmp_path):
    import transformers

    from tests.exactness import capped_below_amx

    if capped_below_amx():
        pytest.skip(capped_below_amx())
    from transformers import DataCollatorWithFlattening

    got = unwrap_results(run_distributed(2, flex_eval, str(tmp_path / "sp"), timeout=600))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "ref"),
        per_device_eval_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    reference = transformers.Trainer(
        model=tiny_model("llama", attn="sdpa"),
        args=args,
        eval_dataset=synthetic_dataset(4, seed=2),
        data_collator=DataCollatorWithFlattening(return_position_ids=True),
    ).evaluate()["eval_loss"]
    for loss in got:
        assert abs(loss - reference) / reference <= EXACT
