"""Read-side queries as pandas DataFrames: what `orbit status/cost` show, for notebooks too.

    from orbit_dagster.ledger.queries import open_ledger, status, cost_table
    ledger = open_ledger()            # the ledger of $ORBIT_HOME (default ./.orbit)
    status(ledger); cost_table(ledger, "checkpoint"); ledger.query("SELECT * FROM current_best")

These answer from the store's indexes; `ledger.query()` runs any read-only SELECT through
the DuckDB face.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..core.errors import OrbitError
from .store import Ledger

COST_VIEWS = {"job": "cost_by_job", "experiment": "cost_by_experiment", "checkpoint": "cost_by_checkpoint"}
COST_ORDER = {"job": "usd DESC, job_id", "experiment": "usd DESC, experiment", "checkpoint": "job_id, line"}


def open_ledger(home: str | Path | None = None) -> Ledger:
    from ..control.settings import Settings

    return Settings.from_env(home).ledger()


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
    return ledger.frame(
        """
        SELECT c.checkpoint_key, c.attempt, c.lineage, c.step, c.tier, c.parent_key, c.bytes,
               round(c.train_loss, 4) AS train_loss,
               (SELECT max(m.value) FROM metric_points m WHERE m.checkpoint_key = c.checkpoint_key
                  AND m.source = 'eval' AND m.name = 'eval/loss') AS eval_loss,
               (SELECT max(m.value) FROM metric_points m WHERE m.checkpoint_key = c.checkpoint_key
                  AND m.source = 'eval' AND m.name = 'eval/accuracy') AS eval_accuracy,
               CASE WHEN c.deleted_at IS NULL THEN 0 ELSE 1 END AS deleted
        FROM checkpoints c WHERE c.job_id = ? ORDER BY c.attempt, c.step""",
        [job_id],
    )


def cost_table(ledger: Ledger, by: str = "job") -> pd.DataFrame:
    """Cost attribution by job, experiment or checkpoint; every table sums to the bill."""
    if by not in COST_VIEWS:
        raise OrbitError(f"cannot group cost by {by!r}", field="--by", value=by, fix=f"use one of: {', '.join(COST_VIEWS)}")
    return ledger.frame(f"SELECT * FROM {COST_VIEWS[by]} ORDER BY {COST_ORDER[by]}")


def billed_usd(ledger: Ledger) -> float:
    """What the providers billed: every stopped instance, start to stop, at its price."""
    return float(ledger.scalar("SELECT coalesce(sum(billed_usd), 0) FROM instances WHERE stopped_at IS NOT NULL") or 0.0)


def best(ledger: Ledger, experiment: str) -> pd.DataFrame:
    return ledger.frame("SELECT * FROM current_best WHERE experiment = ?", [experiment])
