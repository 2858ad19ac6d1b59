"""Evaluation backfill: the (checkpoint, suite) pairs that still want an evaluation.

New checkpoints are evaluated as they come (PENDING rows, the evaluation sensor). The
backfill sweeps up the rest: live checkpoints of evaluable jobs without a result for their
job's current suite (a suite whose version was raised, a checkpoint registered when its job
had no suite) and evaluations that FAILED long enough ago to try again. They are marked
BACKFILL (the sensor leaves them to the backfill) and evaluated by one Dagster backfill per
suite; a BACKFILL row whose backfill never ran is handed back to the sensor after a day.
"""
from __future__ import annotations

import time

from ..core.bundle import JobBundle
from ..ledger import utcnow
from ..settings import Settings

RETRY_FAILED_AFTER_S = 6 * 3600.0
STALE_BACKFILL_S = 24 * 3600.0


def current_suites(settings: Settings) -> dict[str, str]:
    """job_id -> the suite its latest bundle evaluates with (evaluable jobs only)."""
    ledger = settings.ledger()
    suites = {}
    for row in ledger.rows("""SELECT b.job_id, b.path FROM bundles b WHERE b.attempt =
                              (SELECT max(x.attempt) FROM bundles x WHERE x.job_id = b.job_id)"""):
        template = JobBundle.load(row["path"], verify=False).spec.template
        if template.eval is not None:
            suites[row["job_id"]] = template.eval.suite_id
    return suites


def plan_backfill(settings: Settings, *, limit: int = 2000) -> dict[str, list[str]]:
    """Mark what wants a backfill (BACKFILL) and return it: suite -> checkpoint keys."""
    ledger = settings.ledger()
    now = time.time()
    with ledger.write() as tx:
        tx.execute("UPDATE evaluations SET state = 'PENDING' WHERE state = 'BACKFILL' AND requested_at < ?",
                   [now - STALE_BACKFILL_S])
        tx.execute("""UPDATE evaluations SET state = 'BACKFILL', tries = 0, requested_at = ?
                      WHERE state = 'FAILED' AND finished_at < ? AND checkpoint_key IN
                      (SELECT checkpoint_key FROM checkpoints WHERE deleted_at IS NULL)""",
                   [utcnow(), now - RETRY_FAILED_AFTER_S])
    for job_id, suite in current_suites(settings).items():
        missing = ledger.rows(
            """SELECT c.checkpoint_key, c.job_id, c.experiment FROM checkpoints c WHERE c.job_id = ?
               AND c.deleted_at IS NULL AND NOT EXISTS (SELECT 1 FROM evaluations e
               WHERE e.checkpoint_key = c.checkpoint_key AND e.suite = ?)""", [job_id, suite])
        ledger.commit({"evaluations": [{**m, "suite": suite, "state": "BACKFILL", "tries": 0, "requested_at": utcnow()}
                                       for m in missing]})
    planned: dict[str, list[str]] = {}
    for row in ledger.rows("""SELECT e.suite, e.checkpoint_key FROM evaluations e
                              JOIN checkpoints c ON c.checkpoint_key = e.checkpoint_key
                              WHERE e.state = 'BACKFILL' AND c.deleted_at IS NULL
                              ORDER BY e.requested_at LIMIT ?""", [limit]):
        planned.setdefault(row["suite"], []).append(row["checkpoint_key"])
    return planned
