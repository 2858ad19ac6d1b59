"""The ledger: its database (database.py) opened through the checks, and read through the SQL face.

`Ledger.open` admits a database only once identity.py has found it undamaged and the home's
own, and migrations.py has brought its schema to this code's; `Ledger.query` reads it through
DuckDB (face.py), read-only. The engine, the transactions and the SQL dialect are
`database.Database`'s, re-exported here for the callers that take them from this module.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import sqlalchemy as sa

from ..core.errors import OrbitError
from .database import SQLITE_BUSY_TIMEOUT_S, Database, Tx, as_datetime, epoch, utcnow
from .errors import LedgerDamaged, LedgerError, damaged
from .health import is_corruption
from .identity import admit
from .postgres import unreachable
from .schema import TABLES

__all__ = ["SQLITE_BUSY_TIMEOUT_S", "Database", "Ledger", "LedgerError", "Tx", "as_datetime", "epoch", "utcnow"]


class Ledger(Database):
    """The ledger: one database, reached by URL (`sqlite:///...` or `postgresql+psycopg://...`)."""

    _open: dict[tuple[int, str], "Ledger"] = {}
    _open_lock = threading.Lock()

    def __init__(self, url: str, *, home: Path | None = None):
        super().__init__(url, home=home)
        # The SQL face's limits for `query()` (the settings' ORBIT_SQL_*, set by
        # `Settings.ledger()`); None: limits.py's defaults.
        self.sql_limits = None
        self._face_checked = False

    _admitted: set[tuple[int, str, str]] = set()

    @classmethod
    def open(cls, url: str, *, home: Path | None = None) -> "Ledger":
        """The ledger at `url`, checked (identity.py: not damaged, the one `home` recorded),
        migrated to this code's schema, and shared within this process.

        The checks cost a `stat`, a 100-byte read, the home's small record file and one
        query; a file SQLite finds damaged later is refused then (the engine's error hook)."""
        key = (os.getpid(), url)
        with cls._open_lock:
            ledger = cls._open.get(key)
            admitted = (os.getpid(), url, str(Path(home).resolve()) if home else "")
            if ledger is None or admitted not in cls._admitted:
                candidate = ledger or cls(url, home=home)
                cls._admit(candidate, home)
                cls._admitted.add(admitted)
                cls._open[key] = ledger = candidate
            return ledger

    @staticmethod
    def _admit(ledger: "Ledger", home: Path | None, *, accept: bool = False, note: str | None = None):
        try:
            # ledger.duckdb (the views for people) is written by the SQL face's process.
            return admit(ledger, home=home, accept=accept, note=note)
        except sa.exc.OperationalError as exc:
            if ledger.dialect != "postgresql":
                raise
            raise unreachable(ledger.url, exc) from None

    @classmethod
    def reopen(cls, url: str, *, home: Path | None = None, accept: bool = False, note: str | None = None) -> "Ledger":
        """Drop this process's ledger at `url` and open it again: after `orbit ledger repair`
        set a damaged file aside (`accept`: take a missing or other ledger as the home's)."""
        with cls._open_lock:
            old = cls._open.pop((os.getpid(), url), None)
            if old is not None:
                old.dispose()
            cls._admitted = {a for a in cls._admitted if a[:2] != (os.getpid(), url)}
            ledger = cls(url, home=home)
            cls._admit(ledger, home, accept=accept, note=note)
            cls._admitted.add((os.getpid(), url, str(Path(home).resolve()) if home else ""))
            cls._open[(os.getpid(), url)] = ledger
            return ledger

    # ---- the DuckDB face ----------------------------------------------------------
    def query(self, sql: str):
        """A read-only query through the DuckDB SQL face (what people and notebooks use)."""
        # lazy: face.py brings duckdb and pandas (1 s or more), which most users of the ledger never need
        from .face import face_query

        if self.path is not None and not self._face_checked:
            # DuckDB reads the SQLite file with its own copy of SQLite, in a process of its own,
            # and a damaged table kills that process with a traceback. Touch each table's
            # b-tree here first (its largest rowid: a few pages each), where damage is the
            # engine's LedgerDamaged naming the file.
            with self.read() as tx:
                for name in TABLES:
                    tx.scalar(f"SELECT max(rowid) FROM {name}")
            self._face_checked = True
        try:
            return face_query(self, sql)
        except EOFError:  # the face's process died reading the file
            raise damaged(str(self.path or self.display), "unreadable by the SQL face (DuckDB)") from None
        except OrbitError as exc:
            # DuckDB reads the SQLite file itself: its report of damaged pages names the fix too.
            if self.path is not None and not isinstance(exc, LedgerDamaged) and is_corruption(str(exc)):
                raise damaged(str(self.path), "damaged: DuckDB could not read it") from None
            raise
