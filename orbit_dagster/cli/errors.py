"""What the `orbit` CLI says about a failure that is not an OrbitError: one line and an exit code.

- a pydantic ValidationError: the field, the value and what it takes (exit 2);
- a NUL byte in a path or name given on the command line (which every OS call refuses):
  the argument that holds it (exit 2);
- a full, over-quota, read-only or forbidden disk, or any other OSError: the path and the
  fix (exit 2). SQLite and DuckDB report a full disk in words rather than as an OSError;
  those words are recognised too;
- SQLite's words for a damaged database ("database disk image is malformed", "file is not
  a database") that reach here unwrapped (the ledger's own engine already turns them into
  `LedgerDamaged`): when the ledger is what is damaged, the ledger's line (exit 2);
- anything else is a defect of ours: `internal error (<Type>): <msg>; details in <log>`
  (exit 1), the traceback appended to `$ORBIT_HOME/logs/cli-errors.log` when the disk allows.
"""
from __future__ import annotations

import errno
import os
import traceback
from datetime import datetime, timezone
from pathlib import Path

from ..core.config_schema import show

LOG_NAME = "cli-errors.log"
_MAX_MESSAGE = 300

# Phrases of the C library's strerror and of SQLite/DuckDB messages -> the errno they mean.
_PHRASES = (
    ("no space left on device", errno.ENOSPC),
    ("database or disk is full", errno.ENOSPC),
    ("disk quota exceeded", errno.EDQUOT),
    ("read-only file system", errno.EROFS),
    ("readonly database", errno.EROFS),
    ("permission denied", errno.EACCES),
    # SQLite in WAL mode reports a full disk as an I/O error when it cannot grow its log.
    ("disk i/o error", errno.EIO),
)

_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)

_FIXES = {
    errno.ENOSPC: "free space on the disk that holds it (or set ORBIT_HOME to a directory on another disk), "
                  "then run the command again",
    errno.EDQUOT: "free space within your disk quota (or ask for a larger one, or set ORBIT_HOME elsewhere), "
                  "then run the command again",
    errno.EROFS: "the file system is read-only: set ORBIT_HOME to a writable directory",
    errno.EIO: "the disk refused a write (full, or failing): free space or check the disk, then run the command "
               "again; the ledger rolled the change back",
    errno.EACCES: "give this user read and write access to it, or set ORBIT_HOME to a directory you own",
    errno.EPERM: "give this user read and write access to it, or set ORBIT_HOME to a directory you own",
    errno.ENOENT: "check the path: it does not exist",
    errno.ENAMETOOLONG: "use a shorter path",
}


def orbit_home() -> Path:
    from ..settings import home_dir

    return home_dir()


def describe_failure(exc: BaseException, argv: list[str]) -> tuple[str, int]:
    """(one line for stderr, exit code)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return validation_line(exc), 2
    damaged = ledger_damage_line(exc)
    if damaged is not None:
        return damaged, 2
    if _nul_in_input(exc):
        return nul_line(argv), 2
    disk = disk_error(exc)
    if disk is not None:
        code, path = disk
        return os_error_line(code, path, exc), 2
    return internal_error_line(exc, argv), 1


def _nul_in_input(exc: BaseException) -> bool:
    """A NUL byte in a path or name a person gave (Python refuses it in every OS call)."""
    return isinstance(exc, ValueError) and "null byte" in str(exc)


def nul_line(argv: list[str]) -> str:
    """The argument that holds the NUL, named by its option (or its place) when it is one of argv."""
    for i, arg in enumerate(argv):
        if "\0" in arg:
            before = argv[i - 1] if i and argv[i - 1].startswith("-") else None
            field = before or f"argument {i}"
            return f"error: {field} {show(arg)} holds a NUL byte; fix: give the path or name without it"
    return "error: a path or name holds a NUL byte; fix: give it without one"


def validation_line(exc) -> str:
    err = exc.errors(include_url=False)[0]
    field = ".".join(str(p) for p in err["loc"]) or exc.title
    msg = err["msg"].removeprefix("Value error, ")
    value = "" if err["type"] == "missing" else f" (value: {show(err.get('input'))})"
    return f"error: invalid {exc.title} field {field!r}: {msg}{value}; fix: correct {field}"


def ledger_damage_line(exc: BaseException) -> str | None:
    """The ledger's one line when `exc` is SQLite reporting damage and the ledger is damaged.

    Another SQLite file (Dagster's own storage) may be the damaged one: the ledger is then
    checked (`quick_check`, on this error path only) and named only if it fails."""
    from ..ledger.health import is_corruption

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and not is_corruption(str(current)):
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    if current is None or id(current) in seen:
        return None
    try:
        from ..ledger import Ledger
        from ..ledger.identity import inspect
        from ..settings import Settings

        settings = Settings.from_env()
        ledger = Ledger(settings.ledger_url, home=settings.home)
        try:
            verdict = inspect(ledger, deep=True)
        finally:
            ledger.dispose()
    except Exception:  # noqa: BLE001 - the ledger cannot be judged: the caller's internal-error line
        return None
    return f"error: {verdict.error}" if verdict.state == "damaged" and verdict.error is not None else None


def disk_error(exc: BaseException) -> tuple[int, str] | None:
    """(errno, path) when the failure, or one it was raised from, is a file system's refusal."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            # A copy names (source, destination); the disk that refused is the destination's.
            path = current.filename2 if current.errno in _WRITE_ERRORS and current.filename2 else current.filename
            return current.errno, str(path if path is not None else orbit_home())
        text = str(current).lower()
        for phrase, code in _PHRASES:
            if phrase in text:
                if code == errno.EIO and _free_bytes(orbit_home()) < (1 << 20):
                    code = errno.ENOSPC  # the I/O error of a disk with no space left
                return code, str(orbit_home())
        current = current.__cause__ or current.__context__
    return None


def _free_bytes(path: Path) -> int:
    import shutil

    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return 1 << 62


def os_error_line(code: int, path: str, exc: BaseException) -> str:
    reason = os.strerror(code) if code else type(exc).__name__
    fix = _FIXES.get(code, "check the path and try again")
    shown = path if len(path) <= _MAX_MESSAGE and path.isprintable() else show(path)
    return f"error: {reason}: {shown}; fix: {fix}"


def internal_error_line(exc: BaseException, argv: list[str]) -> str:
    message = " ".join(str(exc).split())[:_MAX_MESSAGE] or "(no message)"
    log = orbit_home() / "logs" / LOG_NAME
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as fh:
            # The command name only: its arguments may hold values a person would not want logged.
            command = argv[0] if argv and not argv[0].startswith("-") else "(none)"
            fh.write(f"--- {datetime.now(timezone.utc).isoformat()} orbit {command}\n")
            fh.write("".join(traceback.format_exception(exc)))
        where = f"details in {log}"
    except OSError as err:
        where = f"the details could not be written to {log} ({err.strerror or err})"
    return f"internal error ({type(exc).__name__}): {message}; {where}"
