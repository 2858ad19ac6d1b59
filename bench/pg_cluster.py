"""A throwaway PostgreSQL cluster: `initdb` under a temp dir, listening on 127.0.0.1 only, trust
authentication for the `orbit` role, removed when stopped. The benches that measure the
`team` profile (bench/sizing.py) start one; so do the tests (their fixtures: tests/postgres.py).
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def pg_bin() -> Path | None:
    """The directory holding initdb/pg_ctl: PATH first, then Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """One `initdb` cluster. As root, it runs as the `postgres` user (initdb refuses root)."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="orbit-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user = "orbit"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        proc = subprocess.run([*self.as_user, *argv], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")

    def start(self) -> "PostgresCluster":
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user, "-E", "UTF8")
        self._serve()
        return self

    def _serve(self) -> None:
        options = (f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c max_connections=200 "
                   "-c fsync=on -c shared_buffers=64MB")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.data / "log"),
                  "-w", "-t", "60", "start")

    def crash_restart(self) -> None:
        """PostgreSQL killed as a crash would (`-m immediate`: no checkpoint, recovery on start)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self._serve()

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres", driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=self.user, dbname="postgres",
                             autocommit=True) as con:
            con.execute(f'CREATE DATABASE "{name}"')
        return name

    def sql(self, statement: str, database: str = "postgres") -> list[tuple]:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=self.user, dbname=database,
                             autocommit=True) as con:
            cur = con.execute(statement)
            return cur.fetchall() if cur.description else []
