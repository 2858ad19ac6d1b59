"""The Dagster instance orbit uses: its home, its `dagster.yaml`, its workspace, its state.

The home is `$ORBIT_HOME/dagster` for the `embedded` profile and `$ORBIT_HOME/dagster-team`
for `team` (deploy/profiles.py), so each profile keeps its own `dagster.yaml` and switching is one
setting. orbit writes a `dagster.yaml` only where there is none: after that it is the
operator's file, and orbit never overwrites it (`orbit profile` says when it differs from
what the profile would write now). The processes that serve the instance (code server,
daemon, webserver) are in `deploy/services.py` and `deploy/serve.py`; one daemon per home and the storage's
first initialisation are guarded by `deploy/locks.py`. `Daemon` and `Webserver` (the end of this
file) start `orbit daemon` / `orbit ui --no-daemon` in the background for a caller (the demo, the
tests): they live here, beside the home and the heartbeats they read, so that services.py does not
import this module (it did, and this module imported it back).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from ..core.errors import OrbitError
from ..ledger.postgres import ensure_database
from ..providers.ssh.inventory import load_inventory
from ..settings import Settings
from ..settings import environment as process_environment
from .locks import DaemonLock, foreign_heartbeats, storage_initialised
from .logs import say as _say  # the classes' `say` parameter shadows the name
from .profiles import DEFAULT_POOLS, Profile, render_dagster_yaml
from .services import STOP_TIMEOUT_S

if TYPE_CHECKING:
    from dagster import DagsterInstance


def _ssh_gpus(settings: Settings) -> int | None:
    """GPUs in the SSH inventory: that provider's quota of concurrent work."""
    if not settings.ssh_hosts.is_file():
        return None
    try:
        return sum(h.gpus.count for h in load_inventory(settings.ssh_hosts).hosts) or None
    except Exception:  # a broken inventory is reported where it is used, not here
        return None


def profile(settings: Settings) -> Profile:
    """The deployment profile the settings hold (ORBIT_PROFILE, ORBIT_POOLS, ORBIT_POSTGRES_URL),
    its SSH pool defaulting to the inventory's GPUs."""
    defaults = dict(DEFAULT_POOLS)
    gpus = _ssh_gpus(settings)
    if gpus:
        defaults["ssh_rental"] = gpus
    return settings.profile.with_pool_defaults(defaults)


def dagster_home(settings: Settings) -> Path:
    return settings.home / profile(settings).dagster_dir


def ensure_dagster_home(settings: Settings) -> Path:
    """The profile's Dagster home, with a `dagster.yaml` written if (and only if) it has none.

    For `team`, the two PostgreSQL databases are made on first use when the role may."""
    prof = profile(settings)
    home = settings.home / prof.dagster_dir
    home.mkdir(parents=True, exist_ok=True)
    if prof.postgres is not None:
        ensure_database(prof.postgres.url(prof.postgres.dagster_database), field="ORBIT_POSTGRES_URL")
        ensure_database(prof.postgres.ledger_url, field="ORBIT_POSTGRES_URL")
    cfg = home / "dagster.yaml"
    if not cfg.exists():
        # Written whole then renamed: two processes starting at once never see half a file.
        tmp = cfg.with_name(f".dagster.yaml.{os.getpid()}")
        tmp.write_text(render_dagster_yaml(prof))
        os.replace(tmp, cfg)
    return home


def workspace_override(settings: Settings) -> Path | None:
    """An operator's own workspace (`$ORBIT_WORKSPACE`): the webserver and daemon load it as it is,
    and orbit starts no code server. Unset (the default), orbit serves the code location itself."""
    return settings.workspace


def code_location_source(settings: Settings) -> str:
    """Where the webserver and daemon get orbit's code location from, in words."""
    explicit = settings.workspace
    if explicit is not None:
        return f"{explicit} (ORBIT_WORKSPACE)"
    address = settings.code_server
    if address is not None:
        return f"the code server at {address} (ORBIT_CODE_SERVER)"
    return "a code server of their own (dagster api grpc on a private unix socket)"


def environment(settings: Settings) -> dict[str, str]:
    """The environment of a process serving this instance: ours (the settings' accessor) under
    what the settings were parsed from (`Settings.with_env` values included), with the home
    and the Dagster home set."""
    env = {**process_environment(), **settings.env}
    env["ORBIT_HOME"] = str(settings.home)
    env["DAGSTER_HOME"] = str(ensure_dagster_home(settings))
    return env


@contextmanager
def dagster_instance(settings: Settings) -> Iterator["DagsterInstance"]:
    """The persistent Dagster instance of the active profile. While its storage is new, the
    opening happens under the storage lock (deploy/locks.py): processes opening a new
    storage at the same moment would otherwise both stamp its schema and break it for good."""
    # lazy: dagster costs 1.5 s or more; `orbit profile --config` imports this module and never opens the instance
    from dagster import DagsterInstance

    home = ensure_dagster_home(settings)
    with storage_initialised(home):
        instance = DagsterInstance.from_config(str(home))
    with instance:
        yield instance


def prepare_instance(settings: Settings) -> Path:
    """Open the instance once, before its processes start (its storage created if new). Returns
    the Dagster home."""
    with dagster_instance(settings) as instance:
        instance.get_daemon_heartbeats()
    return dagster_home(settings)


