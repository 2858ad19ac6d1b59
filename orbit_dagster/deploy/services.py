"""The long-running processes of an instance: the code server, `dagster-daemon`, `dagster-webserver`.

`orbit daemon`, `orbit ui` and `orbit code-server` (deploy/serve.py) run them under a small
supervisor (`Supervisor`) that
- starts each in a session of its own with SIGINT/SIGTERM at their defaults (a process
  started from a shell's background job inherits them ignored and then cannot be stopped
  politely), and asks the kernel to end it if the supervisor dies;
- starts the code server first and the daemon and webserver only once it answers
  (deploy/code_server.py), and starts the code server again if it dies;
- on SIGTERM or SIGINT, passes SIGTERM to the daemon and webserver, then to the code server,
  waits, and exits 0 (SIGKILL after `STOP_TIMEOUT_S`), so systemd, a terminal's Ctrl-C and
  `kill` all stop everything; then ends whatever is left in the sessions it started (a
  code server's or daemon's own children). It spares run workers (`dagster api
  execute_run` / `resume_run`: they follow trainings and are reconciled on their own) and
  anything that started a session of its own (a sim market's host, a workload), which
  outlives the control plane by design;
- writes their output through deploy/logs.py: no colour codes, no per-tick lines, disk
  errors collapsed to one line a minute.
(`Daemon` and `Webserver`, in deploy/instance.py, start `orbit daemon` / `orbit ui --no-daemon`
in the background, logging to a file.) We run the webserver and the daemon rather than `dagster dev`: they are
what a server runs (docs/deploy.md), and `dagster dev` is a development command that now
points to `dg dev`, a separate package orbit does not need.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from .logs import ANSI, TICK_NOISE, DiskNotices, LogPump, SafeWriter, clean_line, say

# The log helpers are re-exported: the tests and older callers take them from here.
__all__ = ["ANSI", "TICK_NOISE", "Child", "DiskNotices", "LogPump", "SafeWriter", "STOP_TIMEOUT_S", "ServiceFailed",
           "Supervisor", "clean_line", "daemon_argv", "processes", "say", "wait_for_http", "webserver_argv"]

STOP_TIMEOUT_S = 20.0
SWEEP_GRACE_S = 5.0
# Run workers: they follow a training and must outlive a stop of the daemon.
RUN_WORKER = re.compile(r"\bapi (?:execute_run|resume_run)\b")
# A code server that keeps dying is not restarted for ever: the supervisor then stops.
RESTARTS_ALLOWED, RESTART_WINDOW_S = 5, 600.0

def _in_own_session() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    try:  # Linux: end with the supervisor's thread that started it, even if it is killed outright
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exe(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def daemon_argv(workspace: Path) -> list[str]:
    return [_exe("dagster-daemon"), "run", "-w", str(workspace), "--log-level", "info"]


def webserver_argv(workspace: Path, host: str, port: int) -> list[str]:
    return [_exe("dagster-webserver"), "-w", str(workspace), "-h", host, "-p", str(port), "--log-level", "info"]


def processes() -> dict[int, tuple[int, int, str, str]]:
    """Every process: pid -> (parent pid, session id, state, command line)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        out[int(proc.name)] = (int(fields[1]), int(fields[3]), fields[0], cmd)
    return out


