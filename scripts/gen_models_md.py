"""Regenerate ``docs/models.md``: the family suite of ``tests/test_model_families.py`` (every causal LM of the
installed transformers at sp 2 on 2 gloo processes, default and crossed configs; the ring sample at sp 4 on 4; the
image-text-to-text classification), rendered by ``tests.test_model_families.render``, the function its
``test_models_md`` compares the committed file with. About 10+ minutes on 2 CPU cores.

    python scripts/gen_models_md.py           # writes docs/models.md
    python scripts/gen_models_md.py --check   # writes nothing; exit 1 and the differing lines if the file is stale
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the family suite lives in tests/
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)

    from tests.multimodal_harness import classify_vlms
    from tests.test_model_families import MODELS_MD, models_md_problem, render, run_outcomes, run_ring_outcomes

    start = time.time()
    text = render(run_outcomes(), run_ring_outcomes(), classify_vlms())
    elapsed = time.time() - start
    if args.check:
        committed = open(MODELS_MD).read() if os.path.exists(MODELS_MD) else ""
        problem = models_md_problem(committed, text)
        print(problem or f"docs/models.md is up to date ({elapsed:.0f} s)")
        return 1 if problem else 0
    with open(MODELS_MD, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(MODELS_MD, ROOT)} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
