"""`cost_summary`: cost attribution tables from the ledger, as Dagster metadata."""

import dagster as dg

from ..ledger.queries import cost_table
from ..resources import OrbitResource


@dg.asset(
    deps=[dg.AssetDep("training_run", partition_mapping=dg.AllPartitionMapping()),
          dg.AssetDep("evaluation", partition_mapping=dg.AllPartitionMapping())],
    group_name="cost",
    kinds={"duckdb"},
    description="Per-second billing attributed to job, attempt and checkpoint, wasted compute included.",
)
def cost_summary(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:  # noqa: ARG001
    ledger = orbit.settings().ledger()
    by_job = cost_table(ledger, "job")
    total = float(by_job["usd"].sum()) if len(by_job) else 0.0
    wasted = float(by_job["wasted_gpu_seconds"].fillna(0).sum()) if len(by_job) else 0.0
    return dg.MaterializeResult(
        metadata={
            "total_usd": dg.MetadataValue.float(round(total, 6)),
            "wasted_gpu_seconds": dg.MetadataValue.float(round(wasted, 3)),
            "jobs": len(by_job),
            "by_job": dg.MetadataValue.md(by_job.to_markdown(index=False) if len(by_job) else "(none)"),
            "by_experiment": dg.MetadataValue.md(cost_table(ledger, "experiment").to_markdown(index=False)),
        }
    )
