"""Running `orbit daemon` as a real process in a test, and reading what it left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orbit_dagster.settings import Settings


def start_orbit(args: list[str], out: Path, err: Path, *, env: dict | None = None, preexec=None) -> subprocess.Popen:
    """`orbit ARGS` in a session of its own, its stdout and stderr in files (outside the home)."""
    def own_session() -> None:
        os.setsid()
        if preexec is not None:
            preexec()

    return subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", *args], stdout=open(out, "w"),
                            stderr=open(err, "w"), stdin=subprocess.DEVNULL, env=env, preexec_fn=own_session)


def stop(proc: subprocess.Popen, timeout: float = 90) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def process_table() -> dict[int, tuple[int, str, bytes]]:
    """pid -> (parent pid, state, command line)."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(p.name)] = (int(fields[1]), fields[0], (p / "cmdline").read_bytes().replace(b"\0", b" "))
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for child, (ppid, _, _) in process_table().items():
        children.setdefault(ppid, []).append(child)
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


RENTED = (b"orbit_dagster.providers.sim.host", b"orbit_dagster.runtime.agent")


def ours_alive(pids: set[int], home: Path) -> dict[int, str]:
    """The live ones among `pids`, and any process whose environment names `home`, without the sim
    market's hosts and workloads (rented machines, which outlive the control plane by design)."""
    token = f"ORBIT_HOME={home}\0".encode()
    out = {}
    for pid, (_, state, cmd) in process_table().items():
        if pid == os.getpid() or state in ("Z", "X") or any(r in cmd for r in RENTED):
            continue
        try:
            named = token in Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            named = False
        if pid in pids or named:
            out[pid] = cmd.decode(errors="replace")[:200]
    return out


def code_servers(home: Path) -> list[int]:
    """The code server processes serving `home` (`dagster api grpc`, ours or a daemon's own)."""
    token = f"ORBIT_HOME={home}\0".encode()
    found = []
    for pid, (_, state, cmd) in process_table().items():
        if b"api grpc" not in cmd or state in ("Z", "X"):
            continue
        try:
            if token in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return sorted(found)


def sensor_ticks(settings: Settings, sensor: str = "job_queue_sensor", limit: int = 500) -> list[tuple[float, str]]:
    """(time, status) of the sensor's recorded ticks, oldest first."""
    from dagster._core.scheduler.instigation import InstigatorType

    from orbit_dagster.deploy.instance import dagster_instance

    with dagster_instance(settings) as instance:
        for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
            if state.instigator_name == sensor:
                ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=limit)
                return sorted((t.timestamp, t.status.value) for t in ticks)
    return []


def ticks_after(settings: Settings, since: float) -> int:
    return len([t for t, _ in sensor_ticks(settings) if t > since])


def wait_text(path: Path, text: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in path.read_text():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {text!r}: {path.read_text()[-1500:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {text!r} in {path}: {path.read_text()[-1500:]}")
