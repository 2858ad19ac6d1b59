"""`evaluation`: one eval job per checkpoint partition, on a rented GPU; metrics as metadata."""

import dagster as dg

from ..control.evaluate import evaluate_checkpoint
from ..resources import OrbitResource
from .partitions import checkpoints_partitions
from .reporting import DagsterReporter


@dg.asset(
    partitions_def=checkpoints_partitions,
    deps=["checkpoint"],
    group_name="evaluation",
    kinds={"python"},
    description="Held-out evaluation of one checkpoint; the script prints {\"metrics\": {...}}.",
)
def evaluation(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:
    result = evaluate_checkpoint(orbit.settings(), context.partition_key, suite=context.run.tags.get("orbit/suite"),
                                 dagster_run_id=context.run_id, reporter=DagsterReporter(context))
    if result.get("already"):
        raise dg.Failure(description=f"{context.partition_key} ({result['suite']}) is {result['state']} already "
                                     f"(run {result['dagster_run_id']}); nothing was rented",
                         allow_retries=False)
    metadata: dict = {name: dg.MetadataValue.float(float(v)) for name, v in result["metrics"].items()}
    metadata.update({"suite": result["suite"], "seconds": round(result["seconds"], 3), "instance": result["instance_id"]})
    return dg.MaterializeResult(metadata=metadata)
