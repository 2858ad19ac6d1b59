"""Best checkpoint per experiment by its primary metric, with the checkpoint's lineage.

Reading the best (`compute_best`, `orbit best`) never writes; the `best_checkpoint` asset
records it (`record_best`). Candidates are the experiment's live checkpoints of each job's
current lineage (a retry from scratch or with another config supersedes the old weights),
unless the caller asks for `lineage="all"` or one lineage by id. A checkpoint's evaluation
value is its most recent evaluation's (`eval_latest`, kept on write by the ledger).
"""
from __future__ import annotations

from ..core.config_schema import show
from ..core.errors import NotFound, OrbitError
from ..core.metrics import BestChoice, Candidate, resolve_primary_metric, training_counterpart
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..settings import Settings


def set_primary_metric(ledger: Ledger, *, name: str, mode: str, experiment: str | None = None,
                       project: str | None = None) -> None:
    """A person's choice of primary metric for an experiment or a project (exactly one)."""
    if (experiment is None) == (project is None):
        raise OrbitError("give an experiment or a project, not both", field="--experiment/--project",
                         fix="orbit metric set eval/loss min --project P")
    if mode not in ("min", "max"):
        raise OrbitError(f"mode {show(mode)} is not min or max", field="mode", value=mode, fix="min or max")
    if not isinstance(name, str) or not name.strip() or len(name) > 200 or not name.isprintable():
        raise OrbitError(f"metric name {show(name)} is not valid", field="name", value=name,
                         fix="1 to 200 printable characters, e.g. eval/loss")
    table, key, value = ("experiments", "experiment", experiment) if experiment else ("projects", "project", project)
    with ledger.write() as tx:
        if not tx.one(f"SELECT 1 AS x FROM {table} WHERE {key} = ?", [value]):
            raise NotFound(f"no {key} {show(value)}", field=key, value=value,
                           fix=f"list them with `orbit sql \"SELECT {key} FROM {table}\"`")
        tx.execute(f"UPDATE {table} SET primary_metric = ?, primary_mode = ?, updated_at = ? WHERE {key} = ?",
                   [name, mode, utcnow(), value])
        tx.insert("events", [R.event("primary_metric_set", **{key: value}, name=name, mode=mode)])


def primary_metric_for(ledger: Ledger, experiment: str):
    exp = ledger.one("SELECT * FROM experiments WHERE experiment = ?", [experiment])
    if exp is None:
        raise NotFound(f"no experiment {experiment!r}", field="experiment", value=experiment,
                       fix="list experiments with `orbit sql \"SELECT * FROM experiments\"`")
    proj = ledger.one("SELECT * FROM projects WHERE project = ?", [exp["project"]])
    chosen = (exp["primary_metric"], exp["primary_mode"])
    of_project = (proj["primary_metric"], proj["primary_mode"]) if proj else None
    of_template = (exp["template_metric"], exp["template_mode"])
    # The metrics evaluated so far matter only when nobody named one (the global default);
    # asked only then: in a large experiment they are a scan of its index.
    named = any(pair and pair[0] for pair in (chosen, of_project, of_template))
    names = [] if named else [r["name"] for r in ledger.rows(
        "SELECT DISTINCT name FROM eval_latest WHERE experiment = ?", [experiment])]
    return resolve_primary_metric(chosen, of_project, names, template=of_template)


# The lineage scope as SQL over a row `c` with a lineage and its job `j`: parameters
# (scope, scope, scope). `current`: each job's current lineage; `all`; or one lineage id.
_SCOPE = "(? = 'all' OR (? = 'current' AND c.lineage = j.lineage) OR c.lineage = ?)"
# Finite: NULL, NaN (PostgreSQL orders it above every number) and infinities never compete.
_FINITE = "BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308"


def candidates(ledger: Ledger, experiment: str, metric: str, *, lineage: str = "current") -> list[Candidate]:
    """Every candidate checkpoint with its latest value of `metric` (the asset's input table)."""
    rows = ledger.rows(
        f"""SELECT c.checkpoint_key, c.step, c.train_loss, l.value AS eval_value
            FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id
            LEFT JOIN eval_latest l ON l.checkpoint_key = c.checkpoint_key AND l.name = ?
            WHERE c.experiment = ? AND c.deleted_at IS NULL AND {_SCOPE}""",
        [metric, experiment, lineage, lineage, lineage],
    )
    train_ok = training_counterpart(metric) == "train/loss"
    return [Candidate(r["checkpoint_key"], int(r["step"]), r["eval_value"], r["train_loss"] if train_ok else None)
            for r in rows]


