"""The local Dagster instance orbit uses: `$ORBIT_HOME/dagster`, its daemon, its settings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .control.settings import Settings

if TYPE_CHECKING:
    from dagster import DagsterInstance

DAGSTER_YAML = """\
# Written by orbit. The UI opens without the first-visit modal and sends no telemetry.
telemetry:
  enabled: false
nux:
  enabled: false
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    max_concurrent_runs: {max_runs}
    dequeue_interval_seconds: 1
    # Launch queued runs in parallel: a run's process takes seconds to start.
    dequeue_use_threads: true
    dequeue_num_workers: 4
    tag_concurrency_limits:
      - key: orbit/kind
        value: eval
        limit: {max_evals}
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
sensors:
  use_threads: true
  num_workers: 4
schedules:
  use_threads: true
  num_workers: 2
"""


def dagster_home(settings: Settings) -> Path:
    return settings.home / "dagster"


def ensure_dagster_home(settings: Settings, *, max_runs: int = 4, max_evals: int = 2) -> Path:
    home = dagster_home(settings)
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "dagster.yaml"
    text = DAGSTER_YAML.format(max_runs=max_runs, max_evals=max_evals)
    if not cfg.exists() or cfg.read_text() != text:
        cfg.write_text(text)
    return home


def environment(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env["ORBIT_HOME"] = str(settings.home)
    env["DAGSTER_HOME"] = str(ensure_dagster_home(settings))
    return env


def _default_signals() -> None:
    # A daemon started from a shell's background job inherits SIGINT/SIGTERM ignored and
    # then cannot be stopped politely; give it the default handlers back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def dagster_instance(settings: Settings) -> Iterator["DagsterInstance"]:
    """The persistent Dagster instance under `$ORBIT_HOME/dagster`."""
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(ensure_dagster_home(settings))) as instance:
        yield instance


def daemon_alive(settings: Settings, max_age_s: float = 30.0) -> bool:
    """True if a daemon has sent heartbeats to this instance recently."""
    with dagster_instance(settings) as instance:
        now = time.time()
        return any(now - hb.timestamp < max_age_s for hb in instance.get_daemon_heartbeats().values())


def in_progress_runs(settings: Settings) -> int:
    from dagster import DagsterRunStatus, RunsFilter

    statuses = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
                DagsterRunStatus.STARTED]
    with dagster_instance(settings) as instance:
        return len(instance.get_run_records(RunsFilter(statuses=statuses)))


def wait_until_idle(settings: Settings, *, quiet_s: float = 12.0, timeout_s: float = 300.0) -> bool:
    """Wait until no run has been queued or in progress for `quiet_s` (sensors included)."""
    deadline = time.time() + timeout_s
    quiet_since = None
    while time.time() < deadline:
        if in_progress_runs(settings):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.time()
        elif time.time() - quiet_since >= quiet_s:
            return True
        time.sleep(1.0)
    return False


class Daemon:
    """`dagster-daemon run` for orbit's code location, in a session of its own."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        env = environment(self.settings)
        log = open(Path(env["DAGSTER_HOME"]) / "daemon.log", "ab")
        exe = Path(sys.executable).with_name("dagster-daemon")
        argv = [str(exe), "run", "-m", "orbit_dagster.definitions"]
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_default_signals)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
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

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
