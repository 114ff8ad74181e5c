#!/usr/bin/env bash
# Following a transformers release (docs/testing.md#following-transformers-releases):
#
#   scripts/follow_transformers.sh 5.26.0            # VENV_ROOT=/work/venvs by default
#
# 1. builds (or reuses) the venv <VENV_ROOT>/tf-<minor>: torch, DeepSpeed, this checkout editable, transformers
#    <version> (scripts/compat_table.py does it, the same way as for the tested minors);
# 2. runs the contract tests there (tests/test_upstream_contract.py: every private member SP relies on; its
#    installed-versions test fails until setup.py's cap admits the version, the other tests are the finding);
# 3. runs the unit tier there (pytest tests -m unit);
# 4. runs the family suite there (scripts/compat_table.py --minors <version>): docs/compat/models-<minor>.md and
#    the summary docs/compat.md, whose "Differences between minors" lists what the release changed;
# 5. prints the setup.py line to change. Nothing is edited: the steps report, a person decides.
#
# FAMILIES=0 skips step 4. Runs every step even when one fails; exits 1 if any did. About 15 minutes on 2 CPU
# cores (a new venv: about 2 more).
set -uo pipefail

VERSION=${1:?usage: scripts/follow_transformers.sh <transformers version, e.g. 5.26.0>}
[[ $VERSION =~ ^([0-9]+)\.([0-9]+)\.[0-9]+ ]] || { echo "not a release version: $VERSION" >&2; exit 2; }
MAJOR=${BASH_REMATCH[1]}
MINOR_N=${BASH_REMATCH[2]}
MINOR=$MAJOR.$MINOR_N
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV_ROOT=${VENV_ROOT:-/work/venvs}
VENV=$VENV_ROOT/tf-$MINOR
PY=$VENV/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
cd "$ROOT"

declare -A RESULT
step() {  # step <name> <command...>: run, time, remember the outcome
    local name=$1 start=$SECONDS
    shift
    echo "=== $name: $*"
    if "$@"; then RESULT[$name]="ok"; else RESULT[$name]="FAILED (exit $?)"; fi
    RESULT[$name]+=" ($((SECONDS - start)) s)"
    echo "=== $name: ${RESULT[$name]}"
}

# 1. the venv, built by compat_table.py's own code (one recipe for every minor)
step venv python3 -c "
import sys; sys.path.insert(0, 'scripts'); import compat_table as c
import os; os.makedirs('$VENV_ROOT', exist_ok=True)
c.LOG_FILE = open('$VENV_ROOT/tf-$MINOR.log', 'a')
c.ensure_venv('$VENV', '$VERSION', c.TORCH, c.DEEPSPEED, print)"
[[ -x $PY ]] || { echo "no venv at $VENV: stopping" >&2; exit 1; }
"$PY" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"

# 2-3. the contract tests and the unit tier, in the new venv (tier budgets: not this host's business here)
step contract env HF_SP_TEST_BUDGETS=0 "$PY" -m pytest tests/test_upstream_contract.py -q -p no:cacheprovider
# (a module that can't import with this version is reported, the rest of the tier still runs)
step unit env HF_SP_TEST_BUDGETS=0 "$PY" -m pytest tests -m unit -q -p no:cacheprovider --continue-on-collection-errors

# 4. the family suite for this minor, and docs/compat.md over every minor run so far
[[ ${FAMILIES:-1} == 0 ]] && RESULT[families]="skipped (FAMILIES=0)" ||
    step families python3 scripts/compat_table.py --minors "$VERSION" --venv-root "$VENV_ROOT" --skip-build

# 5. what to change
finish() {  # exit 1 if a step failed
    for name in venv contract unit families; do
        [[ ${RESULT[$name]:-} == ok* || ${RESULT[$name]:-} == skipped* ]] || exit 1
    done
    exit 0
}
CURRENT=$(grep -o '"transformers[^"]*"' setup.py | head -1)
NEXT="$MAJOR.$((MINOR_N + 1))"
echo
echo "=== summary for transformers $VERSION (venv $VENV)"
for name in venv contract unit families; do printf '  %-9s %s\n' "$name" "${RESULT[$name]:-not run}"; done
echo
echo "setup.py now:   $CURRENT"
if [[ $CURRENT =~ \>=([0-9]+)\.([0-9]+) && ${BASH_REMATCH[1]} == "$MAJOR" && $MINOR_N -lt ${BASH_REMATCH[2]} ]]; then
    echo "$MINOR is below setup.py's floor ($MAJOR.${BASH_REMATCH[2]}); lowering the floor is a decision of its own"
    echo "(docs/compat.md: the floor is what vLLM pins). The steps above say what $VERSION would need."
    finish
fi
[[ $CURRENT =~ \<([0-9]+)\.([0-9]+) ]] && CAP_MINOR=${BASH_REMATCH[2]} || CAP_MINOR=
if [[ -n $CAP_MINOR && ${BASH_REMATCH[1]} == "$MAJOR" && $MINOR_N -lt $CAP_MINOR ]]; then
    echo "setup.py already admits $MINOR (its cap is <$MAJOR.$CAP_MINOR): nothing to change there; the steps"
    echo "above say whether $VERSION still works."
    finish
fi
echo "to admit $MINOR, its upper bound becomes <$NEXT:"
sed -E "s/(\"transformers>=[0-9.]+,)<[0-9.]+\"/\1<$NEXT\"/" setup.py | diff setup.py - | sed 's/^/    /'
echo "only when the contract tests, the unit tier and the family suite above are clean (or fixed): then add $MINOR"
echo "to NEWEST_PATCH in scripts/compat_table.py, commit docs/compat/, docs/compat.md, and regenerate"
echo "docs/models.md in the main venv once it runs $VERSION (python scripts/gen_models_md.py)."
finish
