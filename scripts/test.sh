#!/usr/bin/env bash
# The test suite as `make test` runs it: three lanes side by side, each line prefixed with
# its part: the end-to-end tests (tests/e2e: one Dagster daemon at a time, one demo run
# shared by them), then, in the same lane, the team profile at scale (tests/scale: jobs
# through a daemon on PostgreSQL) and the bring-your-own routes (real frameworks: HF,
# Lightning, torchrun) with the tests in TO_FIRST; the other integration tests; the rest (unit, security, reliability), then the
# integration tests in TO_REST. Most tests wait on real processes, so two cores keep three lanes busy; the
# two parts that run a daemon with many jobs take turns, as four lanes at once loaded a
# 2-core machine five times over and doubled the suite's time.
# Extra arguments go to every part (`make test-all` passes `-m ''`). Exits non-zero when
# any part fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1  # lines as they come, not at the end
codes=$(mktemp -d)
trap 'rm -rf "$codes"' EXIT

part() {  # NAME PYTEST-ARGS...: run pytest (naming its 10 slowest tests), prefix its lines, keep its exit code
  local name=$1
  shift
  { "$PY" -m pytest -q -rfE --durations=10 "$@" 2>&1; echo $? > "$codes/$name"; } | sed -u "s/^/[$name] /" \
    | tee "$codes/$name.log"
}

# The bring-your-own routes: CPU-heavy framework imports, kept out of the integration lane.
BYO=(tests/integration/test_bring_your_own.py tests/integration/test_command_workload.py
     tests/integration/test_hf_route.py tests/integration/test_lightning_route.py
     tests/integration/test_torchrun_route.py tests/integration/test_import_hf_run.py)
# Integration tests that mostly wait on a training job (or a slow store) run after the rest,
# in its lane, so the lanes end at about the same time (measured before them: integration
# ~18 min, rest ~15 min on an idle machine; before the local-tier tests moved, integration
# 1976 s, rest + moved 1810 s on a 2-core machine).
TO_REST=(tests/integration/test_group_replay.py tests/integration/test_rebalance_migration.py
         tests/integration/test_command_local_tier.py)
# One more that goes after the bring-your-own routes, in the first lane, for the same reason
# (measured before the move: first lane ~25 min, integration ~29 min, the rest ~28 min).
TO_FIRST=(tests/integration/test_async_staging.py)
{ part e2e tests/e2e "$@"; part scale tests/scale "$@"; part byo "${BYO[@]}" "${TO_FIRST[@]}" "$@"; } &
part integration tests/integration "${BYO[@]/#/--ignore=}" "${TO_REST[@]/#/--ignore=}" "${TO_FIRST[@]/#/--ignore=}" "$@" &
{ part rest tests --ignore=tests/e2e --ignore=tests/scale --ignore=tests/integration "$@"; part moved "${TO_REST[@]}" "$@"; } &
wait
rc=0
for name in e2e scale byo integration rest moved; do
  code=$(cat "$codes/$name" 2>/dev/null || echo 1)
  echo "$name: exit $code"
  [ "$code" = 0 ] || rc=1
done
# The failures again, last: a CI log is often read from its tail.
grep -hE '^\[[a-z]+\] (FAILED|ERROR) ' "$codes"/*.log || true
exit $rc