def daemon_heartbeat_ids(settings: Settings) -> dict[str, tuple[float, str | None]]:
    """Each daemon kind's last heartbeat: (seconds since, the daemon process's id)."""
    with dagster_instance(settings) as instance:
        now = time.time()
        return {kind: (now - hb.timestamp, hb.daemon_id) for kind, hb in instance.get_daemon_heartbeats().items()}


def daemon_heartbeats(settings: Settings) -> dict[str, float]:
    """Seconds since each daemon (sensors, run queue, monitoring, ...) last sent a heartbeat."""
    return {kind: age for kind, (age, _) in daemon_heartbeat_ids(settings).items()}


def foreign_daemon(settings: Settings, lock: DaemonLock) -> dict[str, tuple[float, str]]:
    """Live heartbeats from a daemon this home's lock does not know (one elsewhere on a shared storage)."""
    beats = daemon_heartbeat_ids(settings)
    lock.adopt_orphans(beats)
    return foreign_heartbeats(beats, lock.known_ids())


def running_daemon(settings: Settings) -> str | None:
    """A line naming the daemon that runs for this instance, or None when there is none."""
    lock = DaemonLock(ensure_dagster_home(settings))
    holder = lock.holder()
    if holder is not None:
        return (f"a daemon already runs for this Dagster home ({holder.get('what', 'orbit daemon')}, pid "
                f"{holder.get('pid', '?')}, since {holder.get('since', '?')})")
    foreign = foreign_daemon(settings, lock)
    if foreign:
        age, did = min(foreign.values())
        return f"a daemon heartbeats to this instance from elsewhere (daemon id {did[:8]}, {age:.0f} s ago)"
    return None


def daemon_alive(settings: Settings, max_age_s: float = 30.0) -> bool:
    """True if a daemon has sent heartbeats to this instance recently."""
    return any(age < max_age_s for age in daemon_heartbeats(settings).values())


# The daemons orbit needs before a submission can move: sensors launch, the queue dequeues.
NEEDED_DAEMONS = {"SENSOR": "sensors", "QUEUED_RUN_COORDINATOR": "run queue"}


def wait_for_daemon(settings: Settings, *, timeout_s: float = 120.0, say: Callable[[str], None] | None = None,
                    log: Path | None = None,
                    seen: Callable[[dict[str, tuple[float, str | None]]], None] | None = None) -> float:
    """Wait until the sensor and run-queue daemons heartbeat; say what is being waited for.
    `seen` gets every poll's heartbeats (age, daemon id) before they are judged."""
    say = say or (lambda _line: None)
    start = time.time()
    said = False
    while True:
        beats = daemon_heartbeat_ids(settings)
        if seen is not None:
            seen(beats)
        fresh = {k for k, (age, _) in beats.items() if age < 10.0}
        if set(NEEDED_DAEMONS) <= fresh:
            waited = time.time() - start
            say(f"daemon up after {waited:.0f} s: {', '.join(sorted(NEEDED_DAEMONS.values()))} ticking")
            return waited
        if not said:
            say("waiting for the Dagster daemon's first heartbeat (~5-10 s here once the code server "
                "answers); jobs stay QUEUED until then")
            said = True
        if time.time() - start > timeout_s:
            where = log or dagster_home(settings) / "daemon.log"
            raise OrbitError(f"the Dagster daemon did not heartbeat within {timeout_s:.0f} s",
                             field="daemon", value=sorted(fresh), fix=f"see {where}")
        time.sleep(1.0)


def in_progress_runs(settings: Settings) -> int:
    from dagster import DagsterRunStatus, RunsFilter  # lazy: 1.5 s or more (see dagster_instance)

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


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Background:
    """An `orbit daemon` / `orbit ui` supervisor in the background, its output in a log file."""

    log_name = ""

    def __init__(self, settings: Settings, say: Callable[[str], None] | None = None):
        self.settings = settings
        self.say = say if say is not None else _say
        self.proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return dagster_home(self.settings) / self.log_name

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self):
        env = environment(self.settings)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "orbit_dagster.cli", *self.argv()], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_default_signals)
        return self

    def stop(self, timeout_s: float = 2 * STOP_TIMEOUT_S + 10) -> None:
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
    """`orbit daemon` in the background: sensors, run queue, monitoring, retries.

    If a daemon already runs for the instance (this home's lock, or live heartbeats from
    elsewhere), it is used: nothing is started (`started` False) and `stop()` leaves it."""

    log_name = "daemon.log"
    started = False

    def argv(self) -> list[str]:
        return ["daemon"]

    def start(self) -> "Daemon":
        running = running_daemon(self.settings)
        if running is not None:
            self.say(f"{running}: using it, not starting another")
            return self
        super().start()
        self.started = True
        self.say(f"starting the Dagster daemon (code server, sensors, run queue; log: {self.log})")
        return self


class Webserver(_Background):
    """`orbit ui --no-daemon` in the background, on 127.0.0.1."""

    log_name = "webserver.log"

    def __init__(self, settings: Settings, port: int, say: Callable[[str], None] | None = None):
        super().__init__(settings, say)
        self.port = port

    def argv(self) -> list[str]:
        return ["ui", "--no-daemon", "--port", str(self.port)]


__all__ = ["Daemon", "Webserver", "code_location_source", "dagster_home", "dagster_instance", "daemon_alive",
           "ensure_dagster_home", "environment", "prepare_instance", "profile", "running_daemon", "wait_for_daemon",
           "wait_until_idle", "workspace_override"]
