"""The long-running processes of an instance: `dagster-daemon` and `dagster-webserver`.

`orbit daemon` and `orbit ui` run them under a small supervisor (`supervise`) that
- starts each in a session of its own with SIGINT/SIGTERM at their defaults (a process
  started from a shell's background job inherits them ignored and then cannot be stopped
  politely), and asks the kernel to end it if the supervisor dies;
- on SIGTERM or SIGINT, passes SIGTERM to each session, waits, and exits 0 (SIGKILL after
  `STOP_TIMEOUT_S`), so systemd, a terminal's Ctrl-C and `kill` all stop everything;
- writes their output without colour codes and without the lines every sensor tick and
  run-monitoring pass print (errors and warnings always stay).
`Daemon` and `Webserver` start the same supervisor in the background, logging to a file.
We run the webserver and the daemon rather than `dagster dev`: they are what a server
runs (docs/deploy.md), and `dagster dev` is a development command that now points to
`dg dev`, a separate package orbit does not need.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from .control.settings import Settings

STOP_TIMEOUT_S = 20.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# INFO lines that every tick repeats (Dagster 1.13's sensor, schedule, monitoring and
# queue daemons): dropped from the logs. Anything that launches, fails or warns stays.
TICK_NOISE = re.compile(
    r" - (?:DEBUG|INFO) - (?:"
    r"Checking for new runs for (?:sensor|the following schedules)|Not checking for new runs for sensor"
    r"|Sensor \S+ skipped|No run requests returned|No new tick times to evaluate"
    r"|Collected \d+ runs? for monitoring|Checking run [0-9a-f-]+"
    r"|Retrieved \d+ queued runs?|Poll(?:ing)? for new runs"
    r"|No backfill jobs|No (?:new )?asset backfills"
    r"|Priority sorting and checking tag concurrency limits|Skipping \d+ runs? for sensor"
    r")"
    # Runs' DEBUG events (step starts, resources, captured logs): each run's page in the UI
    # has them; their INFO lines and anything worse stay here.
    r"| - dagster - DEBUG - "
)


def say(line: str) -> None:
    """A status line of orbit's own, on stderr, with the time (the children's logs carry theirs)."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} orbit: {line}", file=sys.stderr, flush=True)


_say = say  # for the classes below, whose `say` parameter shadows it


# The webserver's access log: the UI polls every few seconds. Errors (4xx, 5xx) stay.
ACCESS_OK = re.compile(r'^INFO:\s+\S+ - "[A-Z]+ [^"]*" [23]\d\d\b')


def clean_line(line: str) -> str | None:
    """A log line without colour codes; None for per-tick noise."""
    text = ANSI.sub("", line)
    return None if TICK_NOISE.search(text) or ACCESS_OK.search(text) else text


