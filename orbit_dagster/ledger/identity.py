"""Which ledger a home uses, so a swapped, reset or lost one is refused rather than replaced.

Every ledger holds its id (a uuid, table `ledger_identity`, migration 5), and every home
records the ids of the ledgers it uses in `$ORBIT_HOME/ledger-identity.json`, one entry per
ledger location (`sqlite:ledger/ledger.sqlite` relative to the home, or an absolute path;
`postgresql://HOST:PORT/DB` for a team), written atomically. Opening a ledger (`admit`):

| the home's record | the ledger | outcome |
|---|---|---|
| names ledger A here | holds id A | opened |
| names ledger A here | holds id B, or no id | refused, naming both (swapped or replaced) |
| names ledger A here | missing (file, or PostgreSQL database without a ledger in it) | refused (never re-created) |
| no entry here | holds an id (or no id yet: an older ledger, given one by migration 5) | adopted: the entry is written |
| no entry here, no record file at all | missing, and the home holds bundles or checkpoints | refused: their ledger was lost |
| no entry here | missing, nothing of a ledger's in the home (or other ledgers recorded) | created, and recorded |
| any | a SQLite file that is empty, cut short, not SQLite, or without ledger tables | refused (`health.py`) |

A team's PostgreSQL ledger keeps its id in its own database, so every machine's home that
shares it records the same id. A home may record several ledgers (the `embedded` and the
`team` profile). `orbit ledger repair` is the way past a refusal (`accept=True`).
"""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa

from .errors import RECOVERY_DOC, LedgerDamaged, LedgerError, LedgerIdentityError, damaged
from .health import fsync_dir, probe
from .migrations import LATEST, refuse_legacy_home, upgrade_schema
from .postgres import ensure_database, unreachable

RECORD = "ledger-identity.json"
# What in a home only a ledger's jobs put there (the settings, orbit_dagster/settings/, name the layout).
HOME_DATA = ("bundles", "checkpoints")
NO_DATABASE = "3D000"


def record_path(home: Path) -> Path:
    return Path(home) / RECORD


def location(ledger, home: Path | None = None) -> str:
    """The key of a ledger in a home's record: where it is, without user or password."""
    if ledger.path is not None:
        home = Path(home or ledger.home).resolve() if (home or ledger.home) else None
        if home is not None and ledger.path.is_relative_to(home):
            return f"sqlite:{ledger.path.relative_to(home)}"
        return f"sqlite:{ledger.path}"
    u = sa.engine.make_url(ledger.url)
    return f"postgresql://{u.host or ''}:{u.port or 5432}/{u.database or ''}"


def read_record(home: Path) -> dict[str, dict] | None:
    """The home's entries (location -> {ledger_id, recorded_at, ...}); None when it has no record."""
    path = record_path(home)
    try:
        data = json.loads(path.read_text())
        entries = data["ledgers"]
        if not isinstance(entries, dict) or not all(isinstance(e, dict) and e.get("ledger_id")
                                                    for e in entries.values()):
            raise ValueError("its 'ledgers' are not {location: {ledger_id: ...}}")
        return entries
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LedgerIdentityError(
            f"this home's ledger record {path} is not readable ({type(exc).__name__}: {str(exc)[:120]})",
            field="ORBIT_HOME", value=str(path),
            fix="move it aside; orbit then takes each ledger's id from the ledger itself and writes a new record") from None


