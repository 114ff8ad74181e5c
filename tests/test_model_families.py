"""Family coverage: every decoder-only causal LM of the installed transformers is exact under SP or refused with a
clear error on every rank, never silently wrong (``tests/family_harness.py``). ``test_models_md`` checks
``docs/models.md`` against the table ``render`` makes of these outcomes; ``scripts/gen_models_md.py`` writes it."""

from __future__ import annotations

import difflib
import os
import re
from collections import Counter

import pytest
import transformers

from tests.doc_links import relink
from tests.exactness import EXACT as TOL  # the name render() uses
from tests.exactness import FLOAT64_EXACT, ROUND_OFF_MULTIPLE
from tests.family_harness import DOCS, LONG, NEAR_THE_BAR, families, run_families
from tests.harness import run_distributed
from tests.length_crossing import KERNEL_BLOCKING, describe
from tests.multimodal_harness import classify_vlms

pytestmark = pytest.mark.matrix  # a big parametrised sweep over gloo worlds

MODELS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "models.md")
REGENERATE = "python scripts/gen_models_md.py"
RING_SAMPLE = ("llama", "qwen3", "gemma3_text", "gemma4_text", "mistral", "phi3", "olmo2", "qwen3_moe", "doge")
RING_SAMPLE += ("qwen3_5_text", "lfm2", "granitemoehybrid", "zamba2", "minimax")  # hybrids: two zigzag runs per rank
RING_SAMPLE += ("jamba", "mamba", "recurrent_gemma")  # Mamba1 with attention and without; RG-LRU
RING_SAMPLE += ("deepseek_v32", "glm_moe_dsa", "hy_v4", "qwen4_exp_text", "minimax_m3_vl_text")  # all-gather path
STATUSES = ("exact", "refused", "out of scope", "can't build", "wrong", "crash")
ACTS = 1e-4  # a crossed setting must change the reference by more than this, or it proved nothing
# Crossed settings that a family's config has but its modeling code ignores (checked: they change nothing)
INERT_CROSSINGS = {"nemotron_h": "NemotronH's config has sliding_window, but its attention never reads it"}
FAMILIES = families()
IN_SCOPE = [f for f in FAMILIES if f.out_of_scope is None]
# Known and being fixed elsewhere: the router aux loss of MoE models is computed on the rank's shard only.


def run_outcomes() -> dict[str, dict]:
    """Every in-scope family at sp 2 on 2 gloo processes (default and crossed configs)."""
    names = [(f.model_type, f.class_name) for f in IN_SCOPE]
    results = run_distributed(2, run_families, names, 2, None, True, timeout=1500)
    status, payload = results[0] if isinstance(results[0], tuple) else ("ok", results[0])
    assert status == "ok", f"the family group failed: {payload}"
    return payload


def run_ring_outcomes() -> dict[str, dict]:
    """The ring sample at sp 4 = Ulysses 2 x ring 2 on 4 gloo processes."""
    names = [(f.model_type, f.class_name) for f in IN_SCOPE if f.model_type in RING_SAMPLE]
    results = run_distributed(4, run_families, names, 4, 2, True, timeout=900)
    status, payload = results[0] if isinstance(results[0], tuple) else ("ok", results[0])
    assert status == "ok", f"the ring group failed: {payload}"
    return payload


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    return run_outcomes()


@pytest.fixture(scope="module")
def ring_outcomes() -> dict[str, dict]:
    return run_ring_outcomes()


def _check(outcomes: dict[str, dict], model_type: str) -> None:
    """The family as itself and with its length-dependent settings crossed: exact or refused, and a crossing that
    acts (changes one device's loss or gradients) unless it only re-blocks a kernel."""
    for variant in ("default", "crossed"):
        outcome = outcomes[variant][model_type]
        status, detail = outcome["status"], outcome["detail"]
        assert status in ("exact", "refused", "can't build", "nothing to cross"), f"{model_type} {variant}: {detail}"
        if status == "exact" and model_type in NEAR_THE_BAR:  # judged in float64 on every host
            assert outcome.get("float64") is not None, (model_type, variant, outcome)
    crossed = outcomes["crossed"][model_type]
    semantic = set(crossed.get("crossed", {})) - KERNEL_BLOCKING
    if crossed["status"] == "exact" and semantic and model_type not in INERT_CROSSINGS:
        assert crossed["acts"] > ACTS, f"{model_type}: crossing {describe(crossed['crossed'])} changed nothing"


@pytest.mark.parametrize("model_type", [f.model_type for f in IN_SCOPE])
def test_family_is_exact_or_refused(model_type: str, outcomes: dict[str, dict]) -> None:
    _check(outcomes, model_type)


