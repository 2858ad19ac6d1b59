"""QUEUED jobs -> one `training_run` run per attempt.

The run key is `<job>:attempt-<n>`: Dagster never launches two runs with the same key
from one sensor, so an attempt can never launch twice, whatever restarts in between.
"""

import dagster as dg

from ..assets.partitions import JOBS, jobs_partitions
from ..jobs import train_job
from ..resources import OrbitResource


def queued_jobs(ledger) -> list[dict]:
    return ledger.rows("SELECT job_id, attempt, experiment FROM job_status WHERE state = 'QUEUED' ORDER BY state_ts")


@dg.sensor(job=train_job, minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Launches each queued attempt of a job as a training_run materialisation.")
def job_queue_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    rows = queued_jobs(orbit.settings().ledger())
    known = set(context.instance.get_dynamic_partitions(JOBS))
    new = sorted({r["job_id"] for r in rows} - known)
    requests = [
        dg.RunRequest(
            run_key=f"{r['job_id']}:attempt-{r['attempt']}",
            partition_key=r["job_id"],
            tags={"orbit/job": r["job_id"], "orbit/attempt": str(r["attempt"]), "orbit/experiment": r["experiment"]},
        )
        for r in rows
    ]
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[jobs_partitions.build_add_request(new)] if new else [],
    )
