#!/usr/bin/env bash
# The test suite as `make test` runs it: the end-to-end tests (tests/e2e: one Dagster daemon
# at a time, one demo run shared by them) in one pytest process and everything else in
# another, side by side, each line prefixed with its half. Extra arguments go to both
# (`make test-all` passes `-m ''`). Exits non-zero when either half fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

"$PY" -m pytest -q tests/e2e "$@" 2>&1 | sed -u 's/^/[e2e] /' &
e2e=$!
"$PY" -m pytest -q tests --ignore=tests/e2e "$@" 2>&1 | sed -u 's/^/[rest] /' &
rest=$!
wait "$rest"; rc_rest=$?
wait "$e2e"; rc_e2e=$?
echo "tests outside tests/e2e: exit $rc_rest; tests/e2e: exit $rc_e2e"
[ "$rc_rest" -eq 0 ] && [ "$rc_e2e" -eq 0 ]
