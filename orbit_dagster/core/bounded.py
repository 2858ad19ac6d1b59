"""Reading a file that came from outside without trusting its size, and names without NULs.

A file's size is checked with `stat` before a byte is read, then it is read in chunks that
stop one byte past what is allowed: a file that grows between the two, or a manifest that
declares 1 byte for 2 GB, is refused having read at most the allowance and one chunk. Caps
are tied to this machine's memory (`memory_cap`): a cap written for a large server must not
let a file be read whole into a small one.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import OrbitError

CHUNK = 1 << 20
_FALLBACK_MEMORY = 8 << 30


class TooLarge(OrbitError):
    """A file from outside is larger than what may be read of it."""


def physical_memory() -> int:
    """This machine's memory in bytes (8 GiB where the OS does not say)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_MEMORY
    return total if total > 0 else _FALLBACK_MEMORY


def memory_cap(cap: int, fraction: float) -> int:
    """`cap`, or `fraction` of this machine's memory where that is less."""
    return max(1, min(int(cap), int(physical_memory() * fraction)))


def size_text(n: int) -> str:
    """`1.5 GiB`, `12 KiB`, `7 bytes`."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return "1 byte" if n == 1 else f"{n} bytes"


def exact(n: int) -> str:
    """`1,048,577 bytes (1.0 MiB)`: exact, so two sizes that round alike still differ."""
    return f"{n:,} bytes" + (f" ({size_text(n)})" if n >= 1 << 10 else "") if n != 1 else "1 byte"


def _too_large(what: str, size: int | None, limit: int, *, field: str, fix: str, declared: bool) -> TooLarge:
    allowance = f"its declared {exact(limit)}" if declared else f"the limit of {exact(limit)}"
    if size is None:
        return TooLarge(f"{what} grew past {allowance} while it was read", field=field, value=size, fix=fix)
    return TooLarge(f"{what} is {exact(size)}, more than {allowance}", field=field, value=size, fix=fix)


def check_size(path: Path, cap: int, *, what: str, field: str, fix: str) -> int:
    """The size of `path` from stat, or TooLarge when it exceeds `cap` (nothing read)."""
    size = Path(path).stat().st_size
    if size > cap:
        raise _too_large(what, size, cap, field=field, fix=fix, declared=False)
    return size


def read_bounded(path: Path, cap: int, *, what: str, field: str, fix: str, declared: int | None = None,
                 digest: "hashlib._Hash | None" = None) -> bytes:
    """The bytes of `path`, read in chunks, never more than `cap` + one chunk of them.

    With `declared`, the file must be exactly that long (checked by stat first, then while
    reading: refused at declared + 1 byte); `digest` is fed each chunk as it is read."""
    limit = cap if declared is None else min(int(declared), cap)
    if declared is not None and int(declared) > cap:
        raise _too_large(what, int(declared), cap, field=field, fix=fix, declared=False)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if declared is not None and size != declared:
            if size > declared:
                raise _too_large(what, size, declared, field=field, fix=fix, declared=True)
            raise TooLarge(f"{what} is {exact(size)}, less than its declared {exact(declared)}",
                           field=field, value=size, fix=fix)
        if size > limit:
            raise _too_large(what, size, limit, field=field, fix=fix, declared=False)
        parts, total = [], 0
        while True:
            chunk = fh.read(min(CHUNK, limit + 1 - total))
            if not chunk:
                break
            total += len(chunk)
            if total > limit:  # it grew after the stat
                raise _too_large(what, None, limit, field=field, fix=fix, declared=declared is not None)
            if digest is not None:
                digest.update(chunk)
            parts.append(chunk)
    data = b"".join(parts)
    if declared is not None and len(data) != declared:
        raise TooLarge(f"{what} is {exact(len(data))}, less than its declared {exact(declared)}",
                       field=field, value=len(data), fix=fix)
    return data


def read_text_bounded(path: Path, cap: int, *, what: str, field: str, fix: str) -> str:
    """`read_bounded` decoded as UTF-8; undecodable text is an OrbitError naming the file."""
    data = read_bounded(path, cap, what=what, field=field, fix=fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OrbitError(f"{what} is not UTF-8 text (byte {exc.start})", field=field, fix=fix) from None


def printable_name(value: object) -> bool:
    """A name with no NUL or other control character (what a path, a key or a ledger row can hold)."""
    return isinstance(value, str) and value.isprintable()