@pytest.mark.parametrize("model_type", [t for t in RING_SAMPLE if t in {f.model_type for f in IN_SCOPE}])
def test_ring_sample_is_exact_or_refused(model_type: str, ring_outcomes: dict[str, dict]) -> None:
    _check(ring_outcomes, model_type)


def models_md_path() -> str:
    """The committed table of the installed transformers: ``docs/models.md`` (the newest supported release), or that
    of another supported minor, ``docs/compat/models-<minor>.md`` (``scripts/compat_table.py`` writes them)."""
    minor = ".".join(transformers.__version__.split(".")[:2])
    compat = os.path.join(os.path.dirname(MODELS_MD), "compat", f"models-{minor}.md")
    main = open(MODELS_MD).read() if os.path.exists(MODELS_MD) else ""
    return MODELS_MD if f"transformers {minor}." in main.split("\n\n")[1] or not os.path.exists(compat) else compat


def test_models_md(outcomes: dict[str, dict], ring_outcomes: dict[str, dict]) -> None:
    """``docs/models.md`` (or the installed minor's ``docs/compat`` table) is the table these outcomes give, for the
    installed transformers; never rewritten here."""
    path = models_md_path()
    committed = open(path).read() if os.path.exists(path) else ""
    text = render(outcomes, ring_outcomes, classify_vlms())
    if path != MODELS_MD:  # written one directory down (scripts/compat_table.py): its relative links too
        text = relink(text)
    problem = models_md_problem(committed, text)
    if problem and path != MODELS_MD:  # another supported minor's table
        minor = os.path.basename(path).removeprefix("models-").removesuffix(".md")
        problem = f"{os.path.relpath(path)} (`python scripts/compat_table.py --minors {minor}`): {problem}"
    assert problem is None, problem


def models_md_problem(committed: str, text: str) -> str | None:
    """Why the committed ``docs/models.md`` isn't ``text`` (the version it records, then the differing lines), or
    None when they are equal."""
    version = re.search(r"transformers (\S+)\*\*", committed)
    recorded = version[1] if version else "no version"
    if recorded != transformers.__version__:
        return (
            f"docs/models.md records transformers {recorded}, the installed one is {transformers.__version__}: "
            f"regenerate it with `{REGENERATE}` and commit it"
        )
    if text == committed:
        return None
    old, new = committed.splitlines(), text.splitlines()
    diff = list(difflib.unified_diff(old, new, "committed", "computed", n=0, lineterm=""))
    shown = "\n".join(line[:200] for line in diff[2:62]) + ("\n..." if len(diff) > 62 else "")
    return (
        f"docs/models.md differs from the computed table (- committed, + computed):\n{shown}\n"
        f"Regenerate it with `{REGENERATE}` and commit it"
    )


def test_models_md_problem() -> None:
    """The check's messages: a recorded transformers version other than the installed one, then the lines that
    differ, each with the command that regenerates the file."""
    committed = open(models_md_path()).read()
    assert models_md_problem(committed, committed) is None
    other = committed.replace(f"transformers {transformers.__version__}**", "transformers 0.0.1**", 1)
    assert f"records transformers 0.0.1, the installed one is {transformers.__version__}" in models_md_problem(
        other, committed
    )
    changed = committed.replace("| `llama` | LlamaForCausalLM | exact |", "| `llama` | LlamaForCausalLM | wrong |", 1)
    problem = models_md_problem(committed, changed)
    assert "-| `llama` | LlamaForCausalLM | exact |" in problem and "+| `llama` | LlamaForCausalLM | wrong |" in problem
    assert problem.endswith(f"`{REGENERATE}` and commit it")


def _crossed(outcomes: dict[str, dict], model_type: str) -> str:
    """The crossed column: what was crossed, and the crossed run's status where it isn't the default's."""
    outcome = outcomes["crossed"][model_type]
    if outcome["status"] == "nothing to cross":
        return "-"
    text = describe(outcome.get("crossed", {}))
    if outcome.get("acts") is not None and outcome["acts"] <= ACTS:
        text += " (no effect on one device)"
    if outcome["status"] != outcomes["default"][model_type]["status"]:
        text += f": **{outcome['status']}** ({_row(outcome)[1]})"
    return text


def _row(outcome: dict) -> tuple[str, str]:
    status, detail = outcome["status"], outcome["detail"]
    if status == "exact":
        return status, ""
    if status == "wrong":
        where = detail.split(" at ", 1)[-1].join(["worst: `", "`"])
        cause = " (only with the router aux loss: exact with `output_router_logits=False`)"
        return status, f"loss or gradients differ{cause if outcome.get('aux_loss_only') else ''}, {where}"
    return status, detail.replace("|", "\\|")


