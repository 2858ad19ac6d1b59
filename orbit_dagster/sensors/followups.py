"""Follow-ups: re-rank an experiment when it has new evaluations; refresh the cost summary."""

import dagster as dg

from ..assets.partitions import EXPERIMENTS, experiments_partitions
from ..jobs import best_job, cost_job
from ..resources import OrbitResource


def stale_experiments(ledger, since: float) -> list[dict]:
    """Experiments with evaluations finished after `since` and none pending now (one ranking
    per batch of evaluations, not one per checkpoint), with the newest finish time."""
    return ledger.rows(
        """SELECT e.experiment, max(e.finished_at) AS newest FROM evaluations e
           WHERE e.finished_at > ? AND e.state IN ('SUCCEEDED', 'FAILED', 'SKIPPED')
             AND NOT EXISTS (SELECT 1 FROM evaluations p WHERE p.experiment = e.experiment
                             AND p.state IN ('PENDING', 'RUNNING'))
           GROUP BY e.experiment""", [since])


@dg.sensor(job=best_job, minimum_interval_seconds=3, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Recomputes best_checkpoint for experiments with new evaluations.")
def best_checkpoint_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    since = float(context.cursor or 0)
    rows = stale_experiments(orbit.settings().ledger(), since)
    known = set(context.instance.get_dynamic_partitions(EXPERIMENTS))
    new = sorted({r["experiment"] for r in rows} - known)
    if rows:
        context.update_cursor(str(max(float(r["newest"]) for r in rows)))
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"best:{r['experiment']}:{r['newest']:.6f}", partition_key=r["experiment"],
                                    tags={"orbit/kind": "best", "orbit/experiment": r["experiment"]}) for r in rows],
        dynamic_partitions_requests=[experiments_partitions.build_add_request(new)] if new else [],
    )


@dg.sensor(job=cost_job, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Refreshes cost_summary when instances have stopped and none is running.")
def cost_summary_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource):  # noqa: ARG001
    row = orbit.settings().ledger().one(
        """SELECT (SELECT max(stopped_at) FROM instances) AS last_stop,
                  (SELECT count(*) FROM instances WHERE stopped_at IS NULL) AS running""")
    # Once per quiet period after a change: not once per instance while work is going on.
    if row["last_stop"] is not None and not row["running"]:
        yield dg.RunRequest(run_key=f"cost:{float(row['last_stop']):.6f}", tags={"orbit/kind": "cost"})
