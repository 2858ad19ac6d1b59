"""Is the SQLite file a whole ledger? A cheap look before SQLite is let near it.

Every CLI call and every Dagster run opens the ledger, so opening checks only what costs a
read of its first 100 bytes and a `stat`: that the file is not empty, is a SQLite database
(its header), and is not shorter than its header says (a copy or a disk cut it). Whether
its schema is there is the next query's business (`identity.py`); a page that is damaged
further in is found by the query that reads it, and SQLite's words for it ("database disk
image is malformed", "file is not a database") become `LedgerDamaged` naming the file
(`store.py`). A full `PRAGMA integrity_check` is `orbit ledger check`'s, not every open's.

Nothing here writes: a damaged ledger is evidence, left byte for byte as it was until
`orbit ledger repair` moves it aside (`move_aside`), never deleted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .errors import LedgerDamaged, damaged

MAGIC = b"SQLite format 3\x00"
HEADER_BYTES = 100

# What SQLite says when a file's pages are not a database (SQLITE_CORRUPT, SQLITE_NOTADB).
CORRUPTION_PHRASES = ("database disk image is malformed", "file is not a database", "malformed database schema",
                      "database corruption")


def is_corruption(message: str) -> bool:
    text = message.lower()
    return any(p in text for p in CORRUPTION_PHRASES)


@dataclass(frozen=True)
class FileState:
    """What the file is, judged from its size and header alone."""

    exists: bool
    size: int = 0
    problem: str | None = None  # None: the file looks whole (or does not exist)

    @property
    def damaged(self) -> bool:
        return self.problem is not None

    def error(self, path: Path) -> LedgerDamaged:
        return damaged(str(path), self.problem or "damaged")


def _page_size(header: bytes) -> int:
    raw = int.from_bytes(header[16:18], "big")
    return 65536 if raw == 1 else raw


def probe(path: Path) -> FileState:
    """The state of the ledger's file: missing, or whole as far as its header tells, or why not."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return FileState(exists=False)
    if size == 0:
        return FileState(True, 0, "empty (0 bytes)")
    with open(path, "rb") as fh:
        header = fh.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return FileState(True, size, f"cut short: {size} bytes, less than a SQLite header")
    if not header.startswith(MAGIC):
        return FileState(True, size, "not a SQLite database (its header is not SQLite's)")
    page = _page_size(header)
    if page < 512 or page & (page - 1):
        return FileState(True, size, f"damaged: its header names a page size of {page} bytes")
    if size % page:
        return FileState(True, size, f"cut short: {size} bytes is not a whole number of {page}-byte pages")
    pages = int.from_bytes(header[28:32], "big")
    # The page count is valid when the change counter matches "version-valid-for" (SQLite's
    # file format, 1.3.8). A crash in the middle of a checkpoint may leave page 1 written
    # before the file grew: the write-ahead log still holds those pages and SQLite finishes
    # the checkpoint, so a file with a log beside it is not judged by its count.
    valid = header[24:28] == header[92:96]
    if valid and pages and size < pages * page and not _has_log(path):
        return FileState(True, size, f"cut short: {size} of the {pages * page} bytes its header says it holds")
    return FileState(True, size)


def _has_log(path: Path) -> bool:
    try:
        return os.stat(f"{path}-wal").st_size > 0
    except FileNotFoundError:
        return False


def move_aside(path: Path) -> Path:
    """Move a damaged or foreign ledger (and its -wal/-shm) into `<dir>/set-aside/<UTC time>/`,
    never deleting it. Returns the new path of the database file."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    dest = path.parent / "set-aside" / stamp
    dest.mkdir(parents=True)
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{path}{suffix}")
        if src.exists():
            os.replace(src, dest / src.name)
    fsync_dir(path.parent)
    return dest / path.name


def fsync_dir(path: Path) -> None:
    """Make a rename or a link in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
