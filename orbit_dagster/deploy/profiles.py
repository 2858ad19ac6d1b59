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

The settings parse the profile (`settings.profile`: `settings/deployment.py`, re-exported
here); this module only renders it, and `deploy/instance.py` writes `dagster.yaml`, once,
when it is absent.
"""
from __future__ import annotations

from ..control.capacity import POOL_TAG, PRIORITY_TAG, TRAIN_POOL_TAG, run_priority  # the tags the limits count
from ..settings.deployment import (
    CONTROL_SLOTS,
    DEFAULT_POOLS,
    FOLLOW_MODES,
    PLACEMENTS,
    PROFILES,
    Pool,
    PostgresServer,
    Profile,
    parse_pools,
)

__all__ = ["CONTROL_SLOTS", "DEFAULT_POOLS", "FOLLOW_MODES", "PLACEMENTS", "PROFILES", "POOL_TAG", "TRAIN_POOL_TAG",
           "Pool", "PostgresServer", "Profile", "parse_pools", "pool_tags", "job_pools", "render_dagster_yaml"]


def pool_tags(placement: str | None, kind: str) -> dict[str, str]:
    """The run tags that put a run of `kind` (train, eval) for a job on `placement` in its pool."""
    if not placement:
        return {}
    tags = {POOL_TAG: placement}
    if kind == "train":  # and ahead of evaluations in Dagster's queue (a resumed attempt: the queue sensor's)
        tags.update({TRAIN_POOL_TAG: placement, PRIORITY_TAG: str(run_priority("train"))})
    return tags


def job_pools(ledger, job_ids) -> dict[str, str]:
    """Each job's pool, its placement: one query for a sensor tick's batch (`ledger`: a Ledger)."""
    ids = sorted({j for j in job_ids if j})
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    return {r["job_id"]: r["placement"] for r in ledger.rows(
        f"SELECT job_id, placement FROM jobs WHERE job_id IN ({marks})", ids)}


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
        "# Several run workers starting at once on a loaded 2-core machine took over 120 s.",
        "run_monitoring:",
        "  enabled: true",
        "  poll_interval_seconds: 5",
        "  start_timeout_seconds: 300",
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
