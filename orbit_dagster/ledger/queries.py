"""Read-side queries as pandas DataFrames: what `orbit status/cost` show, for notebooks too.

    from orbit_dagster.ledger.queries import status, cost_table
    from orbit_dagster.settings import Settings
    ledger = Settings.from_env().ledger()   # the ledger of $ORBIT_HOME (default ./.orbit)
    status(ledger); cost_table(ledger, "checkpoint"); ledger.query("SELECT * FROM current_best")

These answer from the store's indexes; `ledger.query()` runs any read-only SELECT through
the DuckDB face, within its limits (`limits.py`: a 60 s timeout, 1 GiB of memory, a bounded
spill in the ledger's `tmp/`, from ORBIT_SQL_TIMEOUT_S, ORBIT_SQL_MEMORY, ...: the settings');
`sql(ledger, query, limits=settings.sql_limits(timeout_s=...))` sets them for one query.
This module reads no settings: it is given a Ledger (the ledger never imports the settings).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.errors import NotFound, OrbitError
from .efficiency import efficiency_query
from .store import Ledger

if TYPE_CHECKING:  # pandas is imported by Ledger.frame when a frame is made: every run worker
    import pandas as pd  # and CLI call imports this module, most never make one (0.4 s each)

    from .limits import SqlLimits

COST_VIEWS = {"job": "cost_by_job", "experiment": "cost_by_experiment", "checkpoint": "cost_by_checkpoint",
              "provider": "cost_efficiency", "node": "cost_by_node"}
COST_ORDER = {"job": "usd DESC, job_id", "experiment": "usd DESC, experiment", "checkpoint": "job_id, line",
              "node": "job_id, attempt, node_rank"}


def sql(ledger: Ledger, query: str, *, limits: "SqlLimits | None" = None) -> pd.DataFrame:
    """One read-only SELECT through the DuckDB face within `limits` (`Settings.sql_limits(...)`;
    default the ledger's own). A query past a limit is an OrbitError naming it."""
    # lazy: face.py brings duckdb and pandas (1 s or more); `orbit status` and `orbit cost` import this module
    # and run no SQL query
    from .face import face_query

    return face_query(ledger, query, limits)


def status(ledger: Ledger, job_id: str | None = None) -> pd.DataFrame:
    where, params = ("WHERE j.job_id = ?", [job_id]) if job_id else ("", [])
    frame = ledger.frame(
        f"""
        SELECT j.job_id, j.experiment, j.state, j.attempt, j.failure_class, j.reason,
               (SELECT count(*) FROM checkpoints c WHERE c.job_id = j.job_id AND c.deleted_at IS NULL) AS checkpoints,
               (SELECT max(step) FROM checkpoints c WHERE c.job_id = j.job_id) AS last_step,
               (SELECT count(*) FROM evaluations e WHERE e.job_id = j.job_id AND e.state = 'SUCCEEDED') AS evaluations,
               (SELECT coalesce(sum(usd), 0) FROM costs k WHERE k.job_id = j.job_id) AS usd,
               CASE WHEN j.imported = 1 THEN 'imported' ELSE j.template END AS source,
               j.created_at
        FROM jobs j {where} ORDER BY j.created_at, j.job_id""",
        params,
    )
    # Rounded here, not in SQL: PostgreSQL has no round(double precision, int).
    frame["usd"] = frame["usd"].astype(float).round(6)
    return frame


def checkpoints(ledger: Ledger, job_id: str) -> pd.DataFrame:
    frame = ledger.frame(
        """
        SELECT c.checkpoint_key, c.attempt, c.lineage, c.step, c.tier, c.parent_key, c.bytes,
               c.train_loss,
               (SELECT max(m.value) FROM metric_points m WHERE m.checkpoint_key = c.checkpoint_key
                  AND m.source = 'eval' AND m.name = 'eval/loss') AS eval_loss,
               (SELECT max(m.value) FROM metric_points m WHERE m.checkpoint_key = c.checkpoint_key
                  AND m.source = 'eval' AND m.name = 'eval/accuracy') AS eval_accuracy,
               CASE WHEN c.deleted_at IS NULL THEN 0 ELSE 1 END AS deleted
        FROM checkpoints c WHERE c.job_id = ? ORDER BY c.attempt, c.step""",
        [job_id],
    )
    frame["train_loss"] = frame["train_loss"].astype(float).round(4)  # not in SQL: see status()
    return frame


def cost_table(ledger: Ledger, by: str = "job", *, experiment: str | None = None,
               job: str | None = None) -> pd.DataFrame:
    """Cost attribution by job, experiment, checkpoint, provider (`cost_efficiency`: per provider,
    offer and GPU model, through the DuckDB face) or node (each training instance per attempt: a
    group's nodes on their own lines), of everything or of one experiment or job; every table
    sums to the bill of what it covers (`billed_usd` with the same filter; by node, of the
    training instances: `purpose="train"`)."""
    if by not in COST_VIEWS:
        raise OrbitError(f"cannot group cost by {by!r}", field="--by", value=by, fix=f"use one of: {', '.join(COST_VIEWS)}")
    if job is not None and by == "experiment":
        raise OrbitError("a job's cost cannot be grouped by experiment", field="--by", value=by,
                         fix="use --by job or --by checkpoint with --job")
    for table, column, value in (("experiments", "experiment", experiment), ("jobs", "job_id", job)):
        if value is not None and ledger.scalar(f"SELECT count(*) FROM {table} WHERE {column} = ?", [value]) == 0:
            raise NotFound(f"no {column} {value!r} in the ledger", field=column, value=value,
                           fix=f"list them with `orbit sql \"SELECT {column} FROM {table}\"`")
    if by == "provider":
        return cost_efficiency(ledger, experiment=experiment, job=job)
    where, params = _cost_filter(experiment, job)
    return ledger.frame(f"SELECT * FROM {COST_VIEWS[by]} {where} ORDER BY {COST_ORDER[by]}", params)


def cost_efficiency(ledger: Ledger, *, experiment: str | None = None, job: str | None = None,
                    limits: "SqlLimits | None" = None) -> pd.DataFrame:
    """Per provider, offer and GPU model: hours, $ paid and wasted, effective TFLOP-hours, $ per
    effective TFLOP-hour, interruptions per hour, recovery overhead (`efficiency.py` says how
    each is measured), cheapest effective compute first; sums to `billed_usd` with the same filter."""
    return sql(ledger, efficiency_query(experiment=experiment, job=job), limits=limits)


def _cost_filter(experiment: str | None, job: str | None) -> tuple[str, list]:
    terms = [(c, v) for c, v in (("experiment", experiment), ("job_id", job)) if v is not None]
    return ("WHERE " + " AND ".join(f"{c} = ?" for c, _ in terms) if terms else "", [v for _, v in terms])


def _instances_where(experiment: str | None, job: str | None, stopped: bool,
                     purpose: str | None = None) -> tuple[str, list]:
    """Stopped (billed) or running instances, of one experiment's or job's when given (its
    evaluations' instances included: they carry the evaluated checkpoint's job), of one purpose
    (`train`, `eval`) when given."""
    terms, params = [f"stopped_at IS {'NOT ' if stopped else ''}NULL"], []
    if purpose is not None:
        terms.append("purpose = ?")
        params.append(purpose)
    if experiment is not None:
        terms.append("job_id IN (SELECT job_id FROM jobs WHERE experiment = ?)")
        params.append(experiment)
    if job is not None:
        terms.append("job_id = ?")
        params.append(job)
    return "WHERE " + " AND ".join(terms), params


def billed_usd(ledger: Ledger, *, experiment: str | None = None, job: str | None = None,
               purpose: str | None = None) -> float:
    """What the providers billed: every stopped instance, start to stop, at its price (of one
    experiment's or job's instances, of one purpose, when given)."""
    where, params = _instances_where(experiment, job, stopped=True, purpose=purpose)
    return float(ledger.scalar(f"SELECT coalesce(sum(billed_usd), 0) FROM instances {where}", params) or 0.0)


def running_instances(ledger: Ledger, *, experiment: str | None = None, job: str | None = None,
                      purpose: str | None = None) -> int:
    """Instances not yet stopped, so not yet billed (of one experiment or job, of one purpose, when given)."""
    where, params = _instances_where(experiment, job, stopped=False, purpose=purpose)
    return int(ledger.scalar(f"SELECT count(*) FROM instances {where}", params) or 0)


def best(ledger: Ledger, experiment: str) -> pd.DataFrame:
    return ledger.frame("SELECT * FROM current_best WHERE experiment = ?", [experiment])
