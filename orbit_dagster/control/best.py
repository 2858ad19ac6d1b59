"""Best checkpoint per experiment by its primary metric, with the checkpoint's lineage."""
from __future__ import annotations

from ..core.metrics import Candidate, pick_best, resolve_primary_metric, training_counterpart
from ..core.errors import NotFound
from ..ledger import Ledger, utcnow
from .settings import Settings


def primary_metric_for(ledger: Ledger, experiment: str):
    exp = ledger.rows("SELECT * FROM experiments WHERE experiment = ?", [experiment])
    if not exp:
        raise NotFound(f"no experiment {experiment!r}", field="experiment", value=experiment,
                       fix="list experiments with `orbit sql \"select * from experiments\"`")
    proj = ledger.rows("SELECT * FROM projects WHERE project = ?", [exp[0]["project"]])
    names = [r["name"] for r in ledger.rows(
        "SELECT DISTINCT m.name FROM metric_points m JOIN owners j USING (job_id) WHERE j.experiment = ?", [experiment])]
    return resolve_primary_metric(
        (exp[0]["primary_metric"], exp[0]["primary_mode"]),
        (proj[0]["primary_metric"], proj[0]["primary_mode"]) if proj else None,
        names,
    )


def candidates(ledger: Ledger, experiment: str, metric: str) -> list[Candidate]:
    rows = ledger.rows(
        """
        WITH ev AS (
            SELECT checkpoint_key, TRY_CAST(json_extract_string(metrics, '$."' || ? || '"') AS DOUBLE) AS v
            FROM evaluations QUALIFY row_number() OVER (PARTITION BY checkpoint_key ORDER BY created_at DESC) = 1
        ), tr AS (
            SELECT checkpoint_key, value AS v FROM metric_points
            WHERE name = ? AND source = 'train' AND checkpoint_key IS NOT NULL
        )
        SELECT c.checkpoint_key, c.step, ev.v AS eval_value, coalesce(tr.v, c.train_loss) AS train_value
        FROM live_checkpoints c JOIN owners j USING (job_id)
        LEFT JOIN ev USING (checkpoint_key) LEFT JOIN tr USING (checkpoint_key)
        WHERE j.experiment = ?
        """,
        [metric, training_counterpart(metric), experiment],
    )
    return [Candidate(r["checkpoint_key"], int(r["step"]), r["eval_value"], r["train_value"]) for r in rows]


def lineage(ledger: Ledger, checkpoint_key: str) -> list[dict]:
    """The resume chain of a checkpoint, newest first, across attempts."""
    chain, seen, key = [], set(), checkpoint_key
    by_key = {r["checkpoint_key"]: r for r in ledger.rows(
        "SELECT checkpoint_key, parent_key, attempt, step, tier, sha256 FROM checkpoints WHERE job_id = ?",
        [checkpoint_key.split("/")[0]])}
    while key and key in by_key and key not in seen:
        seen.add(key)
        chain.append(by_key[key])
        key = by_key[key]["parent_key"]
    return chain


def compute_best(settings: Settings, experiment: str) -> dict | None:
    ledger = settings.ledger()
    pm = primary_metric_for(ledger, experiment)
    cands = candidates(ledger, experiment, pm.name)
    choice = pick_best(cands, pm.mode)
    if choice is None:
        return None
    n_evals = int(ledger.scalar(
        "SELECT count(*) FROM evaluations e JOIN owners j USING (job_id) WHERE j.experiment = ?", [experiment]) or 0)
    row = {
        "experiment": experiment, "checkpoint_key": choice.checkpoint_key,
        "metric_name": pm.name if choice.source == "eval" else training_counterpart(pm.name),
        "metric_mode": pm.mode, "metric_value": choice.value, "metric_source": choice.source,
        "candidates": choice.candidates, "evaluations": n_evals, "computed_at": utcnow(),
    }
    ledger.commit({"best_checkpoints": [row]})
    return {**row, "resolved_from": pm.resolved_from, "lineage": lineage(ledger, choice.checkpoint_key)}
