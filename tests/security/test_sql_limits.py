"""Issue 16, item 7: `orbit sql` and `Ledger.query()` are bounded.

A query stops at its timeout (ORBIT_SQL_TIMEOUT_S, `--timeout`), stays within its memory
(ORBIT_SQL_MEMORY), spills only into the ledger's own `tmp/` and only so much
(ORBIT_SQL_TEMP_SIZE), and its text is bounded (ORBIT_SQL_MAX_QUERY_CHARS). Each refusal is
one line, exit 2, naming the limit, its value and how to change it; the face answers the
next query. The CLI runs in a process of its own (`measure.orbit`) with a deadline: the old
code ran these queries until killed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orbit_dagster.settings import Settings
from tests.helpers import run_cli
from tests.postgres import postgres  # noqa: F401 - fixture
from tests.security.measure import orbit

ENDLESS = "SELECT count(*) FROM range(1000000000000)"


run = run_cli  # `orbit ARGV` in this process: (exit code, stdout, stderr)


def one_line(m) -> str:
    assert m.rc == 2, (m.rc, m.out[-300:], m.err[-500:])
    lines = m.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "fix:" in lines[0], m.err
    assert "Traceback" not in m.out + m.err
    return lines[0]


@pytest.fixture
def home(orbit_home):
    # The ledger exists (migrated) before the CLI's processes open it; this process keeps no
    # connection to it (see test_sql_face.py).
    Settings.from_env(orbit_home).ledger().dispose()
    return orbit_home


def test_orbit_sql_stops_a_query_at_its_timeout_and_names_the_setting(home):
    """Old code: `SELECT count(*) FROM range(1000000000000)` ran until killed."""
    m = orbit(["sql", ENDLESS], home=home, env={"ORBIT_SQL_TIMEOUT_S": "2"}, timeout=180)
    line = one_line(m)
    assert "timeout of 2 s" in line and "ORBIT_SQL_TIMEOUT_S" in line and "--timeout" in line, line
    code, out, err = run(["sql", ENDLESS, "--timeout", "1.5"])  # the flag, in this process
    assert code == 2 and "timeout of 1.5 s (--timeout)" in err and len(err.strip().splitlines()) == 1, err


def test_the_timeout_interrupts_the_query_and_the_face_answers_the_next_one(home, monkeypatch):
    """The interrupt (not the kill) stops it: the same worker answers the next query."""
    from orbit_dagster.ledger import queries as Q
    from orbit_dagster.ledger.face import _Worker, face_query
    from orbit_dagster.ledger.limits import KILL_GRACE_S, SqlLimitExceeded, SqlLimits

    ledger = Settings.from_env(home).ledger()
    assert face_query(ledger, "SELECT 1 AS x")["x"].tolist() == [1]
    limits = SqlLimits.parse({}, timeout_s=2)
    worker = _Worker.for_ledger(ledger, limits)
    start = time.monotonic()
    with pytest.raises(SqlLimitExceeded, match="timeout of 2 s"):
        face_query(ledger, ENDLESS, limits)
    elapsed = time.monotonic() - start
    assert worker.proc.is_alive() and _Worker.for_ledger(ledger, limits) is worker, \
        f"the worker was killed: the interrupt did not stop the query within {KILL_GRACE_S} s ({elapsed:.2f} s)"
    assert elapsed >= 2, elapsed
    assert face_query(ledger, "SELECT count(*) AS n FROM jobs", limits)["n"].tolist() == [0]
    # Ledger.query (the notebook's door) runs within the settings' limits (ORBIT_SQL_*).
    monkeypatch.setenv("ORBIT_SQL_TIMEOUT_S", "1")
    settings = Settings.from_env(home)
    ledger = settings.ledger()
    with pytest.raises(SqlLimitExceeded, match="ORBIT_SQL_TIMEOUT_S"):
        ledger.query(ENDLESS)
    with pytest.raises(SqlLimitExceeded, match="timeout of 1.5 s"):
        Q.sql(ledger, ENDLESS, limits=settings.sql_limits(timeout_s=1.5))
    assert ledger.query("SELECT 2 AS y")["y"].tolist() == [2]


def test_a_face_that_does_not_answer_by_its_timeout_is_killed_and_replaced(home):
    """The backstop: a worker that cannot be interrupted (stopped here with SIGSTOP) is killed
    at the timeout plus a grace; the next query starts a new one."""
    from orbit_dagster.ledger.face import _Worker, face_query
    from orbit_dagster.ledger.limits import KILL_GRACE_S, SqlLimitExceeded, SqlLimits

    ledger = Settings.from_env(home).ledger()
    limits = SqlLimits.parse({}, timeout_s=1)
    face_query(ledger, "SELECT 1", limits)
    worker = _Worker.for_ledger(ledger, limits)
    os.kill(worker.proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(SqlLimitExceeded, match="timeout of 1 s"):
        face_query(ledger, "SELECT 1", limits)
    assert time.monotonic() - start < 1 + KILL_GRACE_S + 30
    assert not worker.proc.is_alive()
    assert face_query(ledger, "SELECT 3 AS z", limits)["z"].tolist() == [3]
    assert _Worker.for_ledger(ledger, limits) is not worker


def test_a_query_past_the_memory_limit_is_refused_and_its_process_stays_near_the_limit(home):
    """Old code: DuckDB's default limit (80% of RAM): a list of 400M elements reached 5.5 GB
    RSS. Here, 100M elements (800 MB) against a 256 MiB limit."""
    m = orbit(["sql", "SELECT length(list(range)) AS n FROM range(100000000)"], home=home,
              env={"ORBIT_SQL_MEMORY": "256MiB"}, timeout=240)
    line = one_line(m)
    assert "256 MiB" in line and "ORBIT_SQL_MEMORY" in line, line
    assert m.peak_rss < 700 << 20, f"peak RSS {m.peak_rss >> 20} MiB with a 256 MiB limit"


def test_a_result_larger_than_the_memory_allows_is_refused_before_it_is_all_fetched(home):
    """Old code: `.df()` built the whole result (here 10^12 rows) in memory."""
    m = orbit(["sql", "SELECT * FROM range(1000000000000)"], home=home, env={"ORBIT_SQL_MEMORY": "64MiB"},
              timeout=180)
    line = one_line(m)
    assert "result is larger" in line and "ORBIT_SQL_MEMORY" in line, line
    assert m.peak_rss < 600 << 20, m.peak_rss >> 20


def test_the_face_spills_into_the_ledgers_tmp_within_its_bound(home, tmp_path):
    """Old code: DuckDB's spill directory was `.tmp` in the caller's working directory, as
    large as the disk allowed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    m = orbit(["sql", "SELECT current_setting('temp_directory') AS t, current_setting('max_temp_directory_size') AS m, "
                      "current_setting('memory_limit') AS l", "--json"],
              home=home, env={"ORBIT_SQL_TEMP_SIZE": "3GiB"}, cwd=elsewhere, timeout=180)
    assert m.rc == 0, m.err
    assert json.loads(m.out) == [{"t": str(home / "ledger" / "tmp"), "m": "3.0 GiB", "l": "1.0 GiB"}]
    spill = "SELECT count(*) FROM (SELECT md5(range::varchar) AS m FROM range(3000000) ORDER BY m)"
    m = orbit(["sql", spill], home=home, env={"ORBIT_SQL_MEMORY": "32MiB", "ORBIT_SQL_TEMP_SIZE": "1MiB"},
              cwd=elsewhere, timeout=180)
    line = one_line(m)
    assert "ORBIT_SQL_" in line and ("spill" in line or "memory" in line), line
    assert not any(elsewhere.iterdir()), "DuckDB wrote into the caller's working directory"


