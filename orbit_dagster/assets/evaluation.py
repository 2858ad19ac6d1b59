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
    result = evaluate_checkpoint(orbit.settings(), context.partition_key, dagster_run_id=context.run_id,
                                 reporter=DagsterReporter(context))
    metadata: dict = {name: dg.MetadataValue.float(float(v)) for name, v in result["metrics"].items()}
    metadata.update({"suite": result["suite"], "seconds": round(result["seconds"], 3), "instance": result["instance_id"]})
    return dg.MaterializeResult(metadata=metadata)
