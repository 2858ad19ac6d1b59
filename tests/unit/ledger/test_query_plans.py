"""The control plane's per-tick queries read through indexes, never a whole history table.

Each query below runs every few seconds in a sensor; a full scan of a table that grows with
history (evaluations, checkpoints, metric points, events, instances, costs) makes a tick
cost grow with every job ever run (measured in docs/benchmarks.md: 0.1-0.7 s at 300,000
evaluations before these indexes). The real functions are called on a real SQLite ledger;
the statements they send are captured and SQLite's plan for each is checked.
"""
from __future__ import annotations

import re
import sqlite3

import pytest
import sqlalchemy as sa

from orbit_dagster.control.capacity import capacity
from orbit_dagster.control.dispatch import fleet_notices
from orbit_dagster.control.evaluate import pending_evaluations, reconcile_evaluations
from orbit_dagster.control.placement import measured_save_seconds
from orbit_dagster.control.queue import queued_jobs
from orbit_dagster.control.reconcile import active_attempts, cancelled_but_running
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings

HISTORY = ("evaluations", "checkpoints", "metric_points", "events", "instances", "costs", "job_states", "run_states")
# "SCAN evaluations", "SCAN e USING INDEX ..." (a whole index is read: still a full scan);
# a subquery "(subquery-1)" or a CTE by its name is no table.
SCAN = re.compile(r"^SCAN (\w+)")


def captured(ledger, call) -> list[tuple[str, tuple | dict]]:
    seen: list[tuple[str, tuple | dict]] = []

    def grab(conn, cursor, statement, parameters, context, executemany):  # noqa: ARG001
        if statement.lstrip().upper().startswith(("SELECT", "WITH", "UPDATE")):
            seen.append((statement, parameters))

    sa.event.listen(ledger.engine, "before_cursor_execute", grab)
    try:
        call()
    finally:
        sa.event.remove(ledger.engine, "before_cursor_execute", grab)
    return seen


def full_scans(ledger, statements) -> list[str]:
    con = sqlite3.connect(str(ledger.path))
    aliases: list[str] = []
    try:
        for sql, params in statements:
            for row in con.execute("EXPLAIN QUERY PLAN " + sql, params):
                m = SCAN.match(row[3])
                # An index walked in order under a LIMIT stops after LIMIT rows: not a full scan.
                if m and not (" USING " in row[3] and re.search(r"\bLIMIT\b", sql, re.I)):
                    aliases.append(f"{m.group(1)} in: {' '.join(sql.split())[:120]}")
    finally:
        con.close()
    return aliases


def table_of(alias_line: str, sql_tables: tuple[str, ...] = HISTORY) -> str | None:
    alias, _, sql = alias_line.partition(" in: ")
    if alias in sql_tables:
        return alias
    m = re.search(rf"\b({'|'.join(sql_tables)})\s+(?:AS\s+)?{re.escape(alias)}\b", sql)
    return m.group(1) if m else None


@pytest.fixture
def settings(orbit_home) -> Settings:
    s = Settings.from_env(orbit_home)
    ledger = s.ledger()
    with ledger.write() as tx:
        R.insert_job(tx, {"job_id": "j", "experiment": "e", "project": "p", "created_at": 1.0},
                     [R.state_row("j", 1, "CREATED"), R.state_row("j", 1, "QUEUED")])
    return s


def _followups(ledger):
    from orbit_dagster.sensors.followups import stale_experiments

    return stale_experiments(ledger, 0.0)


TICK_QUERIES = {
    "queue": lambda s: queued_jobs(s.ledger()),
    "pending evaluations": lambda s: pending_evaluations(s.ledger(), 50),
    "evaluation claims": lambda s: reconcile_evaluations(s, lambda run_id: True),
    "active attempts": lambda s: active_attempts(s.ledger()),
    "cancelled but running": lambda s: cancelled_but_running(s.ledger()),
    "interruptions": lambda s: R.interruptions(s.ledger(), "j"),
    "stale experiments": lambda s: _followups(s.ledger()),
    "notice record": lambda s: fleet_notices(s.ledger(), "sim"),
    "save seconds": lambda s: measured_save_seconds(s.ledger(), "t"),
    "pool capacity": lambda s: capacity(s.ledger(), [], []),
}


@pytest.mark.parametrize("name", sorted(TICK_QUERIES))
def test_tick_query_reads_no_history_table_whole(settings, name):
    ledger = settings.ledger()
    statements = captured(ledger, lambda: TICK_QUERIES[name](settings))
    assert statements, "the function sent no query"
    scans = [line for line in full_scans(ledger, statements) if table_of(line)]
    assert not scans, f"{name}: full scan of a history table: {scans}"


def test_the_checker_sees_a_full_scan(settings):
    """The check above can fail: a query filtering on an unindexed column is caught."""
    ledger = settings.ledger()
    statements = captured(ledger, lambda: ledger.rows("SELECT * FROM evaluations WHERE reason = 'x'"))
    assert [table_of(line) for line in full_scans(ledger, statements)] == ["evaluations"]


def test_stale_experiments_seeks_by_finish_time(settings):
    """Finished since the cursor: a range of (state, finished_at), not every finished row."""
    ledger = settings.ledger()
    statements = captured(ledger, lambda: _followups(ledger))
    con = sqlite3.connect(str(ledger.path))
    plan = [row[3] for sql, params in statements for row in con.execute("EXPLAIN QUERY PLAN " + sql, params)]
    con.close()
    assert any(re.search(r"SEARCH e USING .*\(state=\? AND finished_at>\?\)", line) for line in plan), plan
