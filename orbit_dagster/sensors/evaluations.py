"""Pending evaluations -> one `evaluation` run each; claims of dead runs given back.

The run key is `eval:<checkpoint>:<suite>:try-<n>` wherever an evaluation is requested
(this sensor, the backfill schedule), and the ledger's claim (PENDING -> RUNNING) lets only
one run evaluate a (checkpoint, suite) at a time, so nothing is evaluated twice at once.
"""

import dagster as dg

from ..assets.partitions import CHECKPOINTS, checkpoints_partitions
from ..control.evaluate import eval_run_key, pending_evaluations, reconcile_evaluations
from ..jobs import eval_job
from ..profiles import job_pools, pool_tags
from ..resources import OrbitResource

BATCH = 50  # sensors time out at 60 s; partition-key validation of many requests counts
IN_PROGRESS = {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING}


def run_alive(instance: dg.DagsterInstance):
    def alive(run_id: str | None) -> bool:
        if not run_id:
            return False
        run = instance.get_run_by_id(run_id)
        return run is not None and run.status in IN_PROGRESS

    return alive


def eval_request(row: dict, **tags: str) -> dg.RunRequest:
    return dg.RunRequest(run_key=eval_run_key(row["checkpoint_key"], row["suite"], int(row["tries"] or 0)),
                         partition_key=row["checkpoint_key"],
                         tags={"orbit/job": row["job_id"], "orbit/checkpoint": row["checkpoint_key"],
                               "orbit/suite": row["suite"], "orbit/kind": "eval", **tags})


@dg.sensor(job=eval_job, minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Evaluates every newly registered checkpoint; re-requests evaluations whose run died.")
def checkpoint_evaluation_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    settings = orbit.settings()
    for line in reconcile_evaluations(settings, run_alive(context.instance)):
        context.log.info(f"evaluation given back: {line}")
    rows = pending_evaluations(settings.ledger(), BATCH)
    known = set(context.instance.get_dynamic_partitions(CHECKPOINTS))
    new = sorted({r["checkpoint_key"] for r in rows} - known)
    pools = job_pools(settings.ledger(), [r["job_id"] for r in rows])
    return dg.SensorResult(
        run_requests=[eval_request(r, **pool_tags(pools.get(r["job_id"]), "eval")) for r in rows],
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new)] if new else [],
    )
