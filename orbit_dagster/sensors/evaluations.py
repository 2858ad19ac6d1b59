"""New checkpoints -> one `evaluation` run each (run key per checkpoint and suite)."""

import dagster as dg

from ..assets.partitions import CHECKPOINTS, checkpoints_partitions
from ..control.evaluate import MAX_EVAL_RUNS
from ..jobs import eval_job
from ..resources import OrbitResource

BATCH = 50  # sensors time out at 60 s; partition-key validation of many requests counts


def unevaluated(ledger, limit: int = BATCH) -> list[dict]:
    """Evaluable checkpoints without an evaluation, with how many runs failed on each so far
    (a failed run is retried under a new run key, up to MAX_EVAL_RUNS)."""
    return ledger.rows(
        """WITH failed AS (SELECT json_extract_string(detail, '$.checkpoint') AS checkpoint_key, count(*) AS n
                          FROM events WHERE kind = 'evaluation_failed' GROUP BY 1)
           SELECT c.checkpoint_key, c.job_id, coalesce(f.n, 0) AS failures FROM live_checkpoints c
           ANTI JOIN evaluations e USING (checkpoint_key)
           SEMI JOIN bundles b USING (job_id)  -- evaluable: a bundle holds the eval script
           LEFT JOIN failed f USING (checkpoint_key)
           WHERE coalesce(f.n, 0) < ?
           ORDER BY c.registered_at LIMIT ?""",
        [MAX_EVAL_RUNS, limit],
    )


@dg.sensor(job=eval_job, minimum_interval_seconds=2, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Evaluates every newly registered checkpoint.")
def checkpoint_evaluation_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    rows = unevaluated(orbit.settings().ledger())
    known = set(context.instance.get_dynamic_partitions(CHECKPOINTS))
    new = [r["checkpoint_key"] for r in rows if r["checkpoint_key"] not in known]
    requests = [
        dg.RunRequest(run_key=f"eval:{r['checkpoint_key']}" + (f":retry-{r['failures']}" if r["failures"] else ""),
                      partition_key=r["checkpoint_key"],
                      tags={"orbit/job": r["job_id"], "orbit/checkpoint": r["checkpoint_key"]})
        for r in rows
    ]
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[checkpoints_partitions.build_add_request(new)] if new else [],
    )
