"""The fp32 exactness rule (``tests/exactness.py``) and its negative controls: each branch of the rule, at each place
it judges (the family suite, the VLM matrix, the Trainer-level cases), fails on an SP error of the sizes caught
before (1e-4 to 1e-2: ``exactness.inject_error`` on the last rank's shard), and an error of fp32 alone (a wrong
cast) fails the round-off clause; the same runs without the error pass."""

from __future__ import annotations

import json

import pytest

from tests.exactness import EXACT, FLOAT64_EXACT, LOG_ENV, ROUND_OFF_MULTIPLE, Verdict, judge, profile, record
from tests.harness import run_distributed, unwrap_results

pytestmark = pytest.mark.unit

LLAMA, QWEN4_EXP = ("llama", "LlamaForCausalLM"), ("qwen4_exp_text", "Qwen4ExpForCausalLM")  # far from / near the bar
ERRORS = [(1e-4, False), (1e-2, False)]  # an SP error of the sizes caught before, in every dtype


def test_the_rule():
    assert Verdict("a", EXACT).exact and not Verdict("a", 1.01 * EXACT).exact  # fp32 alone: the bar
    round_off = 1e-5
    assert Verdict("a", 2e-5, float64=1e-14, round_off=round_off).exact  # round-off, as float64 shows
    assert not Verdict("a", 2e-5, float64=1e-4, round_off=round_off).exact  # an SP error stays in float64
    fp32_bar = ROUND_OFF_MULTIPLE * round_off
    assert not Verdict("a", 1.01 * fp32_bar, float64=1e-14, round_off=round_off).exact  # an error of fp32 alone
    assert not Verdict("a", 1e-6, float64=10 * FLOAT64_EXACT, round_off=1e-6).exact  # a forced float64 run counts
    assert "wholly in float64 1.00e-04" in str(Verdict("a", 2e-5, float64=1e-4, round_off=round_off))


def test_judge_runs_float64_only_past_the_bar_or_when_forced(tmp_path, monkeypatch):
    monkeypatch.delenv(LOG_ENV, raising=False)  # made-up figures: not for a profile's log
    calls = []

    def rerun():
        calls.append(1)
        return 1e-14, 1e-5

    assert judge("under", 5e-6, rerun).float64 is None and not calls
    assert judge("over", 2e-5, rerun).exact and len(calls) == 1
    assert judge("forced", 5e-6, rerun, force=True).float64 == 1e-14 and len(calls) == 2
    assert not judge("no float64 version", 2e-5, None).exact
    log = tmp_path / "verdicts.jsonl"
    for switch in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(switch, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    record(Verdict("logged", 2e-5, "w", 1e-14, 1e-5), str(log))
    line = json.loads(log.read_text())
    assert line["name"] == "logged" and line["exact"] and line["profile"] == profile() == "ATEN_CPU_CAPABILITY=avx2"


def _families_with_errors(names: list[tuple[str, str]]) -> dict:
    """The family suite's check (sp 2, default configs) as it is, with each of ``ERRORS``, with an fp32-only error."""
    from tests.family_harness import run_families

    out = {"none": run_families(names, 2, None)["default"]}
    for size, fp32_only in [*ERRORS, (1e-3, True)]:
        out[(size, fp32_only)] = run_families(names, 2, None, inject=(size, fp32_only))["default"]
    return out


@pytest.mark.dist
def test_family_rule_catches_sp_errors():
    """Llama (fp32 gap ~1e-7: the fp32 bar, then float64) and Qwen4-Exp (near the bar: judged with its float64 run):
    exact as they are, wrong with an SP error of 1e-4 or 1e-2 (its float64 gap stays), and wrong with an error of
    fp32 alone of 1e-3 (past ``ROUND_OFF_MULTIPLE`` x its own round-off, ~1.5e-5 for Qwen4-Exp)."""
    results = unwrap_results(run_distributed(2, _families_with_errors, [LLAMA, QWEN4_EXP]))[0]
    for family, _ in (LLAMA, QWEN4_EXP):
        assert results["none"][family]["status"] == "exact", results["none"][family]
        for error in [*ERRORS, (1e-3, True)]:
            outcome = results[error][family]
            assert outcome["status"] == "wrong" and outcome["float64"] is not None, (family, error, outcome)
            in_float64 = outcome["float64"] > 1e-5
            assert in_float64 != error[1], (family, error, outcome)  # caught in float64, or by the round-off clause


def _vlm_with_errors(cases: list) -> dict:
    import torch.distributed as dist

    from tests.multimodal_harness import judged_case

    dist.init_process_group("gloo")
    return {
        (error, case.name): judged_case(case, 2, inject=error)
        for error in [None, *ERRORS, (1e-3, True)]
        for case in cases
    }


@pytest.mark.dist
def test_vlm_rule_catches_sp_errors():
    """The VLM matrix's judge: Qwen2-VL (far from the bar) and HY-V4-VL (near it: its float64 run forced), exact as
    they are, not exact with an SP error of 1e-4 or 1e-2 or an fp32-only one of 1e-3."""
    from tests.multimodal_harness import Case

    cases = [Case("qwen2_vl", "mixed"), Case("hy_v4_vl", "mixed")]
    results = unwrap_results(run_distributed(2, _vlm_with_errors, cases))[0]
    for case in cases:
        assert results[(None, case.name)]["exact"], results[(None, case.name)]["verdict"]
        for error in [*ERRORS, (1e-3, True)]:
            result = results[(error, case.name)]
            assert not result["exact"] and result["float64"] is not None, (case.name, error, result["verdict"])


@pytest.mark.dist
def test_trainer_rule_catches_sp_errors():
    """A Trainer-level case (``SPTrainer`` vs ``Trainer``, Llama, sp 2, AdamW): exact, its float64 run (forced here)
    included; with an SP error of 1e-4 its fp32 gap passes ``EXACT`` and its float64 run keeps the error: not exact;
    an error of fp32 alone (1e-3) fails the round-off clause."""
    from tests.harness import Case, case_verdict, compare, sp_runs_by_world

    clean = Case("exactness_llama", steps=2)
    wrong = clean.with_(name="exactness_llama_sp_error", inject=(1e-4, False))
    fp32_only = clean.with_(name="exactness_llama_fp32_error", inject=(1e-3, True))
    runs = sp_runs_by_world([clean, wrong, fp32_only])
    verdicts = {}
    for case in (clean, wrong, fp32_only):
        ref = runs.reference(case)
        verdicts[case.name] = case_verdict(case, compare(ref, runs.got(case)), ref, force=case is not wrong)
    assert verdicts[clean.name].exact and verdicts[clean.name].float64 < FLOAT64_EXACT, verdicts
    assert not verdicts[wrong.name].exact and verdicts[wrong.name].float64 > EXACT, verdicts
    assert not verdicts[fp32_only.name].exact and verdicts[fp32_only.name].float64 < FLOAT64_EXACT, verdicts