def test_a_query_longer_than_the_limit_is_refused_before_it_is_parsed(home, monkeypatch):
    """Old code: any length was parsed and serialised (json_serialize_sql) in full."""
    long_query = "SELECT " + ", ".join("1" for _ in range(30000))  # 90 KB
    code, out, err = run(["sql", long_query])
    assert code == 2 and "ORBIT_SQL_MAX_QUERY_CHARS" in err and "65536" in err, err[-300:]
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv("ORBIT_SQL_MAX_QUERY_CHARS", "200000")
    code, out, err = run(["sql", long_query, "--json"])
    assert code == 0, err[-300:]


@pytest.mark.parametrize("env,args,field", [
    ({"ORBIT_SQL_MEMORY": "lots"}, [], "ORBIT_SQL_MEMORY"),
    ({"ORBIT_SQL_MEMORY": "1000TiB"}, [], "ORBIT_SQL_MEMORY"),
    ({"ORBIT_SQL_TIMEOUT_S": "-1"}, [], "ORBIT_SQL_TIMEOUT_S"),
    ({"ORBIT_SQL_TIMEOUT_S": "nan"}, [], "ORBIT_SQL_TIMEOUT_S"),
    ({}, ["--timeout", "0"], "--timeout"),
    ({"ORBIT_SQL_TEMP_SIZE": "-5GB"}, [], "ORBIT_SQL_TEMP_SIZE"),
    ({"ORBIT_SQL_MAX_QUERY_CHARS": "many"}, [], "ORBIT_SQL_MAX_QUERY_CHARS"),
])
def test_a_bad_limit_setting_is_one_line_naming_it(home, monkeypatch, env, args, field):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, out, err = run(["sql", "SELECT 1", *args])
    assert code == 2 and err.startswith(f"error: {field}") and "fix:" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_postgresql_face_is_bounded_the_same_way(postgres):
    """The team profile's face runs in the asking process (no worker): the same timer stops
    its query, the same memory limit holds, and the next query answers."""
    from orbit_dagster.ledger import Ledger
    from orbit_dagster.ledger.face import face_query
    from orbit_dagster.ledger.limits import SqlLimitExceeded, SqlLimits

    ledger = Ledger.open(postgres.url(postgres.create_database(), driver="psycopg"))
    limits = SqlLimits.parse({}, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(SqlLimitExceeded, match="timeout of 1 s"):
        face_query(ledger, ENDLESS, limits)
    assert time.monotonic() - start < 30
    with pytest.raises(SqlLimitExceeded, match="ORBIT_SQL_MEMORY"):
        face_query(ledger, "SELECT length(list(range)) FROM range(100000000)", SqlLimits.parse({}, memory="64MiB"))
    assert face_query(ledger, "SELECT count(*) AS n FROM jobs", limits)["n"].tolist() == [0]


def test_the_timeout_holds_when_the_deadline_passes_before_the_query_starts(orbit_home):
    """Found here: a one-shot timer whose interrupt landed before DuckDB had started the
    query (a slow first import of pandas, a slow check) was lost, and the query then ran
    unbounded. Run in a process of its own with a deadline: a regression fails, never hangs."""
    snippet = (
        "import time, duckdb\n"
        "from orbit_dagster.ledger import face\n"
        "from orbit_dagster.ledger.limits import SqlLimits, SqlLimitExceeded\n"
        "real = face.check_read_only\n"
        "def slow(con, sql):\n    time.sleep(1.0)\n    return real(con, sql)\n"  # the deadline passes in here
        "face.check_read_only = slow\n"
        "con = duckdb.connect(':memory:')\n"
        "t = time.monotonic()\n"
        "try:\n"
        f"    face._run(con, {ENDLESS!r}, SqlLimits.parse({{}}, timeout_s=0.3), None)\n"
        "except SqlLimitExceeded as exc:\n"
        "    print(f'{time.monotonic() - t:.2f}', exc)\n")
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ORBIT_HOME": str(orbit_home)})
    assert "timeout of 0.3 s" in proc.stdout, (proc.stdout, proc.stderr[-500:])
