"""Evaluation backfill: every (checkpoint, suite) still waiting for its evaluation gets a run.

The evaluation sensor handles new checkpoints as they come; this schedule sweeps up the
rest (evaluations that gave up while a provider was down and were given back). Its run keys
are the sensor's (`eval:<checkpoint>:<suite>:try-<n>`), and the ledger's claim lets only one
run evaluate a pair at a time.
"""
import dagster as dg

from ..control.evaluate import pending_evaluations
from ..jobs import eval_job
from ..profiles import job_pools, pool_tags
from ..resources import OrbitResource
from ..sensors.evaluations import eval_request

BACKFILL_BATCH = 200


@dg.schedule(job=eval_job, cron_schedule="30 */6 * * *", execution_timezone="UTC",
             default_status=dg.DefaultScheduleStatus.RUNNING,
             description="Evaluates every checkpoint that has no result for its suite yet.")
def eval_backfill_schedule(context: dg.ScheduleEvaluationContext, orbit: OrbitResource):
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    ledger = orbit.settings().ledger()
    rows = pending_evaluations(ledger, BACKFILL_BATCH)
    if not rows:
        return dg.SkipReason("every checkpoint has its evaluation")
    pools = job_pools(ledger, [r["job_id"] for r in rows])
    return [eval_request(r, **{"orbit/backfill": day}, **pool_tags(pools.get(r["job_id"]), "eval")) for r in rows]
