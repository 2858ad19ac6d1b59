"""New checkpoints -> one `evaluation` run each (run key per checkpoint and suite)."""

import dagster as dg

from ..assets.partitions import CHECKPOINTS, checkpoints_partitions
from ..jobs import eval_job
from ..resources import OrbitResource

BATCH = 50  # sensors time out at 60 s; partition-key validation of many requests counts


def unevaluated(ledger, limit: int = BATCH) -> list[dict]:
    return ledger.rows(
        """SELECT c.checkpoint_key, c.job_id FROM live_checkpoints c
           ANTI JOIN evaluations e USING (checkpoint_key)
           SEMI JOIN bundles b USING (job_id)  -- evaluable: a bundle holds the eval script
           ORDER BY c.registered_at LIMIT ?""",
        [limit],
    )


@dg.sensor(job=eval_job, minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Evaluates every newly registered checkpoint.")
def checkpoint_evaluation_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    rows = unevaluated(orbit.settings().ledger())
    known = set(context.instance.get_dynamic_partitions(CHECKPOINTS))
    new = [r["checkpoint_key"] for r in rows if r["checkpoint_key"] not in known]
    requests = [
        dg.RunRequest(run_key=f"eval:{r['checkpoint_key']}", partition_key=r["checkpoint_key"],
                      tags={"orbit/job": r["job_id"], "orbit/checkpoint": r["checkpoint_key"]})
        for r in rows
    ]
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new)] if new else [],
    )
