"""The Dagster instance orbit uses: its home, its `dagster.yaml`, its workspace, its state.

The home is `$ORBIT_HOME/dagster` for the `embedded` profile and `$ORBIT_HOME/dagster-team`
for `team` (profiles.py), so each profile keeps its own `dagster.yaml` and switching is one
setting. orbit writes a `dagster.yaml` only where there is none: after that it is the
operator's file, and orbit never overwrites it (`orbit profile` says when it differs from
what the profile would write now). The processes that serve the instance (daemon,
webserver) are in `services.py`.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .control.settings import Settings
from .profiles import DEFAULT_POOLS, Profile

if TYPE_CHECKING:
    from dagster import DagsterInstance

CHECKOUT_WORKSPACE = Path(__file__).resolve().parents[1] / "workspace.yaml"
WORKSPACE_YAML = """\
# The code location orbit's webserver and daemon load (`orbit ui`, `orbit daemon`, `make ui`).
# The location keeps the name `-m orbit_dagster.definitions` gave it, so sensor state and
# run history carry over.
load_from:
  - python_module:
      module_name: orbit_dagster.definitions
      location_name: orbit_dagster.definitions
"""


def _ssh_gpus(settings: Settings) -> int | None:
    """GPUs in the SSH inventory: that provider's quota of concurrent work."""
    if not settings.ssh_hosts.is_file():
        return None
    try:
        from .providers.ssh_inventory import load_inventory

        return sum(h.gpus.count for h in load_inventory(settings.ssh_hosts).hosts) or None
    except Exception:  # a broken inventory is reported where it is used, not here
        return None


def profile(settings: Settings) -> Profile:
    """The deployment profile the environment selects (ORBIT_PROFILE, ORBIT_POOLS, ORBIT_POSTGRES_URL)."""
    defaults = dict(DEFAULT_POOLS)
    gpus = _ssh_gpus(settings)
    if gpus:
        defaults["ssh_rental"] = gpus
    return Profile.from_env(defaults)


def dagster_home(settings: Settings) -> Path:
    return settings.home / profile(settings).dagster_dir


def ensure_dagster_home(settings: Settings) -> Path:
    """The profile's Dagster home, with a `dagster.yaml` written if (and only if) it has none.

    For `team`, the two PostgreSQL databases are made on first use when the role may."""
    prof = profile(settings)
    home = settings.home / prof.dagster_dir
    home.mkdir(parents=True, exist_ok=True)
    if prof.postgres is not None:
        from .ledger.postgres import ensure_database

        ensure_database(prof.postgres.url(prof.postgres.dagster_database), field="ORBIT_POSTGRES_URL")
        ensure_database(prof.postgres.ledger_url, field="ORBIT_POSTGRES_URL")
    cfg = home / "dagster.yaml"
    if not cfg.exists():
        # Written whole then renamed: two processes starting at once never see half a file.
        tmp = cfg.with_name(f".dagster.yaml.{os.getpid()}")
        tmp.write_text(prof.dagster_yaml())
        os.replace(tmp, cfg)
    return home


def workspace_file(settings: Settings) -> Path:
    """The workspace the webserver and daemon load: $ORBIT_WORKSPACE, else the checkout's
    top-level `workspace.yaml`, else one written beside `dagster.yaml` (an installed package)."""
    explicit = os.environ.get("ORBIT_WORKSPACE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    if CHECKOUT_WORKSPACE.is_file():
        return CHECKOUT_WORKSPACE
    path = ensure_dagster_home(settings) / "workspace.yaml"
    if not path.exists():
        path.write_text(WORKSPACE_YAML)
    return path


def environment(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env["ORBIT_HOME"] = str(settings.home)
    env["DAGSTER_HOME"] = str(ensure_dagster_home(settings))
    return env


@contextmanager
def dagster_instance(settings: Settings) -> Iterator["DagsterInstance"]:
    """The persistent Dagster instance of the active profile."""
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(ensure_dagster_home(settings))) as instance:
        yield instance


def prepare_instance(settings: Settings) -> Path:
    """Open the instance once, before its processes start: a new storage's tables are then made
    by one process (several making a new SQLite storage at once can corrupt its migration
    table). Returns the Dagster home."""
    with dagster_instance(settings) as instance:
        instance.get_daemon_heartbeats()
    return dagster_home(settings)


def daemon_heartbeats(settings: Settings) -> dict[str, float]:
    """Seconds since each daemon (sensors, run queue, monitoring, ...) last sent a heartbeat."""
    with dagster_instance(settings) as instance:
        now = time.time()
        return {kind: now - hb.timestamp for kind, hb in instance.get_daemon_heartbeats().items()}


def daemon_alive(settings: Settings, max_age_s: float = 30.0) -> bool:
    """True if a daemon has sent heartbeats to this instance recently."""
    return any(age < max_age_s for age in daemon_heartbeats(settings).values())


# The daemons orbit needs before a submission can move: sensors launch, the queue dequeues.
NEEDED_DAEMONS = {"SENSOR": "sensors", "QUEUED_RUN_COORDINATOR": "run queue"}


def wait_for_daemon(settings: Settings, *, timeout_s: float = 120.0, say: Callable[[str], None] | None = None,
                    log: Path | None = None) -> float:
    """Wait until the sensor and run-queue daemons heartbeat; say what is being waited for."""
    from .core.errors import OrbitError

    say = say or (lambda _line: None)
    start = time.time()
    said = False
    while True:
        fresh = {k for k, age in daemon_heartbeats(settings).items() if age < 10.0}
        if set(NEEDED_DAEMONS) <= fresh:
            waited = time.time() - start
            say(f"daemon up after {waited:.0f} s: {', '.join(sorted(NEEDED_DAEMONS.values()))} ticking")
            return waited
        if not said:
            say("waiting for the Dagster daemon's first heartbeat (it loads the code location first, "
                "~10-20 s here); jobs stay QUEUED until then")
            said = True
        if time.time() - start > timeout_s:
            where = log or dagster_home(settings) / "daemon.log"
            raise OrbitError(f"the Dagster daemon did not heartbeat within {timeout_s:.0f} s",
                             field="daemon", value=sorted(fresh), fix=f"see {where}")
        time.sleep(1.0)


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


# The processes live in services.py; imported last, for callers that take them from here.
from .services import Daemon, Webserver  # noqa: E402

__all__ = ["Daemon", "Webserver", "dagster_home", "dagster_instance", "daemon_alive", "ensure_dagster_home",
           "environment", "prepare_instance", "profile", "wait_for_daemon", "wait_until_idle", "workspace_file"]
