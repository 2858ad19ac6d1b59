"""`cost_summary`: cost attribution tables from the ledger, and the check that they add up."""

import dagster as dg

from ..ledger.queries import billed_usd, cost_table
from ..resources import OrbitResource
from .metadata import table

MONEY = "float"
CHECK = dg.AssetCheckSpec("cost_equals_bill", asset="cost_summary",
                          description="The attribution (train, eval, wasted, overhead) sums to what the providers billed.")


def _table(df, described: dict[str, str]) -> dg.MetadataValue:
    columns = [(c, "string" if df[c].dtype == object else ("int" if "int" in str(df[c].dtype) else MONEY),
                described.get(c, "")) for c in df.columns]
    return table(df.astype(object).where(df.notna(), None).to_dict("records"), columns)  # NULL, never NaN


DESCRIBED = {"usd": "the bill's share of this line", "train_usd": "training up to each checkpoint",
             "eval_usd": "evaluations of its checkpoints",
             "eval_per_train": "eval $ per train $ (above 1: evaluating cost more than training)", "wasted_usd": "work lost after the last checkpoint",
             "overhead_usd": "boot, waiting, shutdown", "wasted_gpu_seconds": "GPU-seconds of lost work"}


@dg.asset(
    deps=[dg.AssetDep("training_run", partition_mapping=dg.AllPartitionMapping()),
          dg.AssetDep("evaluation", partition_mapping=dg.AllPartitionMapping())],
    group_name="cost",
    kinds={"sqlite"},
    check_specs=[CHECK],
    description="Per-second billing attributed to job, experiment and checkpoint, wasted compute and overhead "
                "as their own lines; every table sums to the bill.",
)
def cost_summary(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:  # noqa: ARG001
    ledger = orbit.settings().ledger()
    by_job, by_ckpt = cost_table(ledger, "job"), cost_table(ledger, "checkpoint")
    total = float(by_job["usd"].sum()) if len(by_job) else 0.0
    billed = billed_usd(ledger)
    lines = float(by_ckpt["usd"].sum()) if len(by_ckpt) else 0.0
    gap = max(abs(total - billed), abs(lines - billed))
    return dg.MaterializeResult(
        metadata={
            "total_usd": dg.MetadataValue.float(round(total, 8)),
            "billed_usd": dg.MetadataValue.float(round(billed, 8)),
            "wasted_gpu_seconds": dg.MetadataValue.float(round(float(by_job["wasted_gpu_seconds"].sum()), 3)
                                                         if len(by_job) else 0.0),
            "jobs": len(by_job),
            "by_job": _table(by_job, DESCRIBED),
            "by_experiment": _table(cost_table(ledger, "experiment"), DESCRIBED),
            "by_checkpoint": _table(by_ckpt.head(500), DESCRIBED),
        },
        check_results=[dg.AssetCheckResult(check_name=CHECK.name, passed=gap <= 1e-9 * max(billed, 1.0),
                                           metadata={"billed_usd": billed, "attributed_usd": total,
                                                     "by_checkpoint_usd": lines, "difference_usd": gap})],
    )
