"""Pending evaluations -> `evaluation` runs, while the provider's pool has room and leaves the
slots waiting trainings need (control/capacity.py: handed-off trainings hold GPUs without
runs); claims of dead runs given back.

With ORBIT_EVAL_SHARE > 1 (the default) one run at a time works on a job's evaluations of a
suite: it is requested for the oldest pending one and evaluates the job's other pending
ones of the suite on the instance it rents (control/evaluate.py), so the sensor requests no
second run for that job and suite while the first is queued or at work.

The run key is `eval:<checkpoint>:<suite>:try-<n>` wherever an evaluation is requested
(this sensor, the backfill schedule), and the ledger's claim (PENDING -> RUNNING) lets only
one run evaluate a (checkpoint, suite) at a time, so nothing is evaluated twice at once.
"""

import dagster as dg

from ..assets.partitions import checkpoint_partition_requests, partition_of
from ..control.capacity import capacity
from ..control.evaluate import eval_run_key, pending_evaluations, skip_deleted, stale_evaluations
from ..deploy.profiles import pool_tags
from ..jobs import eval_job
from ..ops.rental import abandoned_eval_request, rental_job
from ..ops.runs import IN_PROGRESS, in_flight_tags, tag_limits, verdicts
from ..resources import OrbitResource

BATCH = 50  # sensors time out at 60 s; partition-key validation of many requests counts
ALIVE = set(IN_PROGRESS) | {dg.DagsterRunStatus.CANCELING}


def run_alive(instance: dg.DagsterInstance, settings):
    """Whether an evaluation's run still works on it: in progress and its worker alive."""
    def alive(run_id: str | None) -> bool:
        if not run_id:
            return False
        records = list(instance.get_run_records(dg.RunsFilter(run_ids=[run_id])))
        if not records or records[0].dagster_run.status not in ALIVE:
            return False
        return verdicts(instance, settings.ledger(), records, timeout_s=settings.worker_timeout_s)[run_id].working

    return alive


def eval_request(row: dict, **tags: str) -> dg.RunRequest:
    return dg.RunRequest(run_key=eval_run_key(row["checkpoint_key"], row["suite"], int(row["tries"] or 0)),
                         job_name="eval_job", partition_key=partition_of(row["checkpoint_key"]),
                         tags={"orbit/job": row["job_id"], "orbit/checkpoint": row["checkpoint_key"],
                               "orbit/suite": row["suite"], "orbit/kind": "eval",
                               "orbit/placement": row.get("placement") or "sim",
                               **pool_tags(row.get("placement") or "sim", "eval"), **tags})


@dg.sensor(jobs=[eval_job, rental_job], minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Evaluates every newly registered checkpoint; requests a run that releases and gives back an "
                       "evaluation whose run died.")
def checkpoint_evaluation_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    settings = orbit.settings()
    stale = stale_evaluations(settings, run_alive(context.instance, settings))
    skip_deleted(settings)
    ledger = settings.ledger()
    room = capacity(ledger, tag_limits(context.instance), in_flight_tags(context.instance))
    rows = []
    share = settings.eval_share > 1
    for row in pending_evaluations(ledger, BATCH + sum(len(keys) for keys in room.evals.values())):
        placement = row.get("placement") or "sim"
        if room.evaluating(row["checkpoint_key"], row["suite"]):
            continue  # its run is queued or running
        if share and room.evaluating_job(row["job_id"], row["suite"]):
            continue  # a run at work on the job's evaluations takes it up, or the next one does
        if len(rows) < BATCH and room.may_eval(placement):
            rows.append(row)
            room.evals[placement].add(f"{row['checkpoint_key']}|{row['suite']}")
            room.eval_groups.add(f"{row['job_id']}|{row['suite']}")
    return dg.SensorResult(
        run_requests=[abandoned_eval_request(r) for r in stale] + [eval_request(r) for r in rows],
        dynamic_partitions_requests=checkpoint_partition_requests(context.instance,
                                                                  [r["checkpoint_key"] for r in rows]),
    )
