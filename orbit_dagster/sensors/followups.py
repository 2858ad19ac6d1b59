"""Follow-ups: re-rank an experiment when it has new evaluations; refresh the cost summary."""

import dagster as dg

from ..assets.partitions import EXPERIMENTS, experiments_partitions
from ..jobs import best_job, cost_job
from ..resources import OrbitResource


def stale_experiments(ledger) -> list[dict]:
    """Experiments whose best checkpoint was computed over fewer evaluations than exist,
    once their pending evaluations are done (one ranking per batch, not one per checkpoint)."""
    return ledger.rows(
        """WITH n AS (SELECT j.experiment, count(*) AS evaluations FROM evaluations e JOIN owners j USING (job_id) GROUP BY 1),
           pending AS (SELECT DISTINCT o.experiment FROM live_checkpoints c JOIN owners o USING (job_id)
                       SEMI JOIN bundles b USING (job_id) ANTI JOIN evaluations e USING (checkpoint_key))
           SELECT n.experiment, n.evaluations FROM n LEFT JOIN current_best b USING (experiment)
           WHERE (b.evaluations IS NULL OR b.evaluations < n.evaluations)
             AND n.experiment NOT IN (SELECT experiment FROM pending)"""
    )


@dg.sensor(job=best_job, minimum_interval_seconds=3, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Recomputes best_checkpoint for experiments with new evaluations.")
def best_checkpoint_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    rows = stale_experiments(orbit.settings().ledger())
    known = set(context.instance.get_dynamic_partitions(EXPERIMENTS))
    new = [r["experiment"] for r in rows if r["experiment"] not in known]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"best:{r['experiment']}:{r['evaluations']}", partition_key=r["experiment"])
                      for r in rows],
        dynamic_partitions_requests=[experiments_partitions.build_add_request(new)] if new else [],
    )


@dg.sensor(job=cost_job, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Refreshes cost_summary when jobs have finished and no instance is running.")
def cost_summary_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource):  # noqa: ARG001
    row = orbit.settings().ledger().rows(
        """SELECT (SELECT count(*) FROM job_status WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')) AS done,
                  (SELECT count(*) FROM instance_stops) AS stops,
                  (SELECT count(*) FROM instance_usage WHERE running) AS running"""
    )[0]
    # Once per quiet period after a change: not once per instance while work is going on.
    if row["done"] and not row["running"]:
        yield dg.RunRequest(run_key=f"cost:{row['done']}:{row['stops']}")
