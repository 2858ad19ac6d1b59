"""The ledger's database: SQLite (WAL, durable commits) or PostgreSQL, its engine and transactions.

Every process (the daemon's sensors, each Dagster run, the CLI) opens the same database;
the database, not this code, makes concurrent writes safe. A write is one transaction:
`commit()` inserts a batch of rows for several tables atomically, and `write()` gives a
transaction in which a process can read, check and then write (on SQLite it takes the
write lock up front, `BEGIN IMMEDIATE`; on PostgreSQL rows read `FOR UPDATE` are locked).

SQL is written once, with `?` placeholders, in the subset SQLite, PostgreSQL and DuckDB
share (see `schema.py` for the conventions).

`Database` is the connection alone. `Ledger` (store.py) is a `Database` opened through the
checks (identity.py, migrations.py) and read through the SQL face (face.py); those modules
take a `Database`, so they sit below `Ledger` and none of them imports store.py.
"""
from __future__ import annotations

import errno
import os
import re
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timezone
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import sqlalchemy as sa

from . import rollups
from .errors import LedgerError, damaged
from .health import is_corruption
from .schema import TABLES

SQLITE_BUSY_TIMEOUT_S = 30.0


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def epoch(value: Any) -> Any:
    """A datetime as seconds since the epoch (what the ledger stores); anything else unchanged."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.timestamp()
    return value


def as_datetime(value: float | datetime | None) -> datetime | None:
    """A ledger time (seconds since the epoch) as an aware UTC datetime."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromtimestamp(float(value), timezone.utc)


_PLACEHOLDER = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"])*\"|\?")


@lru_cache(maxsize=2048)
def _named(sql: str) -> tuple[str, int]:
    """`?` placeholders (outside quotes) -> `:p0, :p1, ...` for SQLAlchemy; and their count."""
    count = 0

    def repl(m: re.Match) -> str:
        nonlocal count
        if m.group(0) != "?":
            return m.group(0)
        count += 1
        return f":p{count - 1}"

    return _PLACEHOLDER.sub(repl, sql), count


def _params(sql: str, params: list | tuple | dict | None) -> tuple[sa.TextClause, dict]:
    if isinstance(params, dict):
        return sa.text(sql), {k: epoch(v) for k, v in params.items()}
    named, count = _named(sql)
    values = list(params or [])
    if len(values) != count:
        raise LedgerError(f"query has {count} placeholders but {len(values)} values", field="params")
    return sa.text(named), {f"p{i}": epoch(v) for i, v in enumerate(values)}


def _bind_row(spec, row: dict) -> dict:
    known = spec.columns
    extra = set(row) - set(known)
    if extra:
        raise LedgerError(f"table {spec.name}: unknown column(s) {sorted(extra)}", field=spec.name,
                          value=sorted(extra), fix=f"columns are: {', '.join(known)}")
    out = {}
    for c in known:
        if c not in row:
            continue
        v = row[c]
        out[c] = int(v) if isinstance(v, bool) else float(v) if isinstance(v, Decimal) else epoch(v)
    return out


