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

Every query is bounded (`limits.py`): a statement timeout (a watchdog thread interrupts
the connection at the deadline and again until the query ends; the worker process is
killed if that does not stop it), DuckDB's memory limit
(also the most a fetched result may take), a spill directory of bounded size in the
ledger's own `tmp/`, and a bound on the SQL text. All are set before the connection locks
its configuration, so no query can change them. A refused or stopped query leaves the face
ready for the next one.

A SQLite store is read by DuckDB in a process of its own (`_Worker`), never in a process
that holds the store open through Python's sqlite3: DuckDB's sqlite extension carries its
own copy of SQLite, and when that copy closes the file the kernel drops every POSIX lock
the process holds on it, those of Python's connections included (locks belong to a process
and a file), after which another process may rebuild the WAL index under them.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pandas as pd
import sqlalchemy as sa
from duckdb_extensions import import_extension

from ..core.errors import OrbitError
from .database import Database
from .efficiency import FACE_VIEWS
from .limits import KILL_GRACE_S, SqlLimitExceeded, SqlLimits
from .schema import TABLES, VIEWS, view_sql

if TYPE_CHECKING:
    from .store import Ledger

EXTENSIONS = {"sqlite": "sqlite", "postgresql": "postgres_scanner"}
# Table functions a read-only query may use: they compute, they read no file or database.
SAFE_TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "json_each", "json_tree",
    "duckdb_tables", "duckdb_views", "duckdb_columns", "duckdb_schemas", "duckdb_constraints",
})
FETCH_VECTORS = 50  # rows are fetched ~100k at a time, each chunk counted against the memory limit
_installed: set[str] = set()
_install_lock = threading.Lock()
_local = threading.local()


class SqlRefused(OrbitError):
    """A query the read-only SQL face does not run."""


def _load(con: duckdb.DuckDBPyConnection, dialect: str, fallback_dir: Path | None = None) -> None:
    """Install (once per process) and load the extension that reads the store. It comes from
    the PyPI wheel (duckdb-extension-*), into DuckDB's own extension directory where a
    person's `duckdb` finds it too; with no usable home directory, into `fallback_dir`."""
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
    """Every ledger table and view under its own name in the connection's default schema, and the
    face's own analytic views (`efficiency.py`)."""
    for name in TABLES:
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {source.format(table=name)}")
    for name in VIEWS:
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {view_sql(name, 'duckdb')}")
    for name, body in FACE_VIEWS.items():  # DuckDB's own: analysis over the views above (efficiency.py)
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")


def temp_dir(ledger: "Ledger") -> Path:
    """Where DuckDB spills: the ledger's own `tmp/` (DuckDB's default is `.tmp` in the caller's
    working directory)."""
    if ledger.path is not None:
        base = ledger.path.parent
    elif ledger.home is not None:
        base = Path(ledger.home) / "ledger"
    else:
        base = Path(tempfile.gettempdir()) / f"orbit-ledger-{os.getuid()}"
    return base / "tmp"


