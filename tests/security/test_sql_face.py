"""Issue 8, defect 3: `orbit sql` reads the ledger and nothing else.

Each attack goes through the CLI's own entry point (`main`) against a real ledger; after
each: exit 2 with one line naming the query, the ledger's rows unchanged, no file written
or read outside it, no extension installed, and the console still answers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orbit_dagster.control.submit import submit
from orbit_dagster.settings import Settings
from tests.helpers import run_cli
from tests.reliability import inject

SECRET = "s3cr3t-value-never-shown"


run = run_cli  # `orbit ARGV` in this process: (exit code, stdout, stderr)


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def extensions() -> set[str]:
    """Every DuckDB extension file on this machine's usual extension paths."""
    roots = [Path.home() / ".duckdb", Path(os.environ.get("ORBIT_HOME", ".")) / "duckdb_extensions"]
    return {str(p) for r in roots if r.exists() for p in r.rglob("*.duckdb_extension")}


@pytest.fixture
def ledger_home(orbit_home, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    job = submit(Settings.from_env(orbit_home), "charlm-finetune", {"config.steps": 8})
    code, out, _ = run(["sql", "SELECT job_id FROM jobs"])  # the console's connection is made
    assert code == 0 and job in out
    return orbit_home, job


def attacks(home: Path, outside: Path) -> list[tuple[str, str]]:
    ledger = home / "ledger"
    return [  # (query, what the old code did with it)
        (f"COPY (SELECT 'forged' AS job_id, 'SUCCEEDED' AS state) TO '{ledger}/segments/c-forged.parquet' (FORMAT parquet)",
         "wrote a segment file: a forged job"),
        (f"COPY jobs TO '{outside}/jobs.csv'", "wrote a file anywhere"),
        (f"ATTACH '{ledger}/ledger.duckdb' AS people; DROP VIEW people.jobs", "dropped a view of the people's catalog"),
        (f"ATTACH '{ledger}/ledger.duckdb' AS people", "attached a database"),
        ("ATTACH ':memory:' AS scratch", "attached a database"),
        ("DETACH store", "detached the store"),
        ("SELECT * FROM read_csv('/etc/passwd')", "read /etc/passwd"),
        ("SELECT * FROM read_text('/etc/passwd')", "read a file"),
        ("SELECT * FROM '/etc/passwd'", "read a file by its name"),
        ("WITH x AS (SELECT * FROM read_csv_auto('/etc/passwd')) SELECT * FROM x", "read a file in a CTE"),
        ("SELECT * FROM jobs WHERE job_id IN (SELECT * FROM read_csv('/etc/passwd'))", "read a file in a subquery"),
        (f"SELECT * FROM sqlite_scan('{ledger}/ledger.sqlite', 'jobs')", "opened the database file directly"),
        ("SELECT * FROM glob('/etc/*')", "listed files"),
        ("INSTALL httpfs", "installed an extension"),
        ("LOAD httpfs", "loaded an extension"),
        ("SET enable_external_access = true", "changed the configuration"),
        ("DROP VIEW jobs", "printed (no rows), exit 0, and the view was gone"),
        ("DELETE FROM store.jobs", "wrote the store"),
        ("UPDATE store.jobs SET state = 'SUCCEEDED'", "wrote the store"),
        ("INSERT INTO store.jobs (job_id, state) VALUES ('forged', 'SUCCEEDED')", "wrote the store"),
        ("CREATE TABLE scratch AS SELECT 1 AS x", "created a table"),
        (f"EXPORT DATABASE '{outside}/export'", "wrote files"),
        ("SELECT 1; DROP VIEW jobs", "ran the second statement"),
        ("SELECT getenv('AWS_SECRET_ACCESS_KEY')", "(a secret from the environment)"),
        ("", "printed a traceback"),
        ("   ", "printed a traceback"),
        ("SELEC * FROM jobs", "printed a traceback"),
        ("SELECT * FROM no_such_table", "printed a traceback"),
    ]


@pytest.mark.fault("defect 3: `orbit sql` attacks: COPY TO, ATTACH+DROP, read_csv('/etc/passwd'), INSTALL, "
                   "DROP VIEW, DML on the store, empty query ...",
                   expect="exit 2, one line; ledger, files and extensions unchanged")
def test_defect_3_orbit_sql_cannot_rewrite_history_or_reach_the_machine(ledger_home, tmp_path):
    """Old code (49321ab): the console was a DuckDB connection over the Parquet segments:
    `COPY ... TO '<segment>.parquet'` forged a job, ATTACH + DROP VIEW changed the catalog,
    read_csv read any file, INSTALL fetched extensions, `DROP VIEW jobs` printed "(no rows)"
    with exit 0, and `orbit sql ""` printed a traceback."""
    home, job = ledger_home
    outside = tmp_path / "outside"
    outside.mkdir()
    db = inject.sqlite_path(home)
    rows, tree, exts = inject.snapshot(db), files(home), extensions()
    failures = []
    for query, old in attacks(home, outside):
        code, out, err = run(["sql", query])
        line = err.strip()
        ok = (code == 2 and len(line.splitlines()) == 1 and line.startswith("error: ") and "fix:" in line
              and "Traceback" not in out + err and "root:" not in out + err and SECRET not in out + err)
        if not ok:
            failures.append((query, old, code, out[-300:], err[-300:]))
    assert not failures, failures
    assert inject.snapshot(db) == rows, "a query changed the ledger"
    assert files(home) == tree and not any(outside.iterdir()), "a query wrote a file"
    assert extensions() == exts, "a query installed an extension"
    # The console still answers, in this process (same connection) and in the people's catalog.
    code, out, _ = run(["sql", "SELECT count(*) AS n FROM jobs", "--json"])
    assert code == 0 and json.loads(out) == [{"n": 1}]
    import duckdb

    con = duckdb.connect(str(db.with_name("ledger.duckdb")), read_only=True)
    try:
        assert con.execute("SELECT job_id FROM jobs").fetchall() == [(job,)]
    finally:
        con.close()


@pytest.mark.fault("defect 3: `orbit sql \"\"` and `orbit sql \"DROP VIEW jobs\"` as a person runs them",
                   expect="one line on stderr, exit 2, no traceback")
def test_defect_3_the_real_cli_answers_a_bad_query_in_one_line(ledger_home):
    """Old code: `orbit sql ""` printed a Python traceback; `DROP VIEW jobs` printed "(no rows)", exit 0."""
    home, _ = ledger_home
    # This process used the DuckDB face: re-open its store connections before other processes
    # open the ledger (see tests/reliability/test_defect_2_ledger.py, the SQLite-locks defect).
    Settings.from_env(home).ledger().dispose()
    for query in ("", "DROP VIEW jobs"):
        proc = subprocess.run([sys.executable, "-m", "orbit_dagster.cli", "sql", query],
                              env={**os.environ, "ORBIT_HOME": str(home)}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")
        assert "(no rows)" not in proc.stdout