class Tx:
    """One transaction: read, check, write; committed on leaving the `with`, rolled back on error."""

    def __init__(self, conn: sa.Connection, dialect: str):
        self.conn, self.dialect = conn, dialect

    @property
    def for_update(self) -> str:
        """Appended to a SELECT whose rows this transaction goes on to change."""
        return " FOR UPDATE" if self.dialect == "postgresql" else ""

    def execute(self, sql: str, params: list | tuple | dict | None = None) -> int:
        text, values = _params(sql, params)
        return self.conn.execute(text, values).rowcount

    def rows(self, sql: str, params: list | tuple | dict | None = None) -> list[dict[str, Any]]:
        text, values = _params(sql, params)
        return [dict(r) for r in self.conn.execute(text, values).mappings()]

    def one(self, sql: str, params: list | tuple | dict | None = None) -> dict[str, Any] | None:
        rows = self.rows(sql, params)
        return rows[0] if rows else None

    def scalar(self, sql: str, params: list | tuple | dict | None = None) -> Any:
        text, values = _params(sql, params)
        return self.conn.execute(text, values).scalar()

    def insert(self, table: str, rows: list[dict[str, Any]]) -> int:
        """Insert rows; a repeated key is ignored or updates the row, as the table says.
        Returns how many rows were new (or updated)."""
        if not rows:
            return 0
        if table not in TABLES:
            raise LedgerError(f"unknown ledger table {table!r}", field="table", value=table,
                              fix=f"use one of {sorted(TABLES)}")
        spec = TABLES[table]
        bound = [_bind_row(spec, r) for r in rows]
        written = 0
        # Rows with the same columns go in one statement (executemany).
        groups: dict[tuple[str, ...], list[dict]] = {}
        for r in bound:
            groups.setdefault(tuple(r), []).append(r)
        for cols, batch in groups.items():
            sql = _insert_sql(spec.name, cols, spec.key, spec.on_conflict)
            result = self.conn.execute(sa.text(sql), batch)
            written += max(result.rowcount, 0)
        rollups.after_insert(self, table, bound)
        return written


@lru_cache(maxsize=512)
def _insert_sql(table: str, cols: tuple[str, ...], key: tuple[str, ...], on_conflict: str) -> str:
    names = ", ".join(cols)
    values = ", ".join(f":{c}" for c in cols)
    sql = f"INSERT INTO {table} ({names}) VALUES ({values})"
    if on_conflict == "append":
        return sql
    target = ", ".join(key)
    updates = [c for c in cols if c not in key]
    if on_conflict == "update" and updates:
        return sql + f" ON CONFLICT ({target}) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in updates)
    return sql + f" ON CONFLICT ({target}) DO NOTHING"


def _sqlite_engine(path: Path) -> sa.Engine:
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S,
                                                                 "check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_con, _record) -> None:
        # Transactions are ours (BEGIN below), not the driver's implicit ones.
        dbapi_con.isolation_level = None
        cur = dbapi_con.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, nor it them
        cur.execute("PRAGMA synchronous=FULL")  # a commit survives a power cut
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        # Reads through a memory map and a larger page cache: every CLI call opens a new
        # connection, whose first query otherwise reads each page with a system call (the
        # count behind `orbit best` on 25,000 checkpoints: 190 ms cold, 50 ms mapped).
        # Writes still go through the WAL; the map is address space, not memory.
        cur.execute("PRAGMA mmap_size=1073741824")
        cur.execute("PRAGMA cache_size=-32768")
        cur.close()

    @sa.event.listens_for(engine, "handle_error")
    def _damaged(ctx) -> BaseException | None:
        # SQLite's words for pages that are not a database, wherever they surface (a query, a
        # commit, a connection's first pragma): the file and the fix instead of a traceback.
        exc = ctx.original_exception
        if isinstance(exc, sqlite3.DatabaseError) and is_corruption(str(exc)):
            return damaged(str(path), f"damaged: SQLite says \"{' '.join(str(exc).split())[:200]}\"")
        if isinstance(exc, sqlite3.OperationalError) and "unable to open database file" in str(exc):
            return _cannot_open(path)
        return None

    @sa.event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        # A write takes the lock first: two writers that each read-then-write never
        # deadlock on a lock upgrade, they queue.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("orbit_write") else "BEGIN")

    return engine


def _cannot_open(path: Path) -> OSError | None:
    """Why SQLite could not open the ledger, as the OSError it stands for (the CLI names the
    fix for those): a read-only file system, or a directory this user may not write (SQLite
    must create the `-wal` and `-shm` files beside a ledger it opens)."""
    where = path.parent if path.parent.exists() else path
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    except OSError:
        return None
    if not os.access(where, os.W_OK):
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path.parent))
    return None


