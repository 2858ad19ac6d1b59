#!/usr/bin/env bash
# The test suite as `make test` runs it: three lanes side by side, each line prefixed with
# its part: the end-to-end tests (tests/e2e: one Dagster daemon at a time, one demo run
# shared by them) and then, in the same lane, the team profile at scale (tests/scale: 20
# jobs through a daemon on PostgreSQL); the integration tests; the rest (unit, security,
# reliability). Most tests wait on real processes, so two cores keep three lanes busy; the
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
  { "$PY" -m pytest -q --durations=10 "$@" 2>&1; echo $? > "$codes/$name"; } | sed -u "s/^/[$name] /"
}

{ part e2e tests/e2e "$@"; part scale tests/scale "$@"; } &
part integration tests/integration "$@" &
part rest tests --ignore=tests/e2e --ignore=tests/scale --ignore=tests/integration "$@" &
wait
rc=0
for name in e2e scale integration rest; do
  code=$(cat "$codes/$name" 2>/dev/null || echo 1)
  echo "$name: exit $code"
  [ "$code" = 0 ] || rc=1
done
exit $rc