def rank_best(ledger: Ledger, experiment: str, metric: str, mode: str, *, lineage: str = "current") -> BestChoice | None:
    """`pick_best` over `candidates`, answered by the database: the best value through
    eval_latest's index in metric order (stopping at the first candidate of the lineage),
    then the checkpoints tied at it by step and key, and a count from the same index;
    training values only when no checkpoint has an evaluation. The same choice and count
    as `pick_best` (tests/unit/ledger/test_rollups.py)."""
    order = "ASC" if mode == "min" else "DESC"
    scope = [lineage, lineage, lineage]
    # (source, its value, FROM, WHERE, parameters)
    sources = (
        # eval_latest carries each checkpoint's lineage and deletion: no checkpoint row is read
        # but the tied ones' (their step).
        ("eval", "c.value", "eval_latest c JOIN jobs j ON j.job_id = c.job_id",
         f"c.experiment = ? AND c.name = ? AND c.deleted = 0 AND {_SCOPE}", [experiment, metric, *scope]),
        ("train", "c.train_loss", "checkpoints c JOIN jobs j ON j.job_id = c.job_id",
         f"c.experiment = ? AND c.deleted_at IS NULL AND {_SCOPE}", [experiment, *scope]),
    )
    with ledger.read() as tx:  # the choice and its count from one snapshot
        for source, value, tables, where, params in sources:
            if source == "train" and training_counterpart(metric) != "train/loss":
                return None
            finite = f"FROM {tables} WHERE {where} AND {value} {_FINITE}"
            # Two steps, each an index walk that stops early: one ORDER BY over value, step and
            # key makes the database read and sort every candidate.
            best_value = tx.scalar(f"SELECT {value} {finite} ORDER BY {value} {order} LIMIT 1", params)
            if best_value is None:
                continue
            best = tx.one(f"""SELECT c.checkpoint_key FROM {tables} JOIN checkpoints k ON k.checkpoint_key = c.checkpoint_key
                              WHERE {where} AND {value} = ? ORDER BY k.step, k.checkpoint_key LIMIT 1""",
                          [*params, best_value])
            return BestChoice(best["checkpoint_key"], float(best_value), source,  # type: ignore[index]
                              int(tx.scalar(f"SELECT count(*) {finite}", params)))
    return None


def lineage_chain(ledger: Ledger, checkpoint_key: str) -> list[dict]:
    """The resume chain of a checkpoint, newest first, across attempts."""
    chain, seen, key = [], set(), checkpoint_key
    job_id = checkpoint_key.split("/")[0]
    by_key = {r["checkpoint_key"]: r for r in ledger.rows(
        "SELECT checkpoint_key, parent_key, attempt, lineage, step, tier, sha256 FROM checkpoints WHERE job_id = ?",
        [job_id])}
    while key and key in by_key and key not in seen:
        seen.add(key)
        chain.append(by_key[key])
        key = by_key[key]["parent_key"]
    return chain


def compute_best(settings: Settings, experiment: str, *, lineage: str = "current") -> dict | None:
    """The best checkpoint of an experiment now (reads only)."""
    ledger = settings.ledger()
    pm = primary_metric_for(ledger, experiment)
    choice = rank_best(ledger, experiment, pm.name, pm.mode, lineage=lineage)
    if choice is None:
        return None
    n_evals = int(ledger.scalar(
        "SELECT count(*) FROM evaluations WHERE experiment = ? AND state = 'SUCCEEDED'", [experiment]) or 0)
    return {
        "experiment": experiment, "checkpoint_key": choice.checkpoint_key,
        "metric_name": pm.name if choice.source == "eval" else training_counterpart(pm.name),
        "metric_mode": pm.mode, "metric_value": choice.value, "metric_source": choice.source,
        "primary_metric": pm.name, "resolved_from": pm.resolved_from, "candidates": choice.candidates,
        "evaluations": n_evals,
        "lineage_scope": lineage, "lineage": lineage_chain(ledger, choice.checkpoint_key),
    }


def record_best(settings: Settings, experiment: str) -> dict | None:
    """Compute the best checkpoint and record it (what the `best_checkpoint` asset does)."""
    best = compute_best(settings, experiment)
    if best is not None:
        settings.ledger().commit({"best_checkpoints": [{
            "experiment": experiment, "computed_at": utcnow(), "checkpoint_key": best["checkpoint_key"],
            "metric_name": best["metric_name"], "metric_mode": best["metric_mode"],
            "metric_value": best["metric_value"], "metric_source": best["metric_source"],
            "resolved_from": best["resolved_from"], "candidates": best["candidates"],
            "evaluations": best["evaluations"]}]})
    return best