def _signal(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Child:
    name: str
    argv: list[str]
    out: IO[str]
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (the daemon lock)
    restart: bool = False  # started again when it dies (the code server)
    prepare: Callable[[], None] | None = None  # before each start (a stale socket removed)
    proc: subprocess.Popen | None = None
    thread: threading.Thread | None = None
    pump: LogPump | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    starts: list[float] = field(default_factory=list)

    def start(self, env: dict[str, str], writer: SafeWriter, notices: DiskNotices | None) -> "Child":
        if self.prepare is not None:
            self.prepare()
        self.proc = subprocess.Popen(self.argv, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=self.pass_fds,
                                     preexec_fn=_in_own_session)
        self.starts.append(time.time())
        self.pump = LogPump(self.name, self.proc.stdout.fileno(), writer, notices, self.stopping)
        self.thread = threading.Thread(target=self.pump.run, daemon=True)
        self.thread.start()
        return self

    @property
    def cut_off(self) -> int:
        return self.pump.cut_off if self.pump else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def members(self) -> list[int]:
        """The live processes of its session, run workers excepted (the leader first)."""
        if self.proc is None:
            return []
        sid = self.proc.pid
        others = [pid for pid, (_, s, state, cmd) in processes().items()
                  if s == sid and pid != sid and state not in "ZX" and not RUN_WORKER.search(cmd)]
        return ([sid] if self.alive() else []) + others

    def terminate(self) -> None:
        self.stopping.set()
        _signal(self.members(), signal.SIGTERM)

    def kill(self) -> None:
        _signal(self.members(), signal.SIGKILL)


class ServiceFailed(Exception):
    """A child ended, or did not answer, before the supervisor could go on."""


class Supervisor:
    """Children started in order, watched, restarted where allowed, and all stopped together."""

    def __init__(self, env: dict[str, str], say: Callable[[str], None], where: str):
        self.env, self.say, self.where = env, say, where
        self.children: list[Child] = []
        self.sessions: set[int] = set()
        self.stopping = threading.Event()
        self.writers: dict[int, tuple[SafeWriter, DiskNotices]] = {}
        self.on_exit: list[Callable[[], None]] = []
        self._old: dict = {}

    def __enter__(self) -> "Supervisor":
        def on_signal(signum, _frame) -> None:
            if not self.stopping.is_set():
                self.say(f"{signal.Signals(signum).name}: stopping "
                         + (", ".join(c.name for c in self.children) or "(nothing started yet)"))
            self.stopping.set()

        self._old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            for s, handler in self._old.items():
                signal.signal(s, handler)
            for fn in self.on_exit:
                fn()

    def _writer(self, out: IO[str]) -> tuple[SafeWriter, DiskNotices]:
        if id(out) not in self.writers:
            writer = SafeWriter(out)
            self.writers[id(out)] = (writer, DiskNotices(self.where, writer.write))
        return self.writers[id(out)]

    def start(self, child: Child) -> Child:
        """Start `child` (from the main thread: the kernel's end-with-parent is per thread)."""
        writer, notices = self._writer(child.out)
        child.start(self.env, writer, notices)
        self.sessions.add(child.proc.pid)
        if child not in self.children:
            self.children.append(child)
        self.say(f"started {child.name} (pid {child.proc.pid})")
        return child

    def wait_until(self, check: Callable[[], bool], what: str, timeout_s: float, child: Child | None = None
                   ) -> float | None:
        """Seconds until `check()` holds; None if a signal asked to stop; ServiceFailed if
        `child` ended or `timeout_s` passed first."""
        start = time.time()
        while not self.stopping.is_set():
            if check():
                return time.time() - start
            if child is not None and not child.alive():
                raise ServiceFailed(f"{child.name} exited with status {child.proc.returncode} before {what}")
            if time.time() - start > timeout_s:
                raise ServiceFailed(f"{what}: not within {timeout_s:.0f} s")
            self.stopping.wait(0.5)
        return None

    def run(self, ready: Callable[[], None] | None = None) -> int:
        """Watch the children until one that is not restarted ends or a signal asks; the exit status."""
        if ready is not None:
            threading.Thread(target=ready, daemon=True).start()
        while not self.stopping.is_set():
            for child in self.children:
                if child.alive():
                    continue
                if child.restart and self._may_restart(child):
                    self.say(f"{child.name} exited with status {child.proc.returncode}; starting it again")
                    self.start(child)
                    continue
                self.say(f"{child.name} exited with status {child.proc.returncode}; stopping the others")
                return child.proc.returncode or 1
            for _, notices in self.writers.values():
                notices.tick()
            self.stopping.wait(0.5)
        return 0

    def _may_restart(self, child: Child) -> bool:
        recent = [t for t in child.starts if t > time.time() - RESTART_WINDOW_S]
        return len(recent) <= RESTARTS_ALLOWED

    def stop(self) -> None:
        """Daemon and webserver first (their ticks end while the code server still answers), then the rest."""
        front = [c for c in self.children if not c.restart]
        back = [c for c in self.children if c.restart]
        for group in (front, back):
            for child in group:
                child.terminate()
            deadline = time.time() + STOP_TIMEOUT_S
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    self.say(f"{child.name} did not stop within {STOP_TIMEOUT_S:.0f} s: killed")
                    child.kill()
                    child.proc.wait()
        self._sweep()
        for child in self.children:
            child.thread.join(timeout=5)
            if child.cut_off:
                self.say(f"{child.name}: {child.cut_off} lines of ticks cut off and tracebacks printed by the "
                         "stop omitted")
        if self.children:
            self.say("stopped")

    def leftovers(self) -> dict[int, str]:
        """Processes still in the sessions this supervisor started, run workers excepted."""
        return {pid: cmd for pid, (_, sid, state, cmd) in processes().items()
                if sid in self.sessions and pid != os.getpid() and state not in "ZX" and not RUN_WORKER.search(cmd)}

    def _sweep(self) -> None:
        left = self.leftovers()
        if not left:
            return
        self.say(f"ending {len(left)} process(es) left in our sessions: "
                 + "; ".join(f"{pid} {cmd[:80]}" for pid, cmd in sorted(left.items())))
        _signal(left, signal.SIGTERM)
        deadline = time.time() + SWEEP_GRACE_S
        while time.time() < deadline and self.leftovers():
            time.sleep(0.2)
        _signal(self.leftovers(), signal.SIGKILL)


def wait_for_http(url: str, timeout_s: float) -> float | None:
    """Seconds until `url` answers, or None after `timeout_s`."""
    start = time.time()
    while time.time() - start < timeout_s:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return time.time() - start
        except OSError:
            time.sleep(0.5)
    return None
