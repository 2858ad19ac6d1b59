"""The control plane's processes as a hostile operator finds them: by /proc, under one home.

Every process of ours that serves a home carries `ORBIT_HOME=<home>` in its environment (the
supervisor passes it to the daemon, the code server and the run workers). Rented hosts (sim
hosts and the agents they run) are the execution plane: killing them is a reclaim, not a
control-plane death, so they are listed apart.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import parse_checkpoint_dir

HOST_MARKS = (b"orbit_dagster.providers.sim.host", b"orbit_dagster.runtime.agent")


@dataclass(frozen=True)
class Proc:
    pid: int
    pgid: int
    cmdline: str

    @property
    def kind(self) -> str:
        c = self.cmdline
        if "orbit-reference-" in c:
            return "reference"  # the test's own uninterrupted run (demo.ReferenceRun), outside the market
        if "orbit_dagster.providers.sim.host" in c:
            return "host"
        if "orbit_dagster.runtime.agent" in c:
            return "agent"
        if "multiprocessing.spawn" in c and "spawn_main" in c:
            return "run_worker"
        if "dagster-daemon" in c or "dagster_daemon" in c:
            return "daemon"
        if "api grpc" in c or "code-server" in c or "code_server" in c:
            return "code_server"
        if "orbit_dagster.cli" in c and " daemon" in c:
            return "supervisor"
        return "other"


def processes_of(home: Path) -> list[Proc]:
    """Every live process whose environment names this home (zombies excluded)."""
    token = f"ORBIT_HOME={home}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            if token not in environ:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out.append(Proc(int(entry.name), os.getpgid(int(entry.name)), cmd))
        except (OSError, ProcessLookupError, IndexError):
            continue
    return out


def control_plane(home: Path) -> list[Proc]:
    return [p for p in processes_of(home) if p.kind not in ("host", "agent", "reference")]


def sigkill(procs: list[Proc], home: Path, *, groups: bool = True) -> list[int]:
    """SIGKILL each process (and, with `groups`, its process group unless a host leads it)."""
    host_groups = {p.pgid for p in processes_of(home) if p.kind in ("host", "agent")}
    killed = []
    for p in procs:
        try:
            if groups and p.pgid not in host_groups and p.pgid != os.getpgid(0):
                os.killpg(p.pgid, signal.SIGKILL)
            else:
                os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)
        except ProcessLookupError:
            continue
    return killed


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
            return
        time.sleep(0.1)
    raise AssertionError(f"processes {pids} outlived SIGKILL")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def checkpoints_on_disk(settings: Settings, job_id: str) -> set[str]:
    """The keys of the complete checkpoints the store holds for a job (what a host wrote)."""
    store = open_store(settings.store_uri)
    keys = set()
    for uri in store.list(job_id):
        parsed = parse_checkpoint_dir(uri.rstrip("/").rsplit("/", 1)[-1])
        if parsed is not None:
            keys.add(R.checkpoint_key(job_id, parsed[1], parsed[0]))
    return keys


def bill_of(ledger, job_id: str) -> tuple[float, float]:
    """(attributed, billed) in USD for a job's instances."""
    attributed = ledger.scalar("SELECT coalesce(sum(usd), 0) FROM costs WHERE job_id = ?", [job_id])
    billed = ledger.scalar("SELECT coalesce(sum(billed_usd), 0) FROM instances WHERE job_id = ?", [job_id])
    return float(attributed), float(billed)


def materializations(instance, asset: str) -> dict[str, int]:
    """How many times each partition of `asset` was materialized (reported) in Dagster."""
    import dagster as dg

    counts: dict[str, int] = {}
    cursor = None
    while True:
        result = instance.fetch_materializations(dg.AssetKey(asset), limit=1000, cursor=cursor)
        for record in result.records:
            counts[record.partition_key] = counts.get(record.partition_key, 0) + 1
        if not result.has_more:
            return counts
        cursor = result.cursor
