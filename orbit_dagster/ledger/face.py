"""The ledger's SQL face: DuckDB, read-only, over the transactional store.

Three doors, one set of names (the tables of `schema.py` and its views):
- `orbit sql` and `Ledger.query()` (pandas): an in-memory DuckDB connection that attaches
  the store READ_ONLY, defines the views, then is locked (no file or network access, no
  configuration change); `check_read_only()` admits one plain SELECT whose table functions
  are harmless, so nothing can write, read another file, attach a database or install an
  extension;
- `ledger.duckdb` beside a SQLite store: the same views in a file a person opens with
  `duckdb` (they read the store through `sqlite_scan`; DuckDB loads its sqlite extension
  by itself).
DuckDB reads the store without indexes, so the control plane's own hot questions go to
the store (`store.py`); this face is for analysis, where a scan is what one wants.

A SQLite store is read by DuckDB in a process of its own (`_Worker`), never in a process
that holds the store open through Python's sqlite3: DuckDB's sqlite extension carries its
own copy of SQLite, and when that copy closes the file the kernel drops every POSIX lock
the process holds on it, those of Python's connections included (locks belong to a process
and a file), after which another process may rebuild the WAL index under them.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from ..core.errors import OrbitError
from .schema import TABLES, VIEWS, view_sql

if TYPE_CHECKING:
    from .store import Ledger

EXTENSIONS = {"sqlite": "sqlite", "postgresql": "postgres_scanner"}
# Table functions a read-only query may use: they compute, they read no file or database.
SAFE_TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "json_each", "json_tree",
    "duckdb_tables", "duckdb_views", "duckdb_columns", "duckdb_schemas", "duckdb_constraints",
})
_installed: set[str] = set()
_install_lock = threading.Lock()
_local = threading.local()


class SqlRefused(OrbitError):
    """A query the read-only SQL face does not run."""


def _load(con: duckdb.DuckDBPyConnection, dialect: str, fallback_dir: Path | None = None) -> None:
    """Install (once per process) and load the extension that reads the store. It comes from
    the PyPI wheel (duckdb-extension-*), into DuckDB's own extension directory where a
    person's `duckdb` finds it too; with no usable home directory, into `fallback_dir`."""
    from duckdb_extensions import import_extension

    name = EXTENSIONS[dialect]
    with _install_lock:
        try:
            if name not in _installed:
                import_extension(name, con=con)
            con.execute(f"LOAD {name}")
        except duckdb.IOException:
            if fallback_dir is None:
                raise
            fallback_dir.mkdir(parents=True, exist_ok=True)
            quoted = str(fallback_dir).replace("'", "''")
            con.execute(f"SET home_directory = '{quoted}'")
            con.execute(f"SET extension_directory = '{quoted}'")
            import_extension(name, con=con)
            con.execute(f"LOAD {name}")
        _installed.add(name)


def _libpq_dsn(url: str) -> str:
    """A libpq connection string for DuckDB's postgres extension; the password is never put in
    it (libpq reads PGPASSWORD or ~/.pgpass itself)."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    parts = {"host": u.host, "port": u.port, "dbname": u.database, "user": u.username}
    return " ".join(f"{k}={v}" for k, v in parts.items() if v is not None)


def _fallback_dir(ledger: "Ledger") -> Path | None:
    base = ledger.home or (ledger.path.parent if ledger.path else None)
    return None if base is None else Path(base) / "duckdb_extensions"


def attach_store(con: duckdb.DuckDBPyConnection, ledger: "Ledger") -> None:
    _load(con, ledger.dialect, _fallback_dir(ledger))
    if ledger.dialect == "sqlite":
        path = str(ledger.path).replace("'", "''")
        con.execute(f"ATTACH '{path}' AS store (TYPE sqlite, READ_ONLY)")
    else:
        dsn = _libpq_dsn(ledger.url).replace("'", "''")
        con.execute(f"ATTACH '{dsn}' AS store (TYPE postgres, READ_ONLY)")


def define_views(con: duckdb.DuckDBPyConnection, source: str = "store.{table}") -> None:
    """Every ledger table and view under its own name in the connection's default schema."""
    for name in TABLES:
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {source.format(table=name)}")
    for name in VIEWS:
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {view_sql(name, 'duckdb')}")


def locked_connection(ledger: "Ledger") -> duckdb.DuckDBPyConnection:
    """A DuckDB connection over the ledger that can read it and nothing else."""
    con = duckdb.connect(":memory:")
    attach_store(con, ledger)
    define_views(con)
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _connection(ledger: "Ledger") -> duckdb.DuckDBPyConnection:
    # One per thread and ledger: DuckDB connections are not shared across threads.
    cache = getattr(_local, "cons", None)
    if cache is None:
        cache = _local.cons = {}
    con = cache.get(ledger.url)
    if con is None:
        con = cache[ledger.url] = locked_connection(ledger)
    return con