def _in_own_session() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    try:  # Linux: end with the supervisor, even if it is killed outright
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exe(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def daemon_argv(workspace: Path) -> list[str]:
    return [_exe("dagster-daemon"), "run", "-w", str(workspace), "--log-level", "info"]


def webserver_argv(workspace: Path, host: str, port: int) -> list[str]:
    return [_exe("dagster-webserver"), "-w", str(workspace), "-h", host, "-p", str(port), "--log-level", "info"]


# Once asked to stop, dagster-daemon tears its workspace down while sensor ticks already
# handed to its threads are still running; each then logs "tick caught an error" and a
# traceback ending in DagsterCodeLocationNotFoundError, and the code server prints the
# KeyboardInterrupt it stopped with (~100 lines per stop). Ticks cut off and processes
# interrupted by the stop, not failures: after the stop begins, those lines (and any line
# that is not a log record, i.e. a traceback's) are counted in one line instead. A run the
# stop caught being launched fails, and its "error dequeuing run" line stays.
CUT_OFF_TICK = re.compile(r" - ERROR - (?:(?:Sensor|Schedule) tick caught an error|Sensor daemon caught an error for)")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


@dataclass
class Child:
    name: str
    argv: list[str]
    out: IO[str]
    proc: subprocess.Popen | None = None
    thread: threading.Thread | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    cut_off: int = 0  # lines of ticks cut off and tracebacks printed by the stop, omitted
    dropped: int = 0  # lines the log file refused (a full disk)

    def start(self, env: dict[str, str]) -> "Child":
        self.proc = subprocess.Popen(self.argv, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
                                     bufsize=1, preexec_fn=_in_own_session)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            kept = clean_line(line)
            if kept is None:
                continue
            if self.stopping.is_set() and (CUT_OFF_TICK.search(kept) or not LOG_LINE.match(kept)):
                self.cut_off += 1
                continue
            try:
                self.out.write(kept)
                self.out.flush()
            except OSError:
                # The log's disk is full: the line is lost, but the pipe must keep draining,
                # or the child blocks writing its output and every sensor stops with it.
                self.dropped += 1

    def terminate(self) -> None:
        self.stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def supervise(children: list[Child], env: dict[str, str], say: Callable[[str], None],
              ready: Callable[[], None] | None = None) -> int:
    """Run `children` until one ends or a signal asks; stop them all; the exit status."""
    stopping = threading.Event()

    def on_signal(signum, _frame) -> None:
        if not stopping.is_set():
            say(f"{signal.Signals(signum).name}: stopping {', '.join(c.name for c in children)}")
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for child in children:
            child.start(env)
            say(f"started {child.name} (pid {child.proc.pid})")
        if ready is not None:
            threading.Thread(target=ready, daemon=True).start()
        ended = None
        while not stopping.is_set() and ended is None:
            ended = next((c for c in children if c.proc.poll() is not None), None)
            stopping.wait(0.5)
        for child in children:
            child.terminate()
        deadline = time.time() + STOP_TIMEOUT_S
        for child in children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                say(f"{child.name} did not stop within {STOP_TIMEOUT_S:.0f} s: killed")
                child.kill()
                child.proc.wait()
            child.thread.join(timeout=5)
            if child.cut_off:
                say(f"{child.name}: {child.cut_off} lines of ticks cut off and tracebacks printed by the stop "
                    "omitted")
        if ended is not None and not stopping.is_set():
            say(f"{ended.name} exited with status {ended.proc.returncode}; stopped the others")
            return ended.proc.returncode or 1
        say("stopped")
        return 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class _Background:
    """An `orbit daemon` / `orbit ui` supervisor in the background, its output in a log file."""

    log_name = ""

    def __init__(self, settings: Settings, say: Callable[[str], None] | None = None):
        self.settings = settings
        self.say = say if say is not None else _say
        self.proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        from .instance import dagster_home

        return dagster_home(self.settings) / self.log_name

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self):
        from .instance import environment

        env = environment(self.settings)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", *self.argv()], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_default_signals)
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_S + 10) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Daemon(_Background):
    """`orbit daemon` in the background: sensors, run queue, monitoring, retries."""

    log_name = "daemon.log"

    def argv(self) -> list[str]:
        return ["daemon"]

    def start(self) -> "Daemon":
        super().start()
        self.say(f"starting the Dagster daemon (sensors, run queue; log: {self.log})")
        return self


class Webserver(_Background):
    """`orbit ui --no-daemon` in the background, on 127.0.0.1."""

    log_name = "webserver.log"

    def __init__(self, settings: Settings, port: int, say: Callable[[str], None] | None = None):
        super().__init__(settings, say)
        self.port = port

    def argv(self) -> list[str]:
        return ["ui", "--no-daemon", "--port", str(self.port)]


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)



def wait_for_http(url: str, timeout_s: float) -> float | None:
    """Seconds until `url` answers, or None after `timeout_s`."""
    import urllib.request

    start = time.time()
    while time.time() - start < timeout_s:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return time.time() - start
        except OSError:
            time.sleep(0.5)
    return None
