"""Totals kept up to date in the transaction that writes their facts.

`orbit cost` and `orbit best` must not get slower as history grows, so they do not
aggregate history when asked. Tables derived from the facts are read instead, each
rewritten, for the keys a write touched, inside that write's transaction (`Tx.insert`
calls `after_insert`), so they can never disagree with the facts a reader sees:

- `cost_lines` (one row per job and line: a checkpoint, or `(wasted)`/`(overhead)`) and
  `cost_jobs` (one row per job), from `costs` and the job's experiment and project; the
  cost views read them. A write
  recomputes the touched job's rows from its own cost lines (an index lookup), never
  adds increments, so a repeated or retried write cannot make them drift.
- `eval_latest`: each checkpoint's most recent evaluation value of each metric, from
  `metric_points`, with the checkpoint's lineage and whether it was deleted (retention
  calls `checkpoint_deleted` in its own transaction); `orbit best` ranks and counts an
  experiment's candidates through its index alone, in metric order.

Migration 2 fills them once from the facts of an existing ledger (`rebuild`); migration 3
rebuilds an `eval_latest` made before it carried lineage and deletion.
"""
from __future__ import annotations

from typing import Any, Iterable

_LINE = "coalesce(c.checkpoint_key, '(' || c.kind || ')')"
_USD_BY_KIND = """
    coalesce(sum(CASE WHEN c.kind = 'train' THEN c.usd END), 0),
    coalesce(sum(CASE WHEN c.kind = 'eval' THEN c.usd END), 0),
    coalesce(sum(CASE WHEN c.kind = 'wasted' THEN c.usd END), 0),
    coalesce(sum(CASE WHEN c.kind = 'overhead' THEN c.usd END), 0),
    coalesce(sum(c.usd), 0)"""


def _in(column: str, values: list) -> str:
    return f"{column} IN ({', '.join('?' for _ in values)})"


def refresh_costs(tx, job_ids: Iterable[str] | None = None) -> None:
    """Rewrite the cost totals of `job_ids` (all jobs when None) from their cost lines."""
    jobs = None if job_ids is None else sorted({j for j in job_ids if j is not None})
    if jobs == []:
        return
    params = jobs or []
    where = "" if jobs is None else f"WHERE {_in('c.job_id', jobs)}"
    for table in ("cost_lines", "cost_jobs"):
        tx.execute(f"DELETE FROM {table}" + ("" if jobs is None else f" WHERE {_in('job_id', jobs)}"), params)
    tx.execute(f"""
        INSERT INTO cost_lines (job_id, line, checkpoint_key, experiment, train_usd, eval_usd, wasted_usd,
                                overhead_usd, usd, seconds)
        SELECT c.job_id, {_LINE}, c.checkpoint_key, j.experiment, {_USD_BY_KIND}, coalesce(sum(c.seconds), 0)
        FROM costs c LEFT JOIN jobs j ON j.job_id = c.job_id {where}
        GROUP BY c.job_id, {_LINE}, c.checkpoint_key, j.experiment""", params)
    tx.execute(f"""
        INSERT INTO cost_jobs (job_id, experiment, project, train_usd, eval_usd, wasted_usd, overhead_usd, usd,
                               instance_seconds, wasted_gpu_seconds, attempts)
        SELECT c.job_id, j.experiment, j.project, {_USD_BY_KIND}, coalesce(sum(c.seconds), 0),
               coalesce(sum(CASE WHEN c.kind = 'wasted' THEN c.seconds * c.gpu_count END), 0),
               count(DISTINCT CASE WHEN c.kind <> 'eval' THEN c.attempt END)
        FROM costs c LEFT JOIN jobs j ON j.job_id = c.job_id {where}
        GROUP BY c.job_id, j.experiment, j.project""", params)


# A point's experiment (or its checkpoint's, when written without one), and its checkpoint's
# lineage and deletion: a checkpoint registered after its evaluation's points (an import
# writes both in one transaction) is caught up by `_checkpoints_registered`.
_LATEST_COLUMNS = """m.checkpoint_key, m.name, coalesce(m.experiment, k.experiment), m.job_id, k.lineage,
    CASE WHEN k.deleted_at IS NULL THEN 0 ELSE 1 END, m.value, m.ts, m.id"""
_FROM = "FROM metric_points m LEFT JOIN checkpoints k ON k.checkpoint_key = m.checkpoint_key"
_IS_LATEST = """m.id = (SELECT n.id FROM metric_points n
    WHERE n.checkpoint_key = m.checkpoint_key AND n.source = 'eval' AND n.name = m.name
    ORDER BY n.ts DESC, n.id DESC LIMIT 1)"""
_INSERT_LATEST = ("INSERT INTO eval_latest (checkpoint_key, name, experiment, job_id, lineage, deleted, value, ts, "
                  "point_id) ")


def refresh_eval_latest(tx, pairs: Iterable[tuple[str, str]] | None = None) -> None:
    """Rewrite the latest evaluation value of each (checkpoint_key, metric name) in `pairs`
    (every pair when None) from its metric points."""
    if pairs is None:
        tx.execute("DELETE FROM eval_latest")
        tx.execute(_INSERT_LATEST + f"""SELECT {_LATEST_COLUMNS} {_FROM}
            WHERE m.source = 'eval' AND m.checkpoint_key IS NOT NULL AND {_IS_LATEST}""")
        return
    for key, name in sorted(set(pairs)):
        tx.execute("DELETE FROM eval_latest WHERE checkpoint_key = ? AND name = ?", [key, name])
        tx.execute(_INSERT_LATEST + f"""SELECT {_LATEST_COLUMNS} {_FROM}
            WHERE m.checkpoint_key = ? AND m.source = 'eval' AND m.name = ? AND {_IS_LATEST}""", [key, name])


def _checkpoints_registered(tx, keys: list[str]) -> None:
    for key in sorted(set(keys)):
        tx.execute("""UPDATE eval_latest SET lineage = (SELECT lineage FROM checkpoints WHERE checkpoint_key = ?),
                      deleted = (SELECT CASE WHEN deleted_at IS NULL THEN 0 ELSE 1 END FROM checkpoints
                                 WHERE checkpoint_key = ?)
                      WHERE checkpoint_key = ?""", [key, key, key])


def checkpoint_deleted(tx, checkpoint_key: str) -> None:
    """Retention deleted a checkpoint (in `tx`): it no longer competes for best."""
    tx.execute("UPDATE eval_latest SET deleted = 1 WHERE checkpoint_key = ?", [checkpoint_key])


def after_insert(tx, table: str, rows: list[dict[str, Any]]) -> None:
    """Keep the totals derived from `table` in step with the rows just written to it."""
    if table in ("costs", "jobs"):  # a job's experiment and project are on its totals too
        refresh_costs(tx, [r.get("job_id") for r in rows])
    elif table == "checkpoints":
        _checkpoints_registered(tx, [r["checkpoint_key"] for r in rows if r.get("checkpoint_key")])
    elif table == "metric_points":
        pairs = [(r["checkpoint_key"], r["name"]) for r in rows
                 if r.get("source") == "eval" and r.get("checkpoint_key") and r.get("name")]
        if pairs:
            refresh_eval_latest(tx, pairs)


def rebuild(tx) -> None:
    """Fill every derived table from the facts (a migration, or a repair)."""
    refresh_costs(tx)
    refresh_eval_latest(tx)
