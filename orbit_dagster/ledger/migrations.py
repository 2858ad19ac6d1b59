"""Versioned schema migrations of the ledger.

`schema_migrations` records every version applied. Opening a ledger applies the missing
ones in order, each in its own transaction, under the database's write lock (SQLite) or an
advisory lock (PostgreSQL), so two processes opening a new ledger at once migrate it once.
A ledger newer than this code is refused; so is a home from before the transactional
ledger (Parquet commit folders), with the command that converts it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import sqlalchemy as sa

from . import rollups
from .schema import TABLES, VIEWS, metadata, view_sql
from .store import Ledger, LedgerError, Tx

ADVISORY_LOCK_ID = 720_177_001  # any constant: one migration at a time per PostgreSQL database


def _create_views(tx: Tx) -> None:
    for name in VIEWS:
        tx.conn.exec_driver_sql(f"DROP VIEW IF EXISTS {name}")
    for name in VIEWS:
        tx.conn.exec_driver_sql(f"CREATE VIEW {name} AS {view_sql(name, tx.dialect)}")


def _v1_initial(tx: Tx) -> None:
    metadata.create_all(tx.conn, tables=[t.table for t in TABLES.values()])
    _create_views(tx)


def _v2_rollups(tx: Tx) -> None:
    derived = ("cost_lines", "cost_jobs", "eval_latest")
    metadata.create_all(tx.conn, tables=[TABLES[name].table for name in derived], checkfirst=True)
    _create_views(tx)  # the cost views now read the totals
    rollups.rebuild(tx)


def _v3_eval_latest_lineage(tx: Tx) -> None:
    # eval_latest gained each checkpoint's lineage and deletion after version 2 was first
    # written; a ledger made in between is rebuilt (the table is derived: nothing is lost).
    columns = {c["name"] for c in sa.inspect(tx.conn).get_columns("eval_latest")}
    if {"lineage", "deleted"} <= columns:
        return
    tx.conn.exec_driver_sql("DROP TABLE eval_latest")
    metadata.create_all(tx.conn, tables=[TABLES["eval_latest"].table])
    rollups.refresh_eval_latest(tx)


HANDOFF_COLUMNS = (("handed_off_at", "DOUBLE PRECISION"), ("follow_offset", "BIGINT"), ("follow_step", "BIGINT"),
                   ("follow_progress_at", "DOUBLE PRECISION"))


def _v4_handoff(tx: Tx) -> None:
    # A ledger created by version 1 of this code already has them (create_all reads the
    # current schema); an older one gains them, empty: no attempt of it was handed off.
    columns = {c["name"] for c in sa.inspect(tx.conn).get_columns("runs")}
    for name, type_ in HANDOFF_COLUMNS:
        if name not in columns:
            tx.conn.exec_driver_sql(f"ALTER TABLE runs ADD COLUMN {name} {type_}")


def _v6_run_workers(tx: Tx) -> None:
    metadata.create_all(tx.conn, tables=[TABLES["run_workers"].table], checkfirst=True)


# (version, what it does, the change). Append only: a released migration never changes.
MIGRATIONS: list[tuple[int, str, Callable[[Tx], None]]] = [
    (1, "transactional ledger: tables, indexes, views", _v1_initial),
    (2, "cost totals and latest evaluation values kept on write", _v2_rollups),
    (3, "latest evaluation values with their checkpoint's lineage and deletion", _v3_eval_latest_lineage),
    (4, "where a handed-off attempt's following resumes", _v4_handoff),
    (6, "each run worker's liveness record", _v6_run_workers),
]
LATEST = MIGRATIONS[-1][0]


def _lock(tx: Tx) -> None:
    if tx.dialect == "postgresql":
        tx.conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK_ID})")


def current_version(ledger: Ledger) -> int:
    with ledger.read() as tx:
        if not sa.inspect(tx.conn).has_table("schema_migrations"):
            return 0
        return int(tx.scalar("SELECT coalesce(max(version), 0) FROM schema_migrations") or 0)


def refuse_legacy_home(ledger: Ledger) -> None:
    """A home written by the Parquet-commit ledger holds `segments/` beside the database."""
    if ledger.path is None:
        return
    segments = ledger.path.parent / "segments"
    if segments.is_dir() and not ledger.path.exists():
        raise LedgerError(
            f"{ledger.path.parent} holds a ledger in the old Parquet-commit format, which this version no longer "
            "reads", field="ORBIT_HOME", value=str(ledger.path.parent.parent),
            fix="convert it once with `orbit ledger upgrade` (it keeps the old folder as segments.bak), "
                "or point ORBIT_HOME at a new directory")


def migrate(ledger: Ledger) -> int:
    """Bring the ledger to LATEST; returns the version it was at."""
    refuse_legacy_home(ledger)
    before = current_version(ledger)
    if before > LATEST:
        raise LedgerError(f"the ledger at {ledger.display} has schema version {before}, newer than this "
                          f"orbit-dagster knows ({LATEST})", field="ledger", value=before,
                          fix="upgrade orbit-dagster on this machine to the version that wrote it")
    if before == LATEST:
        return before
    with ledger.write() as tx:
        _lock(tx)
        sa.Table("schema_migrations", sa.MetaData(), sa.Column("version", sa.Integer, primary_key=True),
                 sa.Column("description", sa.Text), sa.Column("applied_at", sa.Double)).create(tx.conn, checkfirst=True)
    for version, description, change in MIGRATIONS:
        with ledger.write() as tx:
            _lock(tx)
            # Re-read under the lock: another process may have applied it meanwhile.
            if tx.scalar("SELECT count(*) FROM schema_migrations WHERE version = ?", [version]):
                continue
            change(tx)
            tx.execute("INSERT INTO schema_migrations (version, description, applied_at) VALUES (?, ?, ?)",
                       [version, description, time.time()])
    return before


def ledger_url_for(home: Path) -> str:
    return f"sqlite:///{(Path(home) / 'ledger' / 'ledger.sqlite').resolve()}"
