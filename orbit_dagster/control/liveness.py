"""Whether the process of a Dagster run still lives: orbit's liveness record of each run worker.

A run follows an attempt (or dispatches it, or evaluates a checkpoint) only while its worker
process lives. Dagster's run record cannot say so: a run whose worker was SIGKILLed, or
whose machine rebooted, stays STARTED for good, and with it its pool slot and the belief
that someone follows its attempt. So every run worker of this code location writes a
record to the ledger when its resources start (`run_workers`: host, boot, pid, the pid's
start time) and a heartbeat every `HEARTBEAT_S` while it works, and marks it ended when it
leaves. A worker is judged:

- on this machine (same host name and boot): by its process, at once: alive while the pid
  exists with the same start time (a reused pid is another process); after a reboot every
  record of the old boot is dead;
- on another machine (a run launcher that runs workers elsewhere): by its heartbeat, dead
  once none came for `timeout_s` (`ORBIT_WORKER_TIMEOUT_S`, 60 s by default).

The run launcher (`deploy/run_launcher.py`) answers Dagster's run-monitoring health check from
these records, so the monitoring daemon fails a dead run (its pool slot is given back); the
sensors count only runs whose worker lives as following their attempts, and reconcile takes
up the rest. Nothing here imports Dagster.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..ledger import Ledger

HEARTBEAT_S = 10.0
DEFAULT_TIMEOUT_S = 60.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_name() -> str:
    return socket.gethostname()


def boot_id() -> str:
    """This boot of this machine (Linux); '' where the kernel does not say."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22); None if it is
    gone or a zombie (a dead worker its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Worker:
    """A run worker's liveness record (a `run_workers` row)."""

    dagster_run_id: str
    host: str
    boot: str
    pid: int
    pid_start: int | None
    heartbeat_at: float
    ended_at: float | None = None

    @classmethod
    def of(cls, row: dict) -> "Worker":
        return cls(row["dagster_run_id"], row["host"] or "", row["boot"] or "", int(row["pid"]),
                   None if row["pid_start"] is None else int(row["pid_start"]), float(row["heartbeat_at"] or 0.0),
                   None if row["ended_at"] is None else float(row["ended_at"]))

    @property
    def here(self) -> bool:
        return self.host == host_name()

    def process_alive(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, now: float | None = None) -> bool:
        """Whether the worker's process still exists (here: by pid; elsewhere: by heartbeat)."""
        if self.here:
            return self.boot == boot_id() and self.pid_start is not None and process_start(self.pid) == self.pid_start
        now = time.time() if now is None else now
        return now - self.heartbeat_at < timeout_s

    def working(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, now: float | None = None) -> bool:
        """Whether it still does the run's work: alive, and it has not left its resources (a
        run that ended its work only finishes; it follows nothing)."""
        return self.ended_at is None and self.process_alive(timeout_s=timeout_s, now=now)

    def why_dead(self) -> str:
        if self.here and self.boot != boot_id():
            return f"its worker (pid {self.pid}) was on an earlier boot of this machine"
        if self.here:
            return f"its worker process (pid {self.pid}) is gone"
        return f"no heartbeat from its worker (pid {self.pid} on {self.host}) for too long"


def workers(ledger: Ledger, dagster_run_ids: list[str]) -> dict[str, Worker]:
    """The liveness records of these runs (one query)."""
    ids = sorted(set(dagster_run_ids))
    if not ids:
        return {}
    found: dict[str, Worker] = {}
    for i in range(0, len(ids), 500):  # SQLite's parameter limit
        chunk = ids[i:i + 500]
        marks = ", ".join("?" for _ in chunk)
        for row in ledger.rows(f"SELECT * FROM run_workers WHERE dagster_run_id IN ({marks})", chunk):
            found[row["dagster_run_id"]] = Worker.of(row)
    return found


def pid_alive_here(pid: int) -> bool:
    """Whether `pid` is a live process on this machine (a fallback for runs with no record)."""
    return process_start(pid) is not None


class Heartbeat:
    """The record of this process as the worker of `dagster_run_id`, kept fresh while it lives.

    A heartbeat the ledger refuses (a full disk, a restarting PostgreSQL) is retried at the
    next beat; on this machine the process itself is the proof of life, so a missed beat
    never makes a live worker look dead here."""

    def __init__(self, ledger: Ledger, dagster_run_id: str, *, every_s: float = HEARTBEAT_S):
        self.ledger, self.run_id, self.every_s = ledger, dagster_run_id, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def start(self) -> "Heartbeat":
        now = time.time()
        pid = os.getpid()
        with self.ledger.write() as tx:
            # A run resumed in a new worker (Dagster's run retries make a new run; a resume
            # keeps the id) takes the record over.
            tx.execute("DELETE FROM run_workers WHERE dagster_run_id = ?", [self.run_id])
            tx.insert("run_workers", [{"dagster_run_id": self.run_id, "host": host_name(), "boot": boot_id(),
                                       "pid": pid, "pid_start": process_start(pid), "started_at": now,
                                       "heartbeat_at": now, "ended_at": None}])
        self._thread = threading.Thread(target=self._beat, name="orbit-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                with self.ledger.write() as tx:
                    tx.execute("UPDATE run_workers SET heartbeat_at = ? WHERE dagster_run_id = ?",
                               [time.time(), self.run_id])
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried; the run goes on
                self.failures += 1
                if self.failures == 1:
                    print(f"orbit: heartbeat of run {self.run_id} not written ({type(exc).__name__}); "
                          "retrying every beat", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 5)
        try:
            with self.ledger.write() as tx:
                tx.execute("UPDATE run_workers SET ended_at = ? WHERE dagster_run_id = ?", [time.time(), self.run_id])
        except Exception:  # noqa: BLE001 - the process ends next: its pid is then the proof
            pass


@contextmanager
def heartbeat(ledger: Ledger, dagster_run_id: str) -> Iterator[Heartbeat]:
    beat = Heartbeat(ledger, dagster_run_id).start()
    try:
        yield beat
    finally:
        beat.stop()
