"""Deployment profiles: where Dagster and the ledger keep their state, and how many runs go at once.

One setting picks the profile, `ORBIT_PROFILE`:

- `embedded` (the default): one machine. Dagster's storage is SQLite under
  `$ORBIT_HOME/dagster`, the ledger is SQLite under `$ORBIT_HOME/ledger`.
- `team`: one server, many people. Dagster's storage (runs, event logs, schedules, sensor
  ticks) is on PostgreSQL through `dagster-postgres`, and so is the ledger, on the same
  server (`ORBIT_POSTGRES_URL=postgresql://USER@HOST:PORT/DB`; the ledger in DB, Dagster in
  `DB_dagster`, two databases because both have a table named `runs`). Its Dagster home
  is `$ORBIT_HOME/dagster-team`, so switching back to `embedded` is the one setting again.

Both profiles get Dagster's queued run coordinator with one pool per provider (a run
tag, `orbit/pool`, limited to the provider's quota), run monitoring and run retries for
crashed run workers. Dagster's own "pools" (`@asset(pool=...)`) are fixed per asset,
while the provider is chosen per job, so the pools here are tag concurrency limits. The
coordinator is orbit's subclass (`deploy/run_coordinator.py`): it tags a renting run launched
from the UI, which Dagster submits with its own tags only, from the job's placement.
Inside each pool trainings may take all slots but `eval_reserve`: a training run holds
its slot for the whole attempt, and evaluations must not wait for trainings to end.

This module only computes; `deploy/instance.py` writes `dagster.yaml`, once, when it is absent.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import get_args

from ..core.errors import OrbitError
from ..core.execution import Placement
from ..control.capacity import POOL_TAG, TRAIN_POOL_TAG

PROFILES = ("embedded", "team")
PLACEMENTS: tuple[str, ...] = get_args(Placement)
# Concurrent instances per provider when ORBIT_POOLS does not say: the sim market is a few
# processes on this machine; an SSH inventory's size and an EC2 account's spot quota are
# the operator's to give (docs/deploy.md).
DEFAULT_POOLS = {"sim": 4, "ssh_rental": 2, "aws_spot": 4}
# Runs that rent nothing (best checkpoint, cost summary, offer discovery) always find a slot.
CONTROL_SLOTS = 2


@dataclass(frozen=True)
class Pool:
    """One provider's concurrent runs (trainings and evaluations that rent from it)."""

    name: str
    limit: int

    @property
    def eval_reserve(self) -> int:
        """Slots trainings leave to evaluations: a quarter, at least one (none in a pool of one)."""
        return 0 if self.limit < 2 else max(1, self.limit // 4)

    @property
    def train_limit(self) -> int:
        return self.limit - self.eval_reserve


def pool_tags(placement: str | None, kind: str) -> dict[str, str]:
    """The run tags that put a run of `kind` (train, eval) for a job on `placement` in its pool."""
    if not placement:
        return {}
    tags = {POOL_TAG: placement}
    if kind == "train":
        tags[TRAIN_POOL_TAG] = placement
    return tags


def job_pools(ledger, job_ids) -> dict[str, str]:
    """Each job's pool, its placement: one query for a sensor tick's batch (`ledger`: a Ledger)."""
    ids = sorted({j for j in job_ids if j})
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    return {r["job_id"]: r["placement"] for r in ledger.rows(
        f"SELECT job_id, placement FROM jobs WHERE job_id IN ({marks})", ids)}


def parse_pools(text: str | None, defaults: dict[str, int] | None = None) -> tuple[Pool, ...]:
    """`ORBIT_POOLS="sim=4 aws_spot=8"` over the defaults; a bad entry names itself and the fix."""
    limits = dict(defaults or DEFAULT_POOLS)
    fix = f"write NAME=LIMIT pairs, NAME one of {', '.join(PLACEMENTS)}, LIMIT a whole number >= 1, e.g. sim=4 aws_spot=8"
    for item in (text or "").replace(",", " ").split():
        name, sep, value = item.partition("=")
        if not sep or name not in PLACEMENTS:
            raise OrbitError(f"ORBIT_POOLS entry {item!r} does not name a provider", field="ORBIT_POOLS", value=text,
                             fix=fix)
        if not value.isdigit() or int(value) < 1:
            raise OrbitError(f"ORBIT_POOLS entry {item!r}: the limit must be a whole number >= 1",
                             field="ORBIT_POOLS", value=text, fix=fix)
        limits[name] = int(value)
    return tuple(Pool(name, limits[name]) for name in PLACEMENTS if name in limits)


@dataclass(frozen=True)
class PostgresServer:
    """The team's PostgreSQL: `postgresql://USER@HOST:PORT/DB`. No password in the URL: libpq
    reads it from PGPASSWORD or ~/.pgpass, so it is never written into a file orbit makes."""

    user: str
    host: str
    port: int
    database: str

    @classmethod
    def parse(cls, url: str | None, field: str = "ORBIT_POSTGRES_URL") -> "PostgresServer":
        import sqlalchemy as sa

        fix = "set ORBIT_POSTGRES_URL=postgresql://USER@HOST:PORT/DB (the password in PGPASSWORD or ~/.pgpass)"
        if not url:
            raise OrbitError("the team profile needs a PostgreSQL server", field=field, value=url, fix=fix)
        try:
            u = sa.engine.make_url(url)
        except Exception:  # sqlalchemy's ArgumentError, or a ValueError from a bad port
            raise OrbitError(f"{field} is not a database URL", field=field, value=url, fix=fix) from None
        if u.get_backend_name() != "postgresql" or not u.host or not u.username:
            raise OrbitError(f"{field} must name a PostgreSQL server with a user and a host", field=field,
                             value=u.render_as_string(hide_password=True), fix=fix)
        if u.password:
            raise OrbitError(f"{field} holds a password; orbit writes this URL into dagster.yaml and logs",
                             field=field, value=u.render_as_string(hide_password=True),
                             fix="drop it from the URL and export PGPASSWORD (or use ~/.pgpass)")
        return cls(u.username, u.host, int(u.port or 5432), u.database or "orbit")

    @property
    def dagster_database(self) -> str:
        return f"{self.database}_dagster"

    def url(self, database: str | None = None, driver: str = "psycopg") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{self.user}@{self.host}:{self.port}/{database or self.database}"

    @property
    def ledger_url(self) -> str:
        return self.url()


@dataclass(frozen=True)
class Profile:
    name: str
    pools: tuple[Pool, ...]
    postgres: PostgresServer | None = None

    @classmethod
    def from_env(cls, pool_defaults: dict[str, int] | None = None) -> "Profile":
        name = os.environ.get("ORBIT_PROFILE") or "embedded"
        if name not in PROFILES:
            raise OrbitError(f"unknown deployment profile {name!r}", field="ORBIT_PROFILE", value=name,
                             fix="ORBIT_PROFILE=embedded (SQLite, the default) or ORBIT_PROFILE=team (PostgreSQL)")
        pools = parse_pools(os.environ.get("ORBIT_POOLS"), pool_defaults)
        pg = PostgresServer.parse(os.environ.get("ORBIT_POSTGRES_URL")) if name == "team" else None
        return cls(name, pools, pg)

    @property
    def dagster_dir(self) -> str:
        """The Dagster home's name under $ORBIT_HOME: one per profile, so each keeps its dagster.yaml."""
        return "dagster" if self.name == "embedded" else f"dagster-{self.name}"

    @property
    def max_concurrent_runs(self) -> int:
        return sum(p.limit for p in self.pools) + CONTROL_SLOTS

    @property
    def ledger_url(self) -> str | None:
        """The profile's ledger; None means the default SQLite file under $ORBIT_HOME."""
        return self.postgres.ledger_url if self.postgres else None

    def dagster_yaml(self) -> str:
        return render_dagster_yaml(self)


FOLLOW_MODES = ("run", "daemon")


def follow_mode() -> str:
    """Who follows a launched training attempt (`ORBIT_FOLLOW`): `run`, its training run for the
    whole attempt (the embedded default: the UI's Terminate stops the attempt), or `daemon`,
    where the training run launches the attempt and hands following to the daemon
    (control/handoff.py; the team default: no run slot or run worker is held while a GPU trains)."""
    default = "daemon" if (os.environ.get("ORBIT_PROFILE") or "embedded") == "team" else "run"
    mode = os.environ.get("ORBIT_FOLLOW") or default
    if mode not in FOLLOW_MODES:
        raise OrbitError(f"unknown follow mode {mode!r}", field="ORBIT_FOLLOW", value=mode,
                         fix="ORBIT_FOLLOW=run (a run follows each attempt) or ORBIT_FOLLOW=daemon (hand-off)")
    return mode


def profile_ledger_url() -> str | None:
    """The ledger URL ORBIT_PROFILE implies (None: SQLite under $ORBIT_HOME)."""
    if (os.environ.get("ORBIT_PROFILE") or "embedded") == "embedded":
        return None
    return Profile.from_env().ledger_url


def render_dagster_yaml(profile: Profile) -> str:
    lines = [
        f"# Written by orbit for the `{profile.name}` profile, once, because this file was absent.",
        "# orbit never rewrites it: edit it here, then restart `orbit daemon` and `orbit ui`.",
        "# What each block is for, and how to change the limits: docs/deploy.md.",
        "telemetry:",
        "  enabled: false",
        "nux:",
        "  enabled: false",
    ]
    if profile.postgres is not None:
        pg = profile.postgres
        lines += [
            "# Runs, event logs, schedules and sensor ticks on PostgreSQL (dagster-postgres). No",
            "# password here: libpq reads PGPASSWORD or ~/.pgpass.",
            "storage:",
            "  postgres:",
            "    postgres_db:",
            f"      hostname: {pg.host}",
            f"      port: {pg.port}",
            f"      username: {pg.user}",
            f"      db_name: {pg.dagster_database}",
            "      # dagster-postgres's driver: SQLAlchemy 2.1 would otherwise pick psycopg 3, whose",
            "      # server-side parameters break dagster's `NOTIFY run_events, %s`.",
            "      scheme: postgresql+psycopg2",
        ]
    else:
        lines += ["# Storage: SQLite files in this directory (Dagster's default)."]
    lines += [
        "# Dagster's queued run coordinator, which also puts a run launched from the UI (a backfill,",
        "# a partition materialised) that rents a GPU into its provider's pool (deploy/run_coordinator.py).",
        "run_coordinator:",
        "  module: orbit_dagster.deploy.run_coordinator",
        "  class: OrbitRunCoordinator",
        "  config:",
        "    dequeue_interval_seconds: 1",
        "    # Launch queued runs in parallel: a run's process takes seconds to start.",
        "    dequeue_use_threads: true",
        "    dequeue_num_workers: 4",
        "    # A launch the code server did not answer in time (a busy or restarting server) is",
        "    # tried again instead of failing the run.",
        "    max_user_code_failure_retries: 5",
        "    user_code_failure_retry_delay: 30",
        "concurrency:",
        "  runs:",
        f"    # Every pool's limit, plus {CONTROL_SLOTS} for runs that rent nothing (best checkpoint, costs).",
        f"    max_concurrent_runs: {profile.max_concurrent_runs}",
        "    # One pool per provider (the `orbit/pool` run tag): its quota of concurrent instances.",
        "    # Trainings (`orbit/train-pool`) leave the rest to evaluations, which are never starved.",
        "    tag_concurrency_limits:",
    ]
    for pool in profile.pools:
        lines += [f"      - key: {POOL_TAG}", f"        value: {pool.name}", f"        limit: {pool.limit}"]
        if pool.eval_reserve:
            lines += [f"      - key: {TRAIN_POOL_TAG}", f"        value: {pool.name}",
                      f"        limit: {pool.train_limit}"]
    lines += [
        "# Dagster's default launcher (runs as processes of the code server), plus health checks",
        "# from orbit's liveness record of each run worker (deploy/run_launcher.py), so run monitoring",
        "# fails a run whose worker died (SIGKILL, reboot) and gives its pool slot back.",
        "run_launcher:",
        "  module: orbit_dagster.deploy.run_launcher",
        "  class: OrbitRunLauncher",
        "# A run stuck starting is failed, and so is one whose worker is gone: within seconds on",
        "# this machine, within ORBIT_WORKER_TIMEOUT_S (no heartbeat) for a worker elsewhere.",
        "run_monitoring:",
        "  enabled: true",
        "  poll_interval_seconds: 5",
        "  start_timeout_seconds: 120",
        "  cancel_timeout_seconds: 120",
        "  max_resume_run_attempts: 0",
    ]
    if profile.name == "team":
        lines += [
            "# A run whose run worker crashed (killed, out of memory, its host rebooted) is run again;",
            "# a failed training or evaluation is not: orbit retries those itself, by failure class.",
            "run_retries:",
            "  enabled: true",
            "  max_retries: 1",
            "  retry_on_asset_or_op_failure: false",
        ]
    lines += [
        "sensors:",
        "  use_threads: true",
        "  num_workers: 4",
        "schedules:",
        "  use_threads: true",
        "  num_workers: 2",
        "# Sensors tick every few seconds: keep a week of their history, a day of skipped ticks.",
        "retention:",
        "  sensor:",
        "    purge_after_days:",
        "      skipped: 1",
        "      failure: 7",
        "      success: 7",
        "  schedule:",
        "    purge_after_days: 30",
    ]
    return "\n".join(lines) + "\n"
