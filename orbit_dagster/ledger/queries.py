"""Read-side queries as pandas DataFrames: what `orbit status/cost/best` show, for notebooks too.

    from orbit_dagster.ledger.queries import open_ledger, status, cost_table
    ledger = open_ledger()            # $ORBIT_HOME/ledger, else ./.orbit/ledger
    status(ledger); cost_table(ledger, "checkpoint"); ledger.query("select * from job_status")
"""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from ..core.errors import OrbitError
from .store import Ledger

COST_VIEWS = {"job": "cost_by_job", "experiment": "cost_by_experiment", "checkpoint": "cost_by_checkpoint"}


def open_ledger(home: str | Path | None = None) -> Ledger:
    root = Path(home or os.environ.get("ORBIT_HOME") or ".orbit").expanduser()
    return Ledger.open(root / "ledger")


def status(ledger: Ledger, job_id: str | None = None) -> pd.DataFrame:
    where, params = ("WHERE s.job_id = ?", [job_id]) if job_id else ("", [])
    return ledger.query(
        f"""
        SELECT s.job_id, s.experiment, s.state, s.attempt, s.failure_class, s.reason,
               (SELECT count(*) FROM live_checkpoints c WHERE c.job_id = s.job_id) AS checkpoints,
               (SELECT max(step) FROM checkpoints c WHERE c.job_id = s.job_id) AS last_step,
               (SELECT count(*) FROM evaluations e WHERE e.job_id = s.job_id) AS evaluations,
               (SELECT round(sum(usd), 6) FROM costs k WHERE k.job_id = s.job_id) AS usd,
               s.created_at
        FROM job_status s {where} ORDER BY s.created_at""",
        params,
    )


def checkpoints(ledger: Ledger, job_id: str) -> pd.DataFrame:
    return ledger.query(
        """
        SELECT c.checkpoint_key, c.attempt, c.step, c.tier, c.parent_key, c.bytes, round(c.train_loss, 4) AS train_loss,
               json_extract_string(e.metrics, '$."eval/loss"')::DOUBLE AS eval_loss,
               json_extract_string(e.metrics, '$."eval/accuracy"')::DOUBLE AS eval_accuracy,
               d.checkpoint_key IS NOT NULL AS deleted
        FROM checkpoints c LEFT JOIN evaluations e USING (checkpoint_key)
        LEFT JOIN checkpoint_deletions d USING (checkpoint_key)
        WHERE c.job_id = ? ORDER BY c.step""",
        [job_id],
    )


def cost_table(ledger: Ledger, by: str = "job") -> pd.DataFrame:
    if by not in COST_VIEWS:
        raise OrbitError(f"cannot group cost by {by!r}", field="--by", value=by, fix=f"use one of: {', '.join(COST_VIEWS)}")
    return ledger.query(f"SELECT * FROM {COST_VIEWS[by]}")


def best(ledger: Ledger, experiment: str) -> pd.DataFrame:
    return ledger.query("SELECT * EXCLUDE (_commit) FROM current_best WHERE experiment = ?", [experiment])


def sql(ledger: Ledger, query: str) -> pd.DataFrame:
    return ledger.query(query)
