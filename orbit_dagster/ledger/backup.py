"""`orbit ledger backup [DEST]`: a consistent copy of a SQLite ledger, taken while it is in use.

SQLite's online backup API (`sqlite3.Connection.backup`) copies every page in one step
under one read transaction: in WAL mode writers go on meanwhile, and the copy holds
exactly the transactions committed before it began. The copy is written under a temporary
name, switched to a single-file journal (no `-wal` to carry along), checked with `PRAGMA
integrity_check`, flushed to disk and only then given its name; an existing file is never
overwritten. It keeps the ledger's id, so a home takes it back as its own ledger.

A team's PostgreSQL ledger is PostgreSQL's to copy: the refusal gives the `pg_dump` command.
"""
from __future__ import annotations

import os
import sqlite3
import uuid
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa

from .errors import RECOVERY_DOC, LedgerError
from .health import fsync_dir
from .store import SQLITE_BUSY_TIMEOUT_S


def pg_dump_command(url: str) -> str:
    u = sa.engine.make_url(url)
    target = f"postgresql://{u.username + '@' if u.username else ''}{u.host or 'localhost'}:{u.port or 5432}/{u.database}"
    return f"pg_dump --format=custom --file=orbit-ledger-$(date -u +%Y%m%dT%H%M%SZ).dump '{target}'"


def refuse_postgres(url: str) -> LedgerError:
    return LedgerError(
        f"the ledger is the team's PostgreSQL database ({sa.engine.make_url(url).render_as_string(hide_password=True)}); "
        "orbit ledger backup copies a SQLite ledger only", field="ORBIT_LEDGER_URL", value=url,
        fix=f"back it up with PostgreSQL's own tool: {pg_dump_command(url)} (the password from PGPASSWORD or "
            f"~/.pgpass; restoring: {RECOVERY_DOC})")


def default_destination(home: Path) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(home) / "backups" / f"ledger-{stamp}.sqlite"


def backup(source: Path, dest: Path) -> dict:
    """Copy the SQLite ledger at `source` to `dest` (a file that must not exist, or a directory
    to put `ledger-<UTC time>.sqlite` in). Returns {path, bytes, pages, ledger_id}."""
    dest = Path(dest).expanduser()
    if dest.is_dir():
        dest = dest / default_destination(dest).name
    if dest.exists():
        raise LedgerError(f"{dest} already exists; a backup never overwrites a file", field="DEST", value=str(dest),
                          fix="give a new file name or a directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    src = sqlite3.connect(str(source), timeout=SQLITE_BUSY_TIMEOUT_S)
    try:
        out = sqlite3.connect(str(tmp))
        try:
            src.backup(out, pages=-1)  # all pages in one step: one snapshot
            out.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
            check = out.execute("PRAGMA integrity_check").fetchone()[0]
            if check != "ok":
                raise LedgerError(f"the copy of {source} does not pass SQLite's integrity check ({check[:200]})",
                                  field="ledger", value=str(source), fix="the ledger itself may be damaged: run "
                                                                         "`orbit ledger check`")
            ledger_id = out.execute("SELECT ledger_id FROM ledger_identity LIMIT 1").fetchone()
            pages = out.execute("PRAGMA page_count").fetchone()[0]
        finally:
            out.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.link(tmp, dest)  # fails rather than overwrite a file that appeared meanwhile
        fsync_dir(dest.parent)
    except FileExistsError:
        raise LedgerError(f"{dest} already exists; a backup never overwrites a file", field="DEST", value=str(dest),
                          fix="give a new file name or a directory") from None
    finally:
        src.close()
        for suffix in ("", "-journal", "-wal", "-shm"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    return {"path": str(dest), "bytes": dest.stat().st_size, "pages": pages,
            "ledger_id": ledger_id[0] if ledger_id else None}
