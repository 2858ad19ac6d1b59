"""Evaluation backfill: every checkpoint still missing its suite's results gets a run.

The evaluation sensor handles new checkpoints as they come; this schedule sweeps up the
rest (a suite added to a template later, evaluations that gave up while a provider was
down). There is no public API to launch a backfill from a schedule, so it yields one run
request per partition, keyed by checkpoint and day (one sweep a day per checkpoint).
"""
import dagster as dg

from ..jobs import eval_job
from ..resources import OrbitResource
from ..sensors.evaluations import unevaluated

BACKFILL_BATCH = 200


@dg.schedule(job=eval_job, cron_schedule="30 */6 * * *", execution_timezone="UTC",
             default_status=dg.DefaultScheduleStatus.RUNNING,
             description="Evaluates every checkpoint that has no result for its suite yet.")
def eval_backfill_schedule(context: dg.ScheduleEvaluationContext, orbit: OrbitResource):
    day = context.scheduled_execution_time.strftime("%Y-%m-%d")
    rows = unevaluated(orbit.settings().ledger(), limit=BACKFILL_BATCH)
    if not rows:
        return dg.SkipReason("every checkpoint has its evaluation")
    return [dg.RunRequest(run_key=f"backfill:{r['checkpoint_key']}:{day}", partition_key=r["checkpoint_key"],
                          tags={"orbit/job": r["job_id"], "orbit/checkpoint": r["checkpoint_key"], "orbit/backfill": day})
            for r in rows]