def _table_functions(tree: object) -> list[str]:
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if node.get("type") == "TABLE_FUNCTION":
                found.append(str((node.get("function") or {}).get("function_name")))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(tree)
    return found


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """The one SELECT statement in `sql`, or SqlRefused naming why."""
    fix = "write one SELECT over the ledger's tables and views (list them: SELECT * FROM duckdb_views())"
    if not isinstance(sql, str) or not sql.strip():
        raise SqlRefused("the query is empty", field="QUERY", value=sql, fix=fix)
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise SqlRefused(f"the query does not parse: {str(exc).splitlines()[0]}", field="QUERY", value=sql[:200],
                         fix=fix) from None
    if len(statements) != 1:
        raise SqlRefused(f"the query holds {len(statements)} statements; the ledger console runs one",
                         field="QUERY", value=sql[:200], fix=fix)
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise SqlRefused(f"{kind.name} statements are refused: the ledger is read-only here", field="QUERY",
                         value=sql[:200], fix=fix)
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    if tree.get("error"):
        raise SqlRefused(f"only plain SELECT queries are run here ({tree.get('error_message')})", field="QUERY",
                         value=sql[:200], fix=fix)
    unsafe = sorted(set(_table_functions(tree)) - SAFE_TABLE_FUNCTIONS)
    if unsafe:
        raise SqlRefused(f"table function(s) {', '.join(unsafe)} are refused: the console reads the ledger only",
                         field="QUERY", value=sql[:200], fix=fix)
    return sql


def _run(con: duckdb.DuckDBPyConnection, sql: str):
    check_read_only(con, sql)
    try:
        return con.execute(sql).df()
    except duckdb.Error as exc:
        raise OrbitError(f"query failed: {str(exc).splitlines()[0]}", field="QUERY", value=sql[:200],
                         fix="list tables and views with: SELECT table_name FROM information_schema.tables") from None


def _serve(url: str, home: str | None, pipe) -> None:
    """The worker process: one locked DuckDB connection, one query at a time from the pipe."""
    import signal

    from .store import Ledger

    # A parent started with SIGTERM ignored (a background job, a supervisor) passes that on;
    # its exit then terminates this daemonic child with SIGTERM and waits for it: it must die.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    ledger = Ledger(url, home=Path(home) if home else None)
    write_people_catalog(ledger)
    con = locked_connection(ledger)
    ledger.dispose()  # this process keeps no sqlite3 connection to the store
    pipe.send(("ready", None))
    while True:
        try:
            sql = pipe.recv()
        except EOFError:
            return
        try:
            pipe.send(("ok", _run(con, sql)))
        except OrbitError as exc:
            pipe.send(("refused", (type(exc).__name__, str(exc), exc.field, exc.value, exc.fix)))
        except Exception as exc:  # noqa: BLE001 - reported to the asking process, which raises it
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))


class _Worker:
    """A DuckDB process for one SQLite ledger, started on first use, reused by the next queries."""

    _workers: dict[tuple[int, str], "_Worker"] = {}
    _lock = threading.Lock()

    def __init__(self, ledger: "Ledger"):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's SQLite in it
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(ledger.url, str(ledger.home) if ledger.home else None, child),
                                daemon=True, name="orbit-ledger-face")
        self.proc.start()
        child.close()
        self._call_lock = threading.Lock()
        kind, _ = self.pipe.recv()
        if kind != "ready":
            raise OrbitError("the ledger's SQL face did not start", fix="see the error above")

    @classmethod
    def for_ledger(cls, ledger: "Ledger") -> "_Worker":
        import os

        key = (os.getpid(), ledger.url)
        with cls._lock:
            worker = cls._workers.get(key)
            if worker is None or not worker.proc.is_alive():
                worker = cls._workers[key] = cls(ledger)
            return worker

    def query(self, sql: str):
        with self._call_lock:
            self.pipe.send(sql)
            kind, payload = self.pipe.recv()
        if kind == "ok":
            return payload
        if kind == "refused":
            name, message, field, value, fix = payload
            error = SqlRefused if name == "SqlRefused" else OrbitError
            exc = error.__new__(error)
            Exception.__init__(exc, message)
            exc.field, exc.value, exc.fix = field, value, fix
            raise exc
        raise OrbitError(f"the ledger's SQL face failed: {payload}", fix="see the message; the store is untouched")


def face_query(ledger: "Ledger", sql: str):
    """Run one read-only SELECT through the face; a pandas DataFrame."""
    if ledger.dialect == "sqlite":
        return _Worker.for_ledger(ledger).query(sql)
    return _run(_connection(ledger), sql)


def write_people_catalog(ledger: "Ledger") -> bool:
    """`ledger.duckdb` beside a SQLite store, holding the views for `duckdb`. False when a
    person holds it open (their views stay valid) or the store is not SQLite."""
    if ledger.path is None:
        return False
    target = ledger.path.with_name("ledger.duckdb")
    try:
        con = duckdb.connect(str(target))
    except duckdb.Error:
        return False
    try:
        _load(con, "sqlite", _fallback_dir(ledger))
        path = str(ledger.path).replace("'", "''")
        define_views(con, source="sqlite_scan('" + path + "', '{table}')")
        con.execute("CREATE OR REPLACE TABLE orbit_info AS SELECT ? AS store, ? AS note",
                    [str(ledger.path), "views over the ledger's SQLite store; times are seconds since the epoch "
                                       "(UTC): to_timestamp(created_at)"])
    except (duckdb.Error, OSError):
        return False  # a convenience for people; the ledger works without it
    finally:
        con.close()
    return True