def _vlm_crossings() -> str:
    from tests.multimodal_harness import build_vlm
    from tests.test_multimodal import CROSSED

    return "; ".join(f"`{c.family}` {describe(build_vlm(c.family, crossed=True).crossed_settings)}" for c in CROSSED)


def render(outcomes: dict[str, dict], ring_outcomes: dict[str, dict], vlms: list[tuple[str, str, str, str]]) -> str:
    rows = []
    for f in FAMILIES:
        if f.out_of_scope:
            rows.append((f.model_type, f.class_name, "out of scope", "", f.out_of_scope))
            continue
        status, detail = _row(outcomes["default"][f.model_type])
        if status == "exact" and f.model_type in NEAR_THE_BAR:
            detail = "fp32 round-off near the bar: checked in float64 too ([families.md](families.md))"
        rows.append((f.model_type, f.class_name, status, _crossed(outcomes, f.model_type), detail))
    crossed = [r for r in rows if r[3] not in ("", "-")]
    counts = Counter(r[2] for r in rows)
    lines = [
        "# Model families under sequence parallelism",
        "",
        f"**{len(rows)} causal-LM model types of transformers {transformers.__version__}** (vision-language models: "
        "[below](#vision-language-models))",
        "",
        f"Generated by `{REGENERATE}` from the family suite of `tests/test_model_families.py`, whose "
        "`test_models_md` fails when this file differs from what the suite computes: every model type of transformers' "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, as a tiny random-init fp32 model, at sp 2 on 2 gloo processes "
        f"against the same model run document by document in one process: a packed row of documents {list(DOCS)} "
        f"and one of {LONG} tokens, the sum of token losses (plus the router aux loss where there is one) and every "
        f"gradient within {TOL:g} relative, or, where fp32 round-off reaches that on the host, within round-off: "
        f"the same check wholly in float64 within {FLOAT64_EXACT:g} and fp32 within {ROUND_OFF_MULTIPLE} times the "
        "one-process run's own fp32 round-off (`tests/exactness.py`; always for the rows that say so). *refused*: a "
        "`ValueError` on every rank before any collective; "
        "*wrong*: a silent difference; *crash*: any other error.",
        "",
        "**Crossed**: each family runs twice, as its default tiny config and with every setting that switches on with "
        "length brought under those rows (`tests/length_crossing.py`, found by attribute name and in the rope "
        "parameters, never by family name): windows 7, attention chunks 8, temperature floors 4, sparse top-k 4, "
        "kernel chunk / block sizes 8, yarn / llama3 thresholds 8, and the default rope switched to a runtime-length "
        "rope (longrope, else dynamic NTK) with its threshold at 24, above the packed documents and the first sp-2 "
        "shard, below the 40-token document. The column lists what was crossed; the status is the default run's, "
        "the crossed run's is named where it differs. *(no effect on one device)*: the crossed settings change the "
        f"reference by at most {ACTS:g} (kernel blocking, or a setting the modeling code ignores). "
        f"{len(crossed)} families had settings to cross.",
        "",
        "| status | families |",
        "| --- | --- |",
        *(f"| {s} | {counts.get(s, 0)} |" for s in STATUSES),
        "",
        "| model type | class | status | crossed | reason / first line of the error |",
        "| --- | --- | --- | --- | --- |",
        *(f"| `{t}` | {c} | {s} | {x} | {d} |" for t, c, s, x, d in rows),
        "",
        "## sp 4 as Ulysses 2 x ring 2 (a sample)",
        "",
        "| model type | status | crossed | first line of the error |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{t}` | {_row(o)[0]} | {_crossed(ring_outcomes, t)} | {_row(o)[1]} |"
            for t, o in ring_outcomes["default"].items()
        ),
        "",
        "## Vision-language models",
        "",
        "Every image-text-to-text model type with encoders, its default config built on the meta device and put "
        "through SP's checks (`tests/multimodal_harness.py::classify_vlms`). SP runs in the text decoder only; "
        "*exact*: proven by `tests/test_multimodal.py` against each document run alone (loss and every gradient, "
        "the vision tower's included, sp 2 and 4, Ulysses and ring); "
        "every other VLM is refused. Crossed there too (`tests/test_multimodal.py::CROSSED`, the text decoder's "
        "settings; no runtime-rope switch, as a layout's documents lie on both sides of its threshold): "
        f"{_vlm_crossings()}.",
        "",
        "| status | families |",
        "| --- | --- |",
        *(f"| {s} | {n} |" for s, n in sorted(Counter(r[2] for r in vlms).items())),
        "",
        "| model type | class | status | reason / first line of the error |",
        "| --- | --- | --- | --- |",
        *(f"| `{t}` | {c} | {s} | {d} |" for t, c, s, d in vlms),
        "",
    ]
    return "\n".join(lines)
