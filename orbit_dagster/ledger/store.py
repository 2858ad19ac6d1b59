"""The ledger on disk: immutable Parquet commits, read through DuckDB views.

DuckDB allows one read-write process per file, and Dagster runs every run and the daemon
in processes of their own. So no process ever holds a database file for writing: a
writer turns a batch of rows (possibly for several tables) into one commit directory,
written under a temporary name and renamed into place, which is atomic. Readers query
views over `segments/c-*/<table>.parquet`. The file `ledger.duckdb` holds the same views
for people (`duckdb .orbit/ledger/ledger.duckdb`); our processes read through in-memory
connections and never lock it.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.errors import OrbitError
from .schema import TABLES, VIEWS

SCHEMA_COMMIT = "c-0000000000000000000-schema"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class LedgerError(OrbitError):
    pass


class Ledger:
    """Append-only, multi-process-safe ledger rooted at a directory."""

    _open: dict[tuple[int, Path], "Ledger"] = {}

    @classmethod
    def open(cls, root: Path | str) -> "Ledger":
        """The ledger at `root`, initialised, shared within this process (its per-thread
        connections, whose views cost ~10x a query to define, are then reused)."""
        key = (os.getpid(), Path(root).expanduser().resolve())
        if key not in cls._open:
            cls._open[key] = cls(key[1]).init()
        return cls._open[key]

    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()
        self.segments = self.root / "segments"
        self.catalog_path = self.root / "ledger.duckdb"
        self._ready = False
        self._local = threading.local()

    # ---- set-up -------------------------------------------------------------------
    def init(self) -> "Ledger":
        """Create the directory, the empty schema commit and the catalog file (idempotent)."""
        if self._ready:
            return self
        self.segments.mkdir(parents=True, exist_ok=True)
        schema_dir = self.segments / SCHEMA_COMMIT
        missing = [t for t in TABLES.values() if not (schema_dir / f"{t.name}.parquet").exists()]
        if missing:
            # The schema commit gives every table at least one (empty) file, so a view over a
            # table nobody wrote yet is empty rather than an error. New tables in a later
            # version are added to it; Parquet files are only ever added.
            with self._lock("schema"):
                schema_dir.mkdir(exist_ok=True)
                for t in missing:
                    self._write_parquet(schema_dir / f"{t.name}.parquet", pa.Table.from_pylist([], schema=t.schema))
        self._refresh_catalog()
        self._ready = True
        return self

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive lock across processes of this machine (check-then-write sections)."""
        with self._lock(name):
            yield

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        lock_dir = self.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{name}.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _refresh_catalog(self) -> None:
        """(Re)create the views in ledger.duckdb for people; skipped while someone holds it open."""
        stamp = self.root / ".catalog-version"
        want = json.dumps({"root": str(self.root), "tables": sorted(TABLES), "views": VIEWS}, sort_keys=True)
        if self.catalog_path.exists() and stamp.exists() and stamp.read_text() == want:
            return
        with self._lock("catalog"):
            try:
                con = duckdb.connect(str(self.catalog_path))
            except duckdb.IOException:
                return  # a person has it open; the views there are still valid for them
            try:
                self._create_views(con)
            finally:
                con.close()
            stamp.write_text(want)

    def _create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        for t in TABLES.values():
            glob = str(self.segments / "c-*" / f"{t.name}.parquet").replace("'", "''")
            cols = ", ".join(name for name, _ in t.columns)
            key = ", ".join(t.key)
            direction = "ASC" if t.keep == "first" else "DESC"
            con.execute(
                f"""CREATE OR REPLACE VIEW {t.name} AS
                SELECT {cols}, _commit FROM (
                    SELECT * EXCLUDE (filename), filename AS _commit
                    FROM read_parquet('{glob}', union_by_name = true, filename = true)
                ) QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY _commit {direction}) = 1"""
            )
        for name, sql in VIEWS.items():
            con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")

    # ---- writing ------------------------------------------------------------------
    @staticmethod
    def _write_parquet(path: Path, table: pa.Table) -> None:
        pq.write_table(table, path, compression="zstd")

    def commit(self, rows: dict[str, list[dict[str, Any]]]) -> str | None:
        """Write rows for one or more tables atomically; returns the commit name."""
        self.init()
        rows = {name: batch for name, batch in rows.items() if batch}
        if not rows:
            return None
        tables: dict[str, pa.Table] = {}
        for name, batch in rows.items():
            if name not in TABLES:
                raise LedgerError(f"unknown ledger table {name!r}", field="table", value=name, fix=f"use one of {sorted(TABLES)}")
            spec = TABLES[name]
            known = {c for c, _ in spec.columns}
            for row in batch:
                extra = set(row) - known
                if extra:
                    raise LedgerError(f"table {name}: unknown column(s) {sorted(extra)}", field=name, value=sorted(extra))
            tables[name] = pa.Table.from_pylist([{c: row.get(c) for c in known} for row in batch], schema=spec.schema)
        # time_ns first so that commit names sort in write order; pid+uuid keep them unique.
        commit = f"c-{time.time_ns():019d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = self.segments / f"tmp-{commit}"
        tmp.mkdir()
        try:
            for name, table in tables.items():
                self._write_parquet(tmp / f"{name}.parquet", table)
            tmp.rename(self.segments / commit)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return commit

    def append(self, table: str, *rows: dict[str, Any]) -> str | None:
        return self.commit({table: list(rows)})

    # ---- reading ------------------------------------------------------------------
    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """An in-memory DuckDB connection with every table and view defined.

        The views read the Parquet commits at query time, so one connection per thread
        (DuckDB connections are not shared across threads) serves every later query and
        sees every later commit; defining the views costs ~10x a query, so it is kept.
        """
        self.init()
        con = getattr(self._local, "con", None)
        if con is None or getattr(self._local, "pid", None) != os.getpid():
            con = duckdb.connect(":memory:")
            self._create_views(con)
            self._local.con, self._local.pid = con, os.getpid()
        yield con

    def query(self, sql: str, params: list | dict | None = None) -> pd.DataFrame:
        with self.connect() as con:
            return con.execute(sql, params or []).df()

    def rows(self, sql: str, params: list | dict | None = None) -> list[dict[str, Any]]:
        with self.connect() as con:
            cur = con.execute(sql, params or [])
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

    def scalar(self, sql: str, params: list | dict | None = None) -> Any:
        with self.connect() as con:
            row = con.execute(sql, params or []).fetchone()
            return None if row is None else row[0]

    def segment_count(self) -> int:
        return sum(1 for p in self.segments.glob("c-*"))

    # ---- maintenance --------------------------------------------------------------
    def compact(self) -> int:
        """Merge all commits into one, atomically. Returns how many commits were merged.

        Readers glob the commit directories, so between the rename of the merged commit
        and the removal of the old ones a reader could see rows twice; every table view
        keeps one row per key, which makes that window harmless.
        """
        self.init()
        with self._lock("compact"):
            olds = sorted(p for p in self.segments.glob("c-*") if p.name != SCHEMA_COMMIT)
            if len(olds) < 2:
                return 0
            last = olds[-1].name
            merged_name = f"{last}-m"
            tmp = self.segments / f"tmp-{merged_name}"
            tmp.mkdir()
            con = duckdb.connect(":memory:")
            try:
                for t in TABLES.values():
                    files = [str(p / f"{t.name}.parquet") for p in olds if (p / f"{t.name}.parquet").exists()]
                    if not files:
                        continue
                    cols = ", ".join(name for name, _ in t.columns)
                    key = ", ".join(t.key)
                    direction = "ASC" if t.keep == "first" else "DESC"
                    arrow = con.sql(
                        f"""SELECT {cols} FROM (SELECT *, filename AS _c FROM read_parquet(?, union_by_name=true, filename=true))
                        QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY _c {direction}) = 1 ORDER BY _c""",
                        params=[files],
                    ).to_arrow_table()
                    self._write_parquet(tmp / f"{t.name}.parquet", arrow.cast(t.schema))
            finally:
                con.close()
            tmp.rename(self.segments / merged_name)
            for p in olds:
                shutil.rmtree(p, ignore_errors=True)
            return len(olds)
