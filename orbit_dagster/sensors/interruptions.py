"""Spot interruptions: notices and liveness of active instances; LOST jobs get a new attempt."""

import time

import dagster as dg

from ..control.reconcile import reconcile
from ..jobs import train_job
from ..profiles import job_pools, pool_tags
from ..resources import OrbitResource

# How long a crashed run's pending retry holds off a re-attach (the retry daemon polls in seconds).
RETRY_GRACE_S = 300
IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED]


def _followed(instance: dg.DagsterInstance):
    def followed(job_id: str, attempt: int) -> bool:  # noqa: ARG001 - any live run of the partition re-attaches
        runs = instance.get_run_records(
            dg.RunsFilter(statuses=IN_PROGRESS, tags={"dagster/partition": job_id}), limit=1
        )
        if runs:
            return True
        # A run worker that crashed, which Dagster's run retries (the team profile) will run
        # again: that retry re-attaches, so a second follower is not requested meanwhile.
        failed = instance.get_run_records(
            dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE],
                          tags={"dagster/partition": job_id, "dagster/will_retry": "true"}), limit=5
        )
        return any("dagster/auto_retry_run_id" not in r.dagster_run.tags and r.end_time
                   and time.time() - r.end_time < RETRY_GRACE_S for r in failed)

    return followed


@dg.sensor(job=train_job, minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Reads reclaim notices and host liveness; re-attaches unfollowed attempts; requeues LOST jobs.")
def spot_interruption_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource):
    report = reconcile(orbit.settings(), followed=_followed(context.instance))
    for line in report.lines():
        context.log.info(line)
    pools = job_pools(orbit.settings().ledger(), [r["job_id"] for r in report.reattach])
    for r in report.reattach:
        # A fresh key per tick is safe: run_attempt re-attaches, it never launches twice.
        yield dg.RunRequest(run_key=f"{r['job_id']}:attempt-{r['attempt']}:reattach-{context.cursor or 0}",
                            partition_key=r["job_id"], tags={"orbit/job": r["job_id"], "orbit/reattach": "1",
                                                             **pool_tags(pools.get(r["job_id"]), "train")})
    if report.reattach:
        context.update_cursor(str(int(context.cursor or 0) + 1))
    if not report.actions:
        yield dg.SkipReason("no notices, no lost hosts")