def locked_connection(ledger: "Ledger", limits: SqlLimits | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection over the ledger that can read it and nothing else, within `limits`."""
    limits = limits or ledger.sql_limits or SqlLimits()
    spill = temp_dir(ledger)
    spill.mkdir(parents=True, exist_ok=True, mode=0o700)
    con = duckdb.connect(":memory:")
    attach_store(con, ledger)
    define_views(con)
    for statement in limits.settings_sql(spill):  # before the lock: no query can change them
        con.execute(statement)
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _connection(ledger: "Ledger", limits: SqlLimits) -> duckdb.DuckDBPyConnection:
    # One per thread, ledger and limits: DuckDB connections are not shared across threads.
    cache = getattr(_local, "cons", None)
    if cache is None:
        cache = _local.cons = {}
    key = (ledger.url, limits.connection_key)
    con = cache.get(key)
    if con is None:
        con = cache[key] = locked_connection(ledger, limits)
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
    except duckdb.InterruptException:
        raise  # the timeout, not a parse error
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


def _run(con: duckdb.DuckDBPyConnection, sql: str, limits: SqlLimits, spill: Path):
    """Check and run one query within the limits; a DataFrame, or the OrbitError naming why not."""
    if isinstance(sql, str) and len(sql) > limits.max_query_chars:
        raise limits.query_too_long(len(sql))
    done = threading.Event()
    watchdog = threading.Thread(target=_interrupt_after, args=(con, limits.timeout_s, done), daemon=True,
                                name="orbit-sql-timeout")
    watchdog.start()
    try:
        check_read_only(con, sql)
        return _fetch(con, sql, limits)
    except duckdb.InterruptException:
        raise limits.timed_out() from None
    except duckdb.OutOfMemoryException as exc:
        if "temp" in str(exc).lower():  # max_temp_directory_size reached
            raise limits.spill_too_large(spill) from None
        raise limits.out_of_memory() from None
    except duckdb.Error as exc:
        raise OrbitError(f"query failed: {str(exc).splitlines()[0][:300]}", field="QUERY", value=sql[:200],
                         fix="list tables and views with: SELECT table_name FROM information_schema.tables") from None
    finally:
        done.set()


def _interrupt_after(con: duckdb.DuckDBPyConnection, seconds: float, done: threading.Event) -> None:
    """DuckDB has no statement timeout: interrupt the connection at the deadline, and again
    every 0.1 s until the query ends (an interrupt that lands between two statements, before
    the query has started, is lost)."""
    if done.wait(seconds):
        return
    while not done.is_set():
        con.interrupt()
        done.wait(0.1)


def _fetch(con: duckdb.DuckDBPyConnection, sql: str, limits: SqlLimits):
    """The result in chunks, each counted: a result larger than the memory limit is refused
    before it is all fetched (`.df()` would build it whole, outside DuckDB's memory limit)."""
    con.execute(sql)
    frames, size = [], 0
    while True:
        chunk = con.fetch_df_chunk(FETCH_VECTORS)
        if frames and chunk.empty:
            break
        size += int(chunk.memory_usage(index=False, deep=True).sum())
        if size > limits.result_bytes:
            raise limits.result_too_large(size)
        frames.append(chunk)
        if chunk.empty:
            break
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def _serve(url: str, home: str | None, limits: SqlLimits, pipe) -> None:
    """The worker process: one locked DuckDB connection, one query at a time from the pipe."""
    # A parent started with SIGTERM ignored (a background job, a supervisor) passes that on;
    # its exit then terminates this daemonic child with SIGTERM and waits for it: it must die.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    ledger = Database(url, home=Path(home) if home else None)
    write_people_catalog(ledger)
    con = locked_connection(ledger, limits)
    spill = temp_dir(ledger)
    ledger.dispose()  # this process keeps no sqlite3 connection to the store
    pipe.send(("ready", None))
    while True:
        try:
            sql, query_limits = pipe.recv()
        except EOFError:
            return
        try:
            pipe.send(("ok", _run(con, sql, query_limits, spill)))
        except OrbitError as exc:
            pipe.send(("refused", (type(exc).__name__, str(exc), exc.field, exc.value, exc.fix)))
        except Exception as exc:  # noqa: BLE001 - reported to the asking process, which raises it
            pipe.send(("error", f"{type(exc).__name__}: {str(exc)[:300]}"))


_ERRORS = {cls.__name__: cls for cls in (SqlRefused, SqlLimitExceeded, OrbitError)}
_START_TIMEOUT_S = 300.0  # a fresh interpreter importing DuckDB and pandas on a loaded machine


class _Worker:
    """A DuckDB process for one SQLite ledger (and one memory and spill limit), started on first
    use, reused by the next queries; killed when a query outlives its timeout, and started
    afresh by the next query."""

    _workers: dict[tuple, "_Worker"] = {}
    _lock = threading.Lock()

    def __init__(self, ledger: "Ledger", limits: SqlLimits):
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this process's SQLite in it
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(ledger.url, str(ledger.home) if ledger.home else None, limits,
                                                     child), daemon=True, name="orbit-ledger-face")
        self.proc.start()
        child.close()
        self._call_lock = threading.Lock()
        try:
            kind = self.pipe.recv()[0] if self.pipe.poll(_START_TIMEOUT_S) else "silent"
        except EOFError:
            kind = "ended"
        if kind != "ready":
            self.kill()
            raise OrbitError(f"the ledger's SQL face did not start (its process {kind}, exit code "
                             f"{self.proc.exitcode})", fix="see the error above; the store is untouched")

    @classmethod
    def for_ledger(cls, ledger: "Ledger", limits: SqlLimits) -> "_Worker":
        key = (os.getpid(), ledger.url, limits.connection_key)
        with cls._lock:
            worker = cls._workers.get(key)
            if worker is None or not worker.proc.is_alive():
                worker = cls._workers[key] = cls(ledger, limits)
            return worker

    def kill(self) -> None:
        """End the process now (a query that ignores the interrupt, a caller interrupted)."""
        self.proc.kill()
        self.proc.join(10)
        self.pipe.close()

    def query(self, sql: str, limits: SqlLimits):
        with self._call_lock:
            try:
                self.pipe.send((sql, limits))
                # The worker interrupts the query at the timeout; this waits a little longer.
                if not self.pipe.poll(limits.timeout_s + KILL_GRACE_S):
                    self.kill()
                    raise limits.timed_out()
                kind, payload = self.pipe.recv()
            except EOFError:
                self.kill()
                raise OrbitError(f"the ledger's SQL face ended while it ran the query (exit code {self.proc.exitcode}: "
                                 "killed, perhaps for memory)", field="ORBIT_SQL_MEMORY", value=limits.memory_bytes,
                                 fix="run it again (a new face starts); if it ends again, narrow the query or lower "
                                     "ORBIT_SQL_MEMORY to what this machine can give") from None
            except BaseException:  # interrupted while waiting: a later reply must not answer the next query
                if self.proc.is_alive():
                    self.kill()
                raise
        if kind == "ok":
            return payload
        if kind == "refused":
            name, message, field, value, fix = payload
            error = _ERRORS.get(name, OrbitError)
            exc = error.__new__(error)
            Exception.__init__(exc, message)
            exc.field, exc.value, exc.fix = field, value, fix
            raise exc
        raise OrbitError(f"the ledger's SQL face failed: {payload}", fix="see the message; the store is untouched")


def face_query(ledger: "Ledger", sql: str, limits: SqlLimits | None = None):
    """Run one read-only SELECT through the face within `limits` (default: the ledger's, which
    `Settings.ledger()` sets from ORBIT_SQL_*, see `limits.py`); a pandas DataFrame, or an
    OrbitError naming the limit or the refusal."""
    limits = limits or ledger.sql_limits or SqlLimits()
    if isinstance(sql, str) and len(sql) > limits.max_query_chars:  # not even sent to the worker
        raise limits.query_too_long(len(sql))
    if ledger.dialect == "sqlite":
        return _Worker.for_ledger(ledger, limits).query(sql, limits)
    return _run(_connection(ledger, limits), sql, limits, temp_dir(ledger))


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
