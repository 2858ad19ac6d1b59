"""One daemon per Dagster home, and one first initialisation of its storage.

Two `dagster-daemon`s on one instance launch every queued run twice and, on a new SQLite
storage, both stamp Dagster's schema tables ("Version table 'alembic_version' has more
than one head present"), which breaks the storage for good. So:

- `DaemonLock`: an exclusive `flock` on `<Dagster home>/daemon.lock`, taken by `orbit
  daemon` (and `orbit ui` when it starts a daemon) before it touches Dagster's storage,
  and inherited by its `dagster-daemon`, so the lock is held while any of them lives. The
  kernel drops it when the last of them exits, however it ends (SIGKILL included): the
  file's content only names the holder for the refusal, it never decides anything.
- A daemon on another machine sharing the team's PostgreSQL holds no lock here; its
  heartbeats show it (`foreign_heartbeats`). The lock file remembers the heartbeat ids of
  the daemons this home ran, so a daemon of ours that just stopped is not taken for one.
- `storage_initialised`: every process opening the instance while its storage is new (no
  `.storage-ready` marker for the current `dagster.yaml`) does so under a second lock,
  `<Dagster home>/storage.lock`: one creates the tables, the others find them made.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..core.errors import OrbitError

LOCK_NAME = "daemon.lock"
STORAGE_LOCK_NAME = "storage.lock"
READY_NAME = ".storage-ready"
# A live daemon writes a heartbeat every 30 s (Dagster's interval); one older than this has stopped.
HEARTBEAT_LIVE_S = 60.0
# How long a new daemon waits for the processes of one whose supervisor was killed to exit
# (they get SIGTERM from the kernel and stop within Dagster's own shutdown time).
REMNANT_WAIT_S = 40.0
KNOWN_IDS_KEPT = 20
PROBE_WAIT_S = 5.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_holders(path: Path) -> list[int]:
    """Pids on this machine with `path` open (the lock's holders), as far as /proc shows them."""
    target = str(path.resolve())
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == target:
                    pids.append(int(proc.name))
                    break
        except OSError:
            continue
    return sorted(pids)


class DaemonLock:
    """The exclusive lock of one Dagster home's daemon."""

    def __init__(self, dagster_home: Path):
        self.path = Path(dagster_home) / LOCK_NAME
        self.fd: int | None = None
        self.record: dict = {}
        self.orphan_since: float | None = None

    # -- what the file says ------------------------------------------------------------
    def read(self) -> dict:
        try:
            text = self.path.read_text()
            return json.loads(text) if text.strip() else {}
        except (OSError, ValueError):
            return {}

    def known_ids(self) -> set[str]:
        return set(self.read().get("daemon_ids") or [])

    def _write(self, record: dict) -> None:
        assert self.fd is not None
        data = json.dumps(record, sort_keys=True).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    # -- taking it -----------------------------------------------------------------------
    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def acquire(self, what: str, *, wait_s: float = REMNANT_WAIT_S, say=None) -> None:
        """Take the lock for `what` (e.g. "orbit daemon") or raise the one-line refusal naming the holder.

        When the holder named in the file is gone but the lock is still held, its children are
        still stopping (their supervisor was killed): wait for them up to `wait_s`."""
        start = time.time()
        deadline = start + wait_s
        said = False
        while not self.try_acquire():
            holder = self._holder_record()
            pid = holder.get("pid")
            same_host = holder.get("host") == socket.gethostname()
            if not holder.get("pid") and time.time() < start + PROBE_WAIT_S:
                continue  # a process only probing the lock (`holder()`) holds it for a moment
            if pid and same_host and not _pid_alive(int(pid)) and time.time() < deadline:
                if not said and say is not None:
                    say(f"the daemon that held {self.path} (pid {pid}) is gone; waiting for its processes "
                        f"{_lock_holders(self.path) or ''} to exit")
                    said = True
                time.sleep(0.5)
                continue
            raise self.refusal(holder)
        self.claim(what)

    def claim(self, what: str) -> None:
        """Once the lock is ours: name us in the file, keeping the ids of the daemons before us."""
        previous = self.read()
        ids = list(previous.get("daemon_ids") or [])[-KNOWN_IDS_KEPT:]
        # A holder of this machine killed before it noted its daemon's id: heartbeats written
        # since it took the lock are its daemon's (any other daemon would have been refused).
        self.orphan_since = None
        if (previous.get("pid") and previous.get("host") == socket.gethostname() and not previous.get("noted")
                and not _pid_alive(int(previous["pid"]))):
            self.orphan_since = float(previous.get("since_ts") or 0)
        self.record = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %z"), "since_ts": time.time(), "daemon_ids": ids,
                       "noted": False}
        self._write(self.record)

    def adopt_orphans(self, heartbeats: dict[str, tuple[float, str | None]]) -> None:
        """Count the heartbeats of a killed predecessor's daemon as known (see `claim`)."""
        if self.fd is None or not self.orphan_since:
            return
        now = time.time()
        self.remember({did for age, did in heartbeats.values()
                       if did and now - age >= self.orphan_since - 1}, noted=False)

    def _holder_record(self, patience_s: float = 2.0) -> dict:
        """The holder's record; a holder that has just taken the lock writes it a moment later."""
        deadline = time.time() + patience_s
        record = self.read()
        while not record.get("pid") and time.time() < deadline:
            time.sleep(0.1)
            record = self.read()
        return record

    def refusal(self, holder: dict | None = None) -> OrbitError:
        holder = holder if holder is not None else self._holder_record()
        pid, host = holder.get("pid"), holder.get("host")
        who = f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
        if pid and host == socket.gethostname() and not _pid_alive(int(pid)):
            left = _lock_holders(self.path)
            who = f"pid {pid}, now gone, whose processes {left or '(not visible to this user)'} still hold it"
        elif not pid:
            who = "a process that wrote no record"
            left = _lock_holders(self.path)
            if left:
                who += f" (pids {left})"
        since = holder.get("since")
        return OrbitError(
            f"a daemon already runs for this Dagster home: {holder.get('what', 'orbit daemon')} {who}"
            + (f", since {since}" if since else "") + f" (lock {self.path})",
            field="daemon", value=pid,
            fix=f"use it (orbit ui --no-daemon, orbit submit), or stop it first (kill -TERM {pid or '<pid>'})")

    def holder(self) -> dict | None:
        """The record of the daemon holding the lock now, or None (probes without keeping it)."""
        if self.fd is not None:
            return self.record
        if self.try_acquire():
            self.release()
            return None
        return self._holder_record()

    def remember(self, daemon_ids: set[str], noted: bool = True) -> None:
        """Add the heartbeat ids of our `dagster-daemon` to the record, once seen."""
        if self.fd is None or not daemon_ids - set(self.record["daemon_ids"]):
            return
        self.record["daemon_ids"] = [*self.record["daemon_ids"], *sorted(daemon_ids - set(self.record["daemon_ids"]))]
        self.record["noted"] = self.record.get("noted") or noted
        self._write(self.record)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the flock goes with the last descriptor (ours, our children's)
            self.fd = None


def foreign_heartbeats(heartbeats: dict[str, tuple[float, str | None]], known: set[str]) -> dict[str, tuple[float, str]]:
    """Live heartbeats (age, daemon id) from a daemon this home's lock never ran."""
    return {kind: (age, did) for kind, (age, did) in heartbeats.items()
            if age < HEARTBEAT_LIVE_S and did and did not in known}


def foreign_daemon_refusal(foreign: dict[str, tuple[float, str]], storage: str) -> OrbitError:
    age, did = min(foreign.values())
    return OrbitError(
        f"another Dagster daemon heartbeats to this instance's storage ({storage}): daemon id {did[:8]}, "
        f"last heartbeat {age:.0f} s ago, not one this Dagster home ran (on another machine sharing it, or "
        "started without orbit)", field="daemon", value=did,
        fix=f"use it, or stop it first (one daemon per storage); a daemon that has stopped ages out in "
            f"{HEARTBEAT_LIVE_S:.0f} s")


# -- the storage's first initialisation ------------------------------------------------------

def _config_digest(dagster_home: Path) -> str:
    try:
        return hashlib.sha256((dagster_home / "dagster.yaml").read_bytes()).hexdigest()
    except OSError:
        return ""


@contextmanager
def storage_initialised(dagster_home: Path, timeout_s: float = 300.0) -> Iterator[None]:
    """Run the body (which opens the instance) under the storage lock while the storage is new.

    Once one opening succeeded for this `dagster.yaml`, the marker says so and no lock is taken."""
    dagster_home = Path(dagster_home)
    ready = dagster_home / READY_NAME
    digest = _config_digest(dagster_home)
    try:
        is_ready = bool(digest) and ready.read_text() == digest
    except OSError:
        is_ready = False
    if is_ready:
        yield
        return
    path = dagster_home / STORAGE_LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise OrbitError(f"Dagster's storage is being created by another process (pids "
                                     f"{_lock_holders(path)}) for over {timeout_s:.0f} s", field="storage",
                                     value=str(path), fix="wait for it, or end it if it hangs") from None
                time.sleep(0.1)
        yield
        tmp = ready.with_name(f"{READY_NAME}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, ready)
    finally:
        os.close(fd)
