"""Cost assets: `cost_summary` (attribution tables and the check that they add up) and
`cost_efficiency` (what each offer's dollars bought in effective compute, docs/cost.md)."""

import dagster as dg

from ..ledger.queries import billed_usd, cost_table
from ..resources import OrbitResource
from .metadata import bars_svg, table

MONEY = "float"
CHECK = dg.AssetCheckSpec("cost_equals_bill", asset="cost_summary",
                          description="The attribution (train, eval, wasted, overhead) sums to what the providers billed.")


def _table(df, described: dict[str, str]) -> dg.MetadataValue:
    columns = [(c, "string" if df[c].dtype == object else ("int" if "int" in str(df[c].dtype) else MONEY),
                described.get(c, "")) for c in df.columns]
    return table(df.astype(object).where(df.notna(), None).to_dict("records"), columns)  # NULL, never NaN


# Cost tables read every training and evaluation partition: they depend on all of them.
EVERY_RUN = [dg.AssetDep("training_run", partition_mapping=dg.AllPartitionMapping()),
             dg.AssetDep("evaluation", partition_mapping=dg.AllPartitionMapping())]

DESCRIBED = {"usd": "the bill's share of this line", "train_usd": "training up to each checkpoint",
             "eval_usd": "evaluations of its checkpoints",
             "eval_per_train": "eval $ per train $ (above 1: evaluating cost more than training)", "wasted_usd": "work lost after the last checkpoint",
             "overhead_usd": "boot, waiting, shutdown", "wasted_gpu_seconds": "GPU-seconds of lost work"}


@dg.asset(
    deps=EVERY_RUN,
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


EFFICIENCY_CHECK = dg.AssetCheckSpec("efficiency_equals_bill", asset="cost_efficiency",
                                     description="The per-offer rows sum to what the providers billed.")
EFFICIENCY_DESCRIBED = {
    "instance_hours": "billed instance time", "gpu_hours": "instance time x GPUs", "usd": "what was paid",
    "wasted_usd": "work lost after the last checkpoint of a lost attempt",
    "recovery_usd": "wasted work + restores of resumed attempts",
    "useful_gpu_hours": "GPU-hours attributed to checkpoints and evaluations, less restores",
    "tflops_per_gpu": "dense TFLOP/s per GPU (see tflops_source)",
    "tflops_source": "probe (measured on the instance), catalog measured, catalog spec, or unknown",
    "effective_tflop_hours": "useful GPU-hours x TFLOP/s per GPU",
    "usd_per_effective_tflop_hour": "usd / effective_tflop_hours",
    "interruptions_per_hour": "reclaims per instance-hour", "recovery_share": "recovery_usd / usd",
}


@dg.asset(
    deps=EVERY_RUN,
    group_name="cost",
    kinds={"duckdb"},
    check_specs=[EFFICIENCY_CHECK],
    description="Per provider, offer and GPU model: hours, $ paid and wasted, effective TFLOP-hours, $ per effective "
                "TFLOP-hour, interruptions per hour, recovery overhead (the face's cost_efficiency view; docs/cost.md).",
)
def cost_efficiency(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:  # noqa: ARG001
    ledger = orbit.settings().ledger()
    frame = cost_table(ledger, "provider")
    billed = billed_usd(ledger)
    total = float(frame["usd"].sum()) if len(frame) else 0.0
    gap = abs(total - billed)
    known = frame[frame["usd_per_effective_tflop_hour"].notna()] if len(frame) else frame
    bars = [(r["offer_id"], float(r["usd_per_effective_tflop_hour"])) for r in known.to_dict("records")]
    metadata = {
        "billed_usd": dg.MetadataValue.float(round(billed, 8)),
        "offers": len(frame),
        "by_offer": _table(frame, EFFICIENCY_DESCRIBED),
    }
    if bars:
        metadata["usd_per_effective_tflop_hour"] = dg.MetadataValue.md(
            f"![$ per effective TFLOP-hour by offer](data:image/svg+xml;base64,"
            f"{bars_svg(bars, unit='$ per effective TFLOP-hour')})")
    return dg.MaterializeResult(
        metadata=metadata,
        check_results=[dg.AssetCheckResult(check_name=EFFICIENCY_CHECK.name, passed=gap <= 1e-9 * max(billed, 1.0),
                                           metadata={"billed_usd": billed, "rows_usd": total, "difference_usd": gap})],
    )