def _postgres_engine(url: str) -> sa.Engine:
    import psycopg  # lazy: 0.4 s, and only a team's ledger (PostgreSQL) needs it

    # Client-side binding (psycopg's ClientCursor, as psycopg2 and SQLite do it): the shared
    # SQL passes parameters whose type only the value tells, e.g. `? IS NULL OR col = ?`;
    # with server-side binding PostgreSQL refuses those ("could not determine data type of
    # parameter"). Values are still escaped by the driver, never pasted in by us.
    return sa.create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=8,
                            connect_args={"cursor_factory": psycopg.ClientCursor})


class Database:
    """One database, reached by URL (`sqlite:///...` or `postgresql+psycopg://...`): its engine,
    transactions and reads, with none of the open-time checks (those are `Ledger.open`'s)."""

    def __init__(self, url: str, *, home: Path | None = None):
        self.url = url
        self.home = Path(home) if home else None
        self.dialect = sa.engine.make_url(url).get_backend_name()
        if self.dialect == "sqlite":
            self.path: Path | None = Path(sa.engine.make_url(url).database or "").resolve()
            self.engine = _sqlite_engine(self.path)
        elif self.dialect == "postgresql":
            self.path = None
            self.engine = _postgres_engine(url)
        else:
            raise LedgerError(f"unsupported ledger database {self.dialect!r}", field="ORBIT_LEDGER_URL", value=url,
                              fix="use sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB")

    @property
    def display(self) -> str:
        """Where the ledger is, without any password."""
        return str(self.path) if self.path else sa.engine.make_url(self.url).render_as_string(hide_password=True)

    # ---- transactions -------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[Tx]:
        """A write transaction (the database's write lock on SQLite, row locks on PostgreSQL)."""
        with self.engine.connect().execution_options(orbit_write=True) as conn:
            with conn.begin():
                yield Tx(conn, self.dialect)

    @contextmanager
    def read(self) -> Iterator[Tx]:
        """A read transaction: every query in it sees the same snapshot."""
        with self.engine.connect() as conn:
            with conn.begin():
                yield Tx(conn, self.dialect)

    def commit(self, rows: dict[str, list[dict[str, Any]]]) -> int:
        """Insert rows for one or more tables in one transaction; returns rows written."""
        batches = {t: b for t, b in rows.items() if b}
        if not batches:
            return 0
        with self.write() as tx:
            return sum(tx.insert(t, b) for t, b in batches.items())

    def append(self, table: str, *rows: dict[str, Any]) -> int:
        return self.commit({table: list(rows)})

    # ---- reads (each its own snapshot) --------------------------------------------
    def rows(self, sql: str, params: list | tuple | dict | None = None) -> list[dict[str, Any]]:
        with self.read() as tx:
            return tx.rows(sql, params)

    def one(self, sql: str, params: list | tuple | dict | None = None) -> dict[str, Any] | None:
        with self.read() as tx:
            return tx.one(sql, params)

    def scalar(self, sql: str, params: list | tuple | dict | None = None) -> Any:
        with self.read() as tx:
            return tx.scalar(sql, params)

    def frame(self, sql: str, params: list | tuple | dict | None = None):
        """A query's rows as a pandas DataFrame (columns in the query's order)."""
        import pandas as pd  # lazy: 0.8 s or more, and every CLI call imports this module; few make a frame

        with self.read() as tx:
            text, values = _params(sql, params)
            result = tx.conn.execute(text, values)
            columns = list(result.keys())
            # The driver's tuples straight into pandas: SQLAlchemy's Row objects doubled the
            # time of a large table (100,000 cost lines: 0.44 s -> 0.22 s).
            rows = result.cursor.fetchall() if result.cursor is not None else []
            result.close()
            return pd.DataFrame.from_records(rows, columns=columns)

    def dispose(self) -> None:
        self.engine.dispose()
