"""Ledger tables: columns, key, and which row wins when a key repeats.

Every table is append-only. A table's view keeps one row per key: the first one written
("first": facts that never change, e.g. a checkpoint) or the last ("last": settings a
person may change, e.g. an experiment's primary metric). State changes are their own
rows (job_states, run_states), so history is never overwritten.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")
S = pa.string()
F = pa.float64()
I = pa.int64()
B = pa.bool_()


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[tuple[str, pa.DataType], ...]
    key: tuple[str, ...]
    keep: str = "first"  # or "last"
    order: str = "_commit"  # column that orders rows of one key

    @property
    def schema(self) -> pa.Schema:
        return pa.schema(list(self.columns))


TABLES: dict[str, Table] = {
    t.name: t
    for t in [
        Table("projects", (("project", S), ("primary_metric", S), ("primary_mode", S), ("created_at", TS)), ("project",), "last"),
        Table(
            "experiments",
            (("experiment", S), ("project", S), ("primary_metric", S), ("primary_mode", S), ("created_at", TS)),
            ("experiment",),
            "last",
        ),
        Table(
            "jobs",
            (
                ("job_id", S), ("template", S), ("template_version", I), ("kind", S), ("experiment", S),
                ("project", S), ("placement", S), ("max_interruptions", I), ("created_at", TS),
            ),
            ("job_id",),
        ),
        Table(
            "job_states",
            (("job_id", S), ("attempt", I), ("state", S), ("reason", S), ("failure_class", S), ("detail", S), ("ts", TS)),
            ("job_id", "attempt", "state"),
        ),
        Table(
            "bundles",
            (("bundle_hash", S), ("job_id", S), ("attempt", I), ("path", S), ("template_id", S), ("provenance", S), ("created_at", TS)),
            ("bundle_hash", "job_id"),
        ),
        Table(
            "runs",
            (
                ("run_id", S), ("job_id", S), ("attempt", I), ("bundle_hash", S), ("dagster_run_id", S),
                ("instance_id", S), ("provider", S), ("offer_id", S), ("resume_from", S), ("handle", S),
                ("imported", B), ("experiment", S), ("project", S), ("started_at", TS),
            ),
            ("run_id",),
        ),
        Table(
            "run_states",
            (("run_id", S), ("state", S), ("exit_code", I), ("failure_class", S), ("reason", S), ("ts", TS)),
            ("run_id", "state"),
        ),
        Table(
            "instances",
            (
                ("instance_id", S), ("provider", S), ("offer_id", S), ("instance_type", S), ("gpu", S),
                ("gpu_count", I), ("region", S), ("zone", S), ("usd_per_second", F), ("spot", B),
                ("purpose", S), ("job_id", S), ("run_id", S), ("checkpoint_key", S), ("gpu_slots", S),
                ("handle", S), ("started_at", TS),
            ),
            ("instance_id",),
        ),
        Table("instance_stops", (("instance_id", S), ("stopped_at", TS), ("reason", S)), ("instance_id",)),
        Table(
            "checkpoints",
            (
                ("checkpoint_key", S), ("job_id", S), ("run_id", S), ("attempt", I), ("step", I), ("tier", S),
                ("parent_key", S), ("uri", S), ("sha256", S), ("bytes", I), ("weights_sha256", S),
                ("train_loss", F), ("save_seconds", F), ("created_at", TS), ("registered_at", TS),
            ),
            ("checkpoint_key",),
        ),
        Table("checkpoint_deletions", (("checkpoint_key", S), ("reason", S), ("ts", TS)), ("checkpoint_key",)),
        Table(
            "evaluations",
            (
                ("checkpoint_key", S), ("suite", S), ("job_id", S), ("metrics", S), ("instance_id", S),
                ("dagster_run_id", S), ("seconds", F), ("created_at", TS),
            ),
            ("checkpoint_key", "suite"),
            "last",
        ),
        Table(
            "metric_points",
            (
                ("job_id", S), ("run_id", S), ("checkpoint_key", S), ("step", I), ("name", S), ("value", F),
                ("source", S), ("ts", TS),
            ),
            ("run_id", "source", "name", "step", "checkpoint_key"),
        ),
        Table(
            "events",
            (("event_id", S), ("ts", TS), ("kind", S), ("job_id", S), ("run_id", S), ("instance_id", S), ("detail", S)),
            ("event_id",),
        ),
        Table(
            "price_ticks",
            (("offer_id", S), ("ts", TS), ("usd_per_hour_spot", F), ("usd_per_hour_on_demand", F), ("source", S)),
            ("offer_id", "ts"),
        ),
        Table(
            "costs",
            (
                ("cost_id", S), ("instance_id", S), ("job_id", S), ("run_id", S), ("attempt", I),
                ("checkpoint_key", S), ("kind", S), ("start_ts", TS), ("end_ts", TS), ("seconds", F),
                ("usd_per_second", F), ("usd", F),
            ),
            ("cost_id",),
        ),
        Table(
            "best_checkpoints",
            (
                ("experiment", S), ("checkpoint_key", S), ("metric_name", S), ("metric_mode", S),
                ("metric_value", F), ("metric_source", S), ("candidates", I), ("evaluations", I),
                ("computed_at", TS),
            ),
            ("experiment", "computed_at"),
        ),
        Table(
            "decisions",
            (("decision_id", S), ("job_id", S), ("attempt", I), ("kind", S), ("chosen", S), ("runner_up", S), ("inputs", S), ("ts", TS)),
            ("decision_id",),
        ),
    ]
}

# Views over the tables, for people and for the code. Plain SQL: `orbit sql` and `duckdb
# <ledger file>` see the same names.
VIEWS: dict[str, str] = {
    # Who a checkpoint belongs to: a job, or a run imported without one.
    "owners": """
        SELECT job_id, experiment, project, false AS imported FROM jobs
        UNION ALL
        SELECT job_id, any_value(experiment), any_value(project), true FROM runs
        WHERE imported AND job_id NOT IN (SELECT job_id FROM jobs) GROUP BY job_id""",
    "job_status": """
        SELECT j.*, s.state, s.attempt, s.reason, s.failure_class, s.detail, s.ts AS state_ts
        FROM jobs j
        LEFT JOIN (
            SELECT * FROM job_states QUALIFY row_number() OVER (PARTITION BY job_id ORDER BY ts DESC, _commit DESC) = 1
        ) s USING (job_id)""",
    "run_status": """
        SELECT r.*, s.state, s.exit_code, s.failure_class, s.reason, s.ts AS state_ts
        FROM runs r
        LEFT JOIN (
            SELECT * FROM run_states QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY ts DESC, _commit DESC) = 1
        ) s USING (run_id)""",
    "instance_usage": """
        SELECT i.*, x.stopped_at, x.reason AS stop_reason,
               epoch(coalesce(x.stopped_at, now()) - i.started_at) AS seconds,
               epoch(coalesce(x.stopped_at, now()) - i.started_at) * i.usd_per_second AS usd,
               x.stopped_at IS NULL AS running
        FROM instances i LEFT JOIN instance_stops x USING (instance_id)""",
    "live_checkpoints": """
        SELECT c.* FROM checkpoints c ANTI JOIN checkpoint_deletions d USING (checkpoint_key)""",
    "cost_by_job": """
        SELECT c.job_id, j.experiment, j.project,
               sum(c.usd) AS usd, sum(c.seconds) AS instance_seconds,
               sum(c.usd) FILTER (WHERE c.kind = 'wasted') AS wasted_usd,
               sum(c.seconds * greatest(i.gpu_count, 1)) FILTER (WHERE c.kind = 'wasted') AS wasted_gpu_seconds,
               sum(c.usd) FILTER (WHERE c.kind = 'eval') AS eval_usd,
               count(DISTINCT c.attempt) FILTER (WHERE c.kind <> 'eval') AS attempts
        FROM costs c LEFT JOIN owners j USING (job_id) LEFT JOIN instances i USING (instance_id)
        GROUP BY ALL ORDER BY usd DESC""",
    "cost_by_experiment": """
        SELECT experiment, project, sum(usd) AS usd, sum(wasted_usd) AS wasted_usd,
               sum(wasted_gpu_seconds) AS wasted_gpu_seconds, count(*) AS jobs
        FROM cost_by_job GROUP BY ALL ORDER BY usd DESC""",
    "cost_by_checkpoint": """
        SELECT c.checkpoint_key, any_value(c.job_id) AS job_id,
               sum(c.usd) FILTER (WHERE c.kind = 'train') AS train_usd,
               sum(c.usd) FILTER (WHERE c.kind = 'eval') AS eval_usd,
               sum(c.usd) AS usd, sum(c.seconds) AS seconds
        FROM costs c WHERE c.checkpoint_key IS NOT NULL
        GROUP BY c.checkpoint_key ORDER BY c.checkpoint_key""",
    "current_best": """
        SELECT * FROM best_checkpoints
        QUALIFY row_number() OVER (PARTITION BY experiment ORDER BY computed_at DESC, _commit DESC) = 1""",
}
