"""`best_checkpoint`: per experiment, the best checkpoint by the primary metric, with lineage."""

import dagster as dg

from ..control.best import record_best
from ..control.retention import apply_retention
from ..resources import OrbitResource
from .partitions import experiments_partitions


@dg.asset(
    partitions_def=experiments_partitions,
    deps=[dg.AssetDep("evaluation", partition_mapping=dg.AllPartitionMapping())],
    group_name="evaluation",
    kinds={"duckdb"},
    description="Primary metric resolved experiment -> project -> global default; evaluations beat training metrics.",
)
def best_checkpoint(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:
    settings = orbit.settings()
    best = record_best(settings, context.partition_key)
    if best is None:
        return dg.MaterializeResult(metadata={"best": "none yet: no checkpoint has a value for the primary metric"})
    # Rank first, then prune: retention keeps the best M, the latest K and fresh emergencies.
    ledger = settings.ledger()
    deleted = [key for row in ledger.rows("SELECT job_id FROM jobs WHERE experiment = ?", [context.partition_key])
               for key in apply_retention(settings, row["job_id"])]
    chain = "\n".join(
        f"| {c['checkpoint_key']} | {c['attempt']} | {c['tier']} | {c['sha256'][:12]} |" for c in best["lineage"]
    )
    return dg.MaterializeResult(
        metadata={
            "checkpoint": best["checkpoint_key"],
            "metric": best["metric_name"],
            "value": dg.MetadataValue.float(float(best["metric_value"])),
            "mode": best["metric_mode"],
            "source": best["metric_source"],
            "resolved_from": best["resolved_from"],
            "candidates": int(best["candidates"]),
            "lineage": dg.MetadataValue.md("| checkpoint | attempt | tier | sha256 |\n|---|---|---|---|\n" + chain),
            "deleted_by_retention": ", ".join(deleted) or "none",
        }
    )
