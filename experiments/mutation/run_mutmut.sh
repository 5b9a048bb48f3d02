#!/usr/bin/env bash
# Mutation testing of a few core modules with mutmut 3.8.1: run on demand, never in CI.
#
# Works on a throw-away copy of the tree (mutmut writes its mutants/ folder where it runs), so
# the checkout is left untouched. Needs mutmut in its own environment, e.g.
#   python -m venv --system-site-packages ../_venvs/mutmut && ../_venvs/mutmut/bin/pip install mutmut==3.8.1
# Usage (from the repository root):
#   MUTMUT=../_venvs/mutmut/bin/mutmut bash experiments/mutation/run_mutmut.sh [module.py ...]
# Default modules: the ones listed in MODULES below; the tests run are TESTS (or the files
# in MUTMUT_TESTS, space-separated: MUTMUT_TESTS="tests/a.py tests/b.py"). MUTMUT_NAMES, space-
# separated mutant names or fnmatch patterns (as `mutmut results` prints them), runs only those:
# MUTMUT_NAMES='dattri_llm.attribution.index.builder.x_check_block_rows__mutmut_*'. Prints mutmut's
# summary and every surviving mutant's diff; CONTRIBUTING.md lists the survivors of the last
# run and why each is equivalent or accepted.
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
MUTMUT=${MUTMUT:-mutmut}
root=$(cd "$(dirname "$0")/../.." && pwd)
MODULES=("$@")
if [ ${#MODULES[@]} -eq 0 ]; then
  MODULES=(
    dattri_llm/gradient/layers/linear.py
    dattri_llm/gradient/layer_inner.py
    dattri_llm/gradient/ops/routing.py
    dattri_llm/attribution/tracin.py
  )
fi
if [ -n "${MUTMUT_TESTS:-}" ]; then  # a space-separated list replaces the default tests
  read -r -a TESTS <<<"$MUTMUT_TESTS"
else
  TESTS=(
    tests/gradient/layers/test_rules.py
    tests/gradient/ops/test_routing.py
    tests/attribution/test_tracin.py
    tests/gradient/test_capture_exactness.py
    tests/test_mutation_kills.py
  )
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/dattri_llm_mutmut.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -C "$root" --exclude=.git --exclude=mutants --exclude='.venv*' --exclude='__pycache__' -cf - . |
  tar -C "$work" -xf -
{
  echo "[mutmut]"
  echo "source_paths = dattri_llm"
  echo "only_mutate ="
  for m in "${MODULES[@]}"; do echo "    $m"; done
  echo "pytest_add_cli_args_test_selection ="
  for t in "${TESTS[@]}"; do echo "    $t"; done
  printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -m\n    not slow and not distributed and not gpu\n'
  echo "also_copy ="
  echo "    tests"
  echo "    experiments"
  echo "    pyproject.toml"
} >"$work/setup.cfg"
cd "$work"
# MUTMUT_TIME_LIMIT (seconds) bounds the run; the mutants not reached are reported "not checked"
read -r -a NAMES <<<"${MUTMUT_NAMES:-}"
timeout "${MUTMUT_TIME_LIMIT:-0}" "$MUTMUT" run --max-children 1 ${NAMES[@]+"${NAMES[@]}"} || true
"$MUTMUT" results || true
for m in $("$MUTMUT" results 2>/dev/null | awk -F: '/survived/ {print $1}'); do
  "$MUTMUT" show "$m" || true
done