@contextmanager
def _record_lock(home: Path) -> Iterator[None]:
    """One writer of the record at a time (read, change, write), across processes."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / f".{RECORD}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remember(home: Path, where: str, ledger_id: str, *, note: str | None = None) -> None:
    """Record `ledger_id` as the home's ledger at `where` (atomically: a temp file renamed into place)."""
    home = Path(home)
    with _record_lock(home):
        entries = read_record(home) or {}
        old = entries.get(where)
        if old and old["ledger_id"] == ledger_id:
            return
        entry = {"ledger_id": ledger_id, "recorded_at": datetime.now(timezone.utc).isoformat()}
        if old:  # what this entry named before, kept for whoever investigates
            entry["replaced"] = [{"ledger_id": old["ledger_id"], "until": entry["recorded_at"],
                                  **({"note": note} if note else {})}] + list(old.get("replaced", []))[:20]
        entries[where] = entry
        path = record_path(home)
        tmp = path.with_name(f".{RECORD}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        body = {"about": "the ledgers this orbit-dagster home uses and their ids; see " + RECOVERY_DOC,
                "ledgers": entries}
        with open(tmp, "w") as fh:
            fh.write(json.dumps(body, indent=2, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(home)


@dataclass(frozen=True)
class Verdict:
    """What opening the ledger would find, decided without writing anything."""

    location: str
    where: str  # the ledger for a person: a path, or a URL without password
    state: str  # ok | unrecorded | new | damaged | missing | swapped | unclaimed
    ledger_id: str | None = None
    recorded_id: str | None = None
    version: int = 0
    problem: str | None = None  # what is wrong, in words (for `orbit ledger check`)
    error: LedgerError | None = None

    @property
    def usable(self) -> bool:
        return self.state in ("ok", "unrecorded", "new")


def _facts(ledger) -> tuple[bool, int, str | None]:
    """(has the ledger's tables, schema version, ledger id): one read transaction."""
    with ledger.read() as tx:
        inspector = sa.inspect(tx.conn)
        if not inspector.has_table("schema_migrations"):
            return False, 0, None
        version = int(tx.scalar("SELECT coalesce(max(version), 0) FROM schema_migrations") or 0)
        ledger_id = tx.scalar("SELECT ledger_id FROM ledger_identity ORDER BY created_at LIMIT 1") \
            if inspector.has_table("ledger_identity") else None
        return True, version, ledger_id


def _home_data(home: Path) -> int:
    """How many bundles and checkpoint job folders the home holds (temp entries aside)."""
    n = 0
    for name in HOME_DATA:
        try:
            n += sum(1 for p in (home / name).iterdir() if not p.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return n


def _no_database(ledger, exc: BaseException) -> bool:
    """A PostgreSQL refusal that means: no such database (libpq may give no SQLSTATE for it)."""
    name = sa.engine.make_url(ledger.url).database
    return getattr(getattr(exc, "orig", exc), "sqlstate", None) == NO_DATABASE or \
        f'database "{name}" does not exist' in str(exc)


def inspect(ledger, *, home: Path | None = None, deep: bool = False) -> Verdict:
    """The verdict on `ledger` for `home` (default: the ledger's). `deep` (for `orbit ledger
    check`) also runs SQLite's `quick_check` over every page. Raises only for a PostgreSQL
    that cannot be reached."""
    home = Path(home) if home is not None else ledger.home
    where, loc = ledger.display, location(ledger, home)
    record = read_record(home) if home is not None else None
    recorded = (record or {}).get(loc, {}).get("ledger_id")
    base = dict(location=loc, where=where, recorded_id=recorded)
    exists = True
    if ledger.path is not None:
        state = probe(ledger.path)
        if state.damaged:
            return Verdict(**base, state="damaged", problem=state.problem, error=state.error(ledger.path))
        exists = state.exists
    if exists:
        try:
            has_tables, version, ledger_id = _facts(ledger)
            if deep and has_tables and ledger.path is not None:
                _quick_check(ledger)
        except LedgerDamaged as exc:
            return Verdict(**base, state="damaged", problem=getattr(exc, "what", str(exc)), error=exc)
        except sa.exc.OperationalError as exc:
            if ledger.path is not None:
                raise
            if not _no_database(ledger, exc):
                raise unreachable(ledger.url, exc) from None
            exists = False  # a PostgreSQL database that does not exist (yet)
        else:
            if not has_tables:
                if ledger.path is not None:
                    problem = "a SQLite database without the ledger's tables (emptied, or never a ledger)"
                    return Verdict(**base, state="damaged", problem=problem, error=damaged(where, problem))
                exists = False  # a PostgreSQL database without a ledger in it yet
    if not exists:
        return _absent(ledger, home, record, recorded, base)
    base.update(ledger_id=ledger_id, version=version)
    if recorded is None:
        return Verdict(**base, state="unrecorded")
    if ledger_id == recorded:
        return Verdict(**base, state="ok")
    shown = f"ledger {ledger_id}" if ledger_id else "a ledger without an id (an older orbit-dagster's)"
    problem = f"{shown}, not ledger {recorded} that this home recorded"
    fix = (f"put ledger {recorded} back (restore its backup: {RECOVERY_DOC}), or run `orbit ledger repair` to "
           + ("take this database as this home's ledger and re-register this home's bundles and checkpoints in it"
              if ledger.path is None else "set this file aside and rebuild the ledger from this home's bundles "
                                          "and checkpoints"))
    error = LedgerIdentityError(f"the ledger {where} is {problem} in {record_path(home)}: it was swapped or "
                                "replaced, and orbit does not use it", field="ledger", value=where, fix=fix)
    return Verdict(**base, state="swapped", problem=problem, error=error)


def _absent(ledger, home, record, recorded, base) -> Verdict:
    where = base["where"]
    what = "missing" if ledger.path is not None else "not there (no such database, or no ledger in it)"
    fix = (f"restore its backup ({RECOVERY_DOC}), or run `orbit ledger repair` to make a new ledger and re-register "
           "what verifies; `orbit ledger check` names what is on disk")
    if recorded is not None:
        problem = f"{what}, but this home recorded ledger {recorded} there"
        error = LedgerIdentityError(f"the ledger {where} is {problem} ({record_path(home)}); a lost ledger is never "
                                    "re-created silently", field="ledger", value=where, fix=fix)
        return Verdict(**base, state="missing", problem=problem, error=error)
    held = _home_data(home) if home is not None and record is None and ledger.path is not None else 0
    if held:
        problem = f"{what}, and this home holds {held} bundle(s) or checkpoint folder(s) but no record of a ledger"
        error = LedgerIdentityError(f"the ledger {where} is {problem} ({home}): their ledger was lost", field="ledger",
                                    value=where, fix=fix)
        return Verdict(**base, state="unclaimed", problem=problem, error=error)
    return Verdict(**base, state="new")


def _quick_check(ledger) -> None:
    with ledger.read() as tx:
        rows = [r[0] for r in tx.conn.exec_driver_sql("PRAGMA quick_check(5)").fetchall()]
    if rows != ["ok"]:
        raise damaged(ledger.display, "damaged: SQLite's quick_check says " + "; ".join(rows)[:300])


def read_id(ledger) -> str | None:
    return _facts(ledger)[2]


def admit(ledger, *, home: Path | None = None, accept: bool = False, note: str | None = None) -> Verdict:
    """Open-time checks and the ledger's creation: refuse what `inspect` refuses, create a new
    ledger (atomically, `migrations.upgrade_schema`), migrate an older one, record what is adopted.
    `accept` (`orbit ledger repair`): a missing, unclaimed or (PostgreSQL) other ledger is
    taken as the home's from now on; a damaged file is still refused (repair moves it aside).
    `note` goes into the record beside the id an entry named before."""
    refuse_legacy_home(ledger)
    home = Path(home) if home is not None else ledger.home
    verdict = inspect(ledger, home=home)
    if verdict.error is not None and not (accept and verdict.state != "damaged"):
        raise verdict.error
    if ledger.path is None and not verdict.ledger_id:
        ensure_database(ledger.url)  # a team's first use makes the database
    if verdict.version != LATEST or not verdict.ledger_id:
        upgrade_schema(ledger)  # (a ledger at LATEST may still lack a version written in between: upgrade_schema applies it)
    if home is not None and verdict.state != "ok":
        ledger_id = verdict.ledger_id or read_id(ledger)
        if ledger_id is None:
            raise LedgerError(f"the ledger {verdict.where} has no id after migration 5", field="ledger",
                              fix="report this as a defect of orbit-dagster")
        remember(home, verdict.location, ledger_id, note=note)
    return verdict
