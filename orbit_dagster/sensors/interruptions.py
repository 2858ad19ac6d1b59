"""Spot interruptions: notices and liveness of active instances; every rental decision is a run.

Each tick records notices as soon as providers publish them and decides what the ledger and
the providers disagree on (`control.reconcile.decide`). A live host that no run follows is
re-attached by a `training_run` run; everything that releases, bills or requeues (a host
lost while no run followed it, a cancelled workload still running, a dispatch abandoned, an
instance metered after its attempt, a LOST job) is one `rental_job` run per decision, with
the decision's tags, so the run list shows every GPU released and why.
"""

import time
from datetime import datetime, timezone

import dagster as dg

from ..control.reconcile import decide
from ..deploy.profiles import job_pools, pool_tags
from ..jobs import train_job
from ..ops.rental import decision_request, rental_job
from ..ops.runs import IN_PROGRESS, verdicts
from ..resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource, active

# How long a crashed run's pending retry holds off a re-attach (the retry daemon polls in seconds).
RETRY_GRACE_S = 300
# Re-attach runs requested per tick. After a daemon restart every attempt may be unfollowed;
# Dagster checks each request's partition with one storage query (~5 ms), so 1,000 at once
# made a 10 s tick, while the pools start only a few of them at a time anyway. The rest are
# requested on the next ticks (a requested run counts as following its attempt).
REATTACH_PER_TICK = 50


def _followed(instance: dg.DagsterInstance, settings):
    """Whether a run whose worker lives follows a job: one query for all of them, not one per job.

    A training run counts only while its worker process lives (ops/runs.py `verdicts`): a
    run left STARTED by a SIGKILLed worker, a killed code server or a reboot follows
    nothing, and its attempt is taken up again (re-attached, or closed if its host is gone).
    Run monitoring fails such a run through orbit's launcher; under a dagster.yaml that
    names another launcher, this sensor reports it failed itself, so its slot is freed."""
    ledger = settings.ledger()
    records = [r for job in ("train_job", "__ASSET_JOB")
               for r in instance.get_run_records(dg.RunsFilter(statuses=IN_PROGRESS, job_name=job))]
    judged = verdicts(instance, ledger, records, timeout_s=settings.worker_timeout_s)
    live = {r.dagster_run.tags.get("dagster/partition") for r in records if judged[r.dagster_run.run_id].working}
    if not instance.run_launcher.supports_check_run_worker_health:
        for r in records:
            if not judged[r.dagster_run.run_id].alive:
                instance.report_run_failed(r.dagster_run, f"orbit: {judged[r.dagster_run.run_id].why}")
    # A run worker that crashed, which Dagster's run retries (the team profile) will run
    # again: that retry re-attaches, so a second follower is not requested meanwhile.
    live |= {r.dagster_run.tags.get("dagster/partition") for r in instance.get_run_records(
        dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE], tags={"dagster/will_retry": "true"},
                      updated_after=datetime.fromtimestamp(time.time() - RETRY_GRACE_S, timezone.utc)))
        if "dagster/auto_retry_run_id" not in r.dagster_run.tags}

    def followed(job_id: str, attempt: int) -> bool:  # noqa: ARG001 - any live run of the partition re-attaches
        return job_id in live

    return followed


@dg.sensor(jobs=[train_job, rental_job], minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Reads reclaim notices and host liveness; re-attaches unfollowed attempts; requests a run for "
                       "every release, bill or requeue it decides.")
def spot_interruption_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource, sim_market: SimMarketResource,
                             ssh_rental: SshRentalResource, aws_spot: AwsSpotResource):
    settings = orbit.settings()
    with active(sim_market, ssh_rental, aws_spot):
        report = decide(settings, followed=_followed(context.instance, settings))
    for line in report.lines():
        context.log.info(line)
    reattach = sorted(report.reattach, key=lambda d: (d.job_id, d.attempt))
    later = set(reattach[REATTACH_PER_TICK:])
    if later:
        context.log.info(f"{len(later)} more attempts to re-attach on the next ticks")
    pools = job_pools(settings.ledger(), [d.job_id for d in reattach[:REATTACH_PER_TICK]])
    for d in report.decisions:
        if d in later:
            continue
        if d.action == "reattach":
            # A fresh key per tick is safe: run_attempt re-attaches, it never launches twice.
            yield dg.RunRequest(run_key=f"{d.job_id}:attempt-{d.attempt}:reattach-{context.cursor or 0}",
                                job_name="train_job", partition_key=d.job_id,
                                tags={"orbit/job": d.job_id, "orbit/reattach": "1", "orbit/kind": "train",
                                      **pool_tags(pools.get(d.job_id), "train")})
        else:
            yield decision_request(d)
    if report.reattach:
        context.update_cursor(str(int(context.cursor or 0) + 1))
    if not report.actions:
        yield dg.SkipReason("no notices, no lost hosts")
