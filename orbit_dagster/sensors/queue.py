"""QUEUED jobs -> one `training_run` run per attempt, while its provider's pool has room.

A queued attempt gets its run when its provider's pool holds fewer trainings than its train
limit and less work than its limit (control/capacity.py); until then it waits in the ledger's
queue, not in Dagster's, and is requested on a later tick, oldest first. Evaluations leave
it the slot it needs (they may not take it while it waits), and its run goes ahead of
evaluations in Dagster's queue (`dagster/priority`; a resumed attempt highest).

The run key is `<job>:attempt-<n>`: Dagster never launches two runs with the same key
from one sensor, so an attempt can never launch twice, whatever restarts in between. A run
that ended before it dispatched the attempt (its process died, a person terminated it while
queued) leaves the job QUEUED: the attempt is requested again under `...:retry-<k>`, and
after `MAX_RUNS_PER_ATTEMPT` such runs the attempt FAILS with the reason, never stuck.
"""

import dagster as dg

from ..assets.partitions import JOBS, jobs_partitions
from ..control.capacity import PRIORITY_TAG, capacity, run_priority
from ..control.queue import fail_undispatched, queued_jobs
from ..deploy.profiles import pool_tags
from ..jobs import train_job
from ..ops.runs import in_flight_tags, tag_limits
from ..resources import OrbitResource

MAX_RUNS_PER_ATTEMPT = 3
# Runs requested per tick at most: Dagster checks each request's partition with a storage
# query, and 1,000 queued jobs made one tick 5.7 s (SQLite) to 13.8 s (PostgreSQL).
QUEUE_PER_TICK = 50
ENDED = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.SUCCESS}


def ended_runs(instance: dg.DagsterInstance, job_id: str, attempt: int) -> int:
    """Runs of this attempt that ended while it was still queued."""
    records = instance.get_run_records(dg.RunsFilter(tags={"orbit/job": job_id, "orbit/attempt": str(attempt),
                                                           "orbit/kind": "train"}), limit=MAX_RUNS_PER_ATTEMPT + 1)
    if any(r.dagster_run.status not in ENDED for r in records):
        return -1  # one is queued or running: it will dispatch the attempt
    return len(records)


def train_request(r: dict, ended: int = 0) -> dg.RunRequest:
    """The run of a queued attempt: in its provider's pool, ahead of evaluations in Dagster's
    queue, a resumed attempt first of all (control/capacity.py: `run_priority`)."""
    return dg.RunRequest(
        run_key=f"{r['job_id']}:attempt-{r['attempt']}" + (f":retry-{ended}" if ended else ""),
        partition_key=r["job_id"],
        tags={"orbit/job": r["job_id"], "orbit/attempt": str(r["attempt"]), "orbit/experiment": r["experiment"],
              "orbit/kind": "train", "orbit/placement": r["placement"] or "sim",
              **pool_tags(r["placement"] or "sim", "train"), PRIORITY_TAG: str(run_priority("train", r["attempt"]))},
    )


@dg.sensor(job=train_job, minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Launches each queued attempt of a job as a training_run materialisation, as far as its "
                       "provider's pool has room.")
def job_queue_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    settings = orbit.settings()
    ledger = settings.ledger()
    rows = queued_jobs(ledger)
    known = set(context.instance.get_dynamic_partitions(JOBS))
    new = sorted({r["job_id"] for r in rows} - known)
    room = capacity(ledger, tag_limits(context.instance), in_flight_tags(context.instance))
    requests = []
    waiting = 0
    for r in rows:
        placement = r["placement"] or "sim"
        if room.training(r["job_id"]):
            continue  # its run is queued or running: it dispatches the attempt
        if len(requests) >= QUEUE_PER_TICK or not room.may_train(placement):
            waiting += 1
            continue
        ended = ended_runs(context.instance, r["job_id"], int(r["attempt"]))
        if ended < 0:
            continue
        if ended >= MAX_RUNS_PER_ATTEMPT:
            fail_undispatched(settings, r["job_id"], int(r["attempt"]), runs=ended)
            continue
        requests.append(train_request(r, ended))
        room.trains[placement].add(r["job_id"])
    if waiting:
        context.log.info(f"{waiting} queued attempts wait for room in their provider's pool")
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[jobs_partitions.build_add_request(new)] if new else [],
    )
