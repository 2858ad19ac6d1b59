"""Concurrent writers with readers on one ledger: 8 writer processes, each racing the others
for the same jobs' dispatch and then appending its events one transaction at a time, while
two reader processes (the DuckDB SQL face and the store's own reads) query throughout.

The suite runs 8 x 250 events to stay fast (every commit is fsynced: on a busy shared disk
that is ~200 commits/s); `ORBIT_RELIABILITY_EVENTS=5000` runs the issue's 8 x 5,000. Timing
figures are the ledger benchmark's, not this test's.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import records as R
from orbit_dagster.ledger import utcnow
from tests.helpers import wait_for
from tests.reliability import inject

WRITERS, RACED_JOBS = 8, 20
EVENTS = int(os.environ.get("ORBIT_RELIABILITY_EVENTS", "250"))

WRITER = """
import json, sys, time
from orbit_dagster.settings import Settings
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import records as R

home, me, n, jobs, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ledger = Settings.from_env(home).ledger()
while not __import__("os").path.exists(go):  # all start together
    time.sleep(0.01)
won = [j for j in range(jobs) if R.transition(ledger, f"race-{j}", JobState.DISPATCHING, attempt=1,
                                              only_from={JobState.QUEUED}, reason=me)]
for i in range(n):
    ledger.append("events", R.event("load", job_id=me, seq=i))
print(json.dumps({"won": won}), flush=True)
"""

READER = """
import json, sys, time, os
from orbit_dagster.settings import Settings

home, how, stop, out = sys.argv[1:5]
ledger = Settings.from_env(home).ledger()
seen, errors = [], []
if how == "face":
    ledger.query("SELECT 1 AS x")  # the DuckDB connection is made before the writers start
open(out + ".ready", "w").close()
while not os.path.exists(stop):
    try:
        if how == "face":
            n = int(ledger.query("SELECT count(*) AS n FROM events WHERE kind = 'load'")["n"][0])
        else:
            n = int(ledger.scalar("SELECT count(*) FROM events WHERE kind = 'load'"))
        seen.append(n)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}"[:300])
    time.sleep(0.01)
open(out, "w").write(json.dumps({"seen": seen, "errors": errors}))
"""


@pytest.mark.fault(f"{WRITERS} writer processes x {EVENTS} one-row transactions, racing for {RACED_JOBS} "
                   "jobs' dispatch, with 2 reader processes (DuckDB face, store) querying throughout",
                   expect="every row once; one winner per job; readers: 0 errors, counts never go back")
def test_concurrent_writers_with_readers_lose_and_duplicate_nothing(settings, orbit_home, tmp_path):
    ledger = settings.ledger()
    with ledger.write() as tx:
        for j in range(RACED_JOBS):
            R.insert_job(tx, {"job_id": f"race-{j}", "experiment": "e", "project": "p", "created_at": utcnow()},
                         [R.state_row(f"race-{j}", 1, JobState.CREATED), R.state_row(f"race-{j}", 1, JobState.QUEUED)])
    go, stop = tmp_path / "go", tmp_path / "stop"
    readers = [(inject.spawn(READER, str(orbit_home), how, str(stop), str(tmp_path / f"{how}.json"),
                             log=tmp_path / f"{how}.log"), how) for how in ("face", "store")]
    writers = [inject.spawn(WRITER, str(orbit_home), f"w{i}", str(EVENTS), str(RACED_JOBS), str(go),
                            log=tmp_path / f"w{i}.log") for i in range(WRITERS)]
    wait_for(lambda: all((tmp_path / f"{how}.json.ready").exists() for _, how in readers)
             or any(p.poll() is not None for p, _ in readers), 120, what="the readers ready")
    time.sleep(1.0)  # the writers import meanwhile; then all start together
    go.touch()
    t0 = time.time()
    try:
        for proc in writers:
            assert proc.wait(600) == 0
    finally:
        stop.touch()
    print(f"{WRITERS} writers x {EVENTS}: {time.time() - t0:.1f} s after the start signal")
    for proc, how in readers:
        assert proc.wait(120) == 0, (tmp_path / f"{how}.log").read_text()[-2000:]

    total = WRITERS * EVENTS
    assert ledger.scalar("SELECT count(*) FROM events WHERE kind = 'load'") == total
    assert ledger.scalar("SELECT count(DISTINCT event_id) FROM events WHERE kind = 'load'") == total
    per_writer = ledger.rows("""SELECT job_id, count(DISTINCT json_extract(detail, '$.seq')) AS n,
                                       min(json_extract(detail, '$.seq')) AS lo, max(json_extract(detail, '$.seq')) AS hi
                                FROM events WHERE kind = 'load' GROUP BY job_id ORDER BY job_id""")
    assert per_writer == [{"job_id": f"w{i}", "n": EVENTS, "lo": 0, "hi": EVENTS - 1} for i in range(WRITERS)]
    wins = [json.loads((tmp_path / f"w{i}.log").read_text().strip().splitlines()[-1])["won"] for i in range(WRITERS)]
    assert sorted(j for w in wins for j in w) == list(range(RACED_JOBS))  # each job won exactly once
    assert ledger.scalar("SELECT count(*) FROM job_states WHERE state = 'DISPATCHING'") == RACED_JOBS
    assert inject.integrity(inject.sqlite_path(orbit_home)) == "ok"
    for _, how in readers:
        result = json.loads((tmp_path / f"{how}.json").read_text())
        assert result["errors"] == [], (how, result["errors"][:3])
        seen = result["seen"]
        assert len(seen) >= 5 and all(a <= b for a, b in zip(seen, seen[1:])), (how, seen[:50])
        assert seen[-1] <= total
