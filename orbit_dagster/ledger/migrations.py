"""Versioned schema migrations of the ledger.

`schema_migrations` records every version applied. Opening a ledger applies the missing
ones in order, each in its own transaction, under the database's write lock (SQLite) or an
advisory lock (PostgreSQL), so two processes opening a new ledger at once migrate it once.
A ledger newer than this code is refused; so is a home from before the transactional
ledger (Parquet commit folders), with the command that converts it.

A new SQLite ledger is made whole under a temporary name and linked into place, so a
ledger file that exists is always a migrated ledger: one that is empty, cut short or
without tables was damaged, and is refused (`health.py`), never migrated over.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Callable

import sqlalchemy as sa

from . import rollups
from .database import Database, Tx
from .errors import LedgerError, damaged
from .health import fsync_dir, probe
from .schema import TABLES, VIEWS, metadata, view_sql

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


def _v5_identity(tx: Tx) -> None:
    # One row: the id homes record (identity.py) to tell this ledger from a swapped or reset one.
    tx.conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS ledger_identity (ledger_id TEXT PRIMARY KEY, "
                            "created_at DOUBLE PRECISION)")
    if not tx.scalar("SELECT count(*) FROM ledger_identity"):
        tx.execute("INSERT INTO ledger_identity (ledger_id, created_at) VALUES (?, ?)",
                   [str(uuid.uuid4()), time.time()])


def _v6_run_workers(tx: Tx) -> None:
    metadata.create_all(tx.conn, tables=[TABLES["run_workers"].table], checkfirst=True)


def _v8_discovery(tx: Tx) -> None:
    # A ledger made by this code already has them (version 1 creates every table); an older one gains them, empty.
    metadata.create_all(tx.conn, tables=[TABLES[name].table for name in ("catalog_refreshes", "catalog_changes")],
                        checkfirst=True)


def _v9_groups(tx: Tx) -> None:
    # A ledger made by this code already has it (version 1 creates every table); an older one gains
    # it, empty (no job of it spanned several instances), and the per-node cost view over it.
    metadata.create_all(tx.conn, tables=[TABLES["group_members"].table], checkfirst=True)
    _create_views(tx)


def _v10_trained_at(tx: Tx) -> None:
    # A ledger made by this code already has it (version 1 creates every table); an older one's
    # checkpoints gain it, empty: their lost attempts' waste begins at their durable time, as it did.
    columns = {c["name"] for c in sa.inspect(tx.conn).get_columns("checkpoints")}
    if "trained_at" not in columns:
        tx.conn.exec_driver_sql("ALTER TABLE checkpoints ADD COLUMN trained_at DOUBLE PRECISION")


# (version, what it does, the change). Append only: a released migration never changes.
MIGRATIONS: list[tuple[int, str, Callable[[Tx], None]]] = [
    (1, "transactional ledger: tables, indexes, views", _v1_initial),
    (2, "cost totals and latest evaluation values kept on write", _v2_rollups),
    (3, "latest evaluation values with their checkpoint's lineage and deletion", _v3_eval_latest_lineage),
    (4, "where a handed-off attempt's following resumes", _v4_handoff),
    (5, "the ledger's identity", _v5_identity),
    (6, "each run worker's liveness record", _v6_run_workers),
    (7, "cost by job: evaluation dollars per training dollar", _create_views),
    (8, "offer discovery: each refresh per source, and the change set", _v8_discovery),
    (9, "the nodes of multi-node attempts, and cost by node", _v9_groups),
    (10, "when training went on past each checkpoint", _v10_trained_at),
]
LATEST = MIGRATIONS[-1][0]


def _lock(tx: Tx) -> None:
    if tx.dialect == "postgresql":
        tx.conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK_ID})")


def current_version(ledger: Database) -> int:
    with ledger.read() as tx:
        if not sa.inspect(tx.conn).has_table("schema_migrations"):
            return 0
        return int(tx.scalar("SELECT coalesce(max(version), 0) FROM schema_migrations") or 0)


def refuse_legacy_home(ledger: Database) -> None:
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


TEMP_MAX_AGE_S = 3600.0


def _create_sqlite(path: Path) -> None:
    """Make a new ledger at `path`: migrated under a temporary name, then hard-linked into
    place, which fails if another process made it first (theirs is kept, ours dropped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.new-*"):  # left by a process killed while making one
        try:
            if time.time() - old.stat().st_mtime > TEMP_MAX_AGE_S:
                old.unlink()
        except FileNotFoundError:
            continue
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fresh = Database(f"sqlite:///{tmp}")
    try:
        _apply(fresh)
        fresh.dispose()  # the last connection closes: its write-ahead log is folded in and removed
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: a rename, where nothing is yet
            if not path.exists():
                os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        fresh.dispose()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)


def upgrade_schema(ledger: Database) -> int:
    """Bring the ledger to LATEST; returns the version it was at (0: made now)."""
    refuse_legacy_home(ledger)
    if ledger.path is not None:
        state = probe(ledger.path)
        if state.damaged:
            raise state.error(ledger.path)
        if not state.exists:
            _create_sqlite(ledger.path)
            return 0
        if not _has_schema(ledger):
            raise damaged(ledger.display, "a SQLite database without the ledger's tables (emptied, or never a ledger)")
    return _apply(ledger)


def _has_schema(ledger: Database) -> bool:
    with ledger.read() as tx:
        return sa.inspect(tx.conn).has_table("schema_migrations")


def _apply(ledger: Database) -> int:
    before = current_version(ledger)
    if before > LATEST:
        raise LedgerError(f"the ledger at {ledger.display} has schema version {before}, newer than this "
                          f"orbit-dagster knows ({LATEST})", field="ledger", value=before,
                          fix="upgrade orbit-dagster on this machine to the version that wrote it")
    if before == LATEST and _applied(ledger) >= len(MIGRATIONS):
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


def _applied(ledger: Database) -> int:
    """How many of this code's versions the ledger has: a version between two applied ones
    (written later, e.g. on another branch of development) is applied too, not skipped."""
    versions = [v for v, _, _ in MIGRATIONS]
    marks = ", ".join("?" for _ in versions)
    return int(ledger.scalar(f"SELECT count(*) FROM schema_migrations WHERE version IN ({marks})", versions) or 0)


def ledger_url_for(home: Path) -> str:
    return f"sqlite:///{(Path(home) / 'ledger' / 'ledger.sqlite').resolve()}"
