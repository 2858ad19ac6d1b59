"""`best_checkpoint`: per experiment, the best checkpoint by the primary metric, with lineage.

Its inputs are the experiment's evaluations. Dagster cannot say so partition by partition:
an evaluation's partition is (job, checkpoint), and no built-in partition mapping goes from
a job to its experiment (a custom mapping is not sent to the UI or the daemons, and
multi-partitions have at most two dimensions). So the dependency is declared on all
`evaluation` partitions, and each materialisation lists its real inputs instead: the
`inputs` table (every candidate checkpoint of the experiment with its metric value and
source) and the `lineage` table (the winner's resume chain across attempts).
"""

import dagster as dg

from ..control.best import candidates, record_best
from ..control.retention import apply_retention
from ..resources import OrbitResource
from .metadata import table
from .partitions import experiments_partitions

INPUT_ROWS = 500


@dg.asset(
    partitions_def=experiments_partitions,
    deps=[dg.AssetDep("evaluation", partition_mapping=dg.AllPartitionMapping())],
    group_name="evaluation",
    kinds={"sqlite"},
    description="Primary metric resolved experiment -> project -> template -> global default; evaluations beat "
                "training metrics; each job's current lineage only. Its real inputs are listed in its metadata.",
)
def best_checkpoint(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:
    settings = orbit.settings()
    experiment = context.partition_key
    best = record_best(settings, experiment)
    if best is None:
        return dg.MaterializeResult(metadata={"best": "none yet: no checkpoint has a value for the primary metric"})
    # Rank first, then prune: retention keeps the best M, the latest K and fresh emergencies.
    ledger = settings.ledger()
    deleted = [key for row in ledger.rows("SELECT job_id FROM jobs WHERE experiment = ?", [experiment])
               for key in apply_retention(settings, row["job_id"])]
    metric = best["primary_metric"]
    cands = sorted(candidates(ledger, experiment, metric), key=lambda c: c.checkpoint_key)[:INPUT_ROWS]
    inputs = table([{"checkpoint": c.checkpoint_key, "step": c.step, "eval_value": c.eval_value,
                     "train_value": c.train_value, "chosen": c.checkpoint_key == best["checkpoint_key"]}
                    for c in cands],
                   [("checkpoint", "string", "a live checkpoint of the experiment (current lineage)"),
                    ("step", "int", "training step"), ("eval_value", "float", f"{metric}, latest evaluation"),
                    ("train_value", "float", "training-time value, used only when nothing is evaluated"),
                    ("chosen", "bool", "the best one")])
    lineage = table([{"checkpoint": c["checkpoint_key"], "attempt": c["attempt"], "lineage": c["lineage"],
                      "tier": c["tier"], "sha256": c["sha256"][:16]} for c in best["lineage"]],
                    [("checkpoint", "string", "newest first"), ("attempt", "int", "the attempt that wrote it"),
                     ("lineage", "string", "the training chain"), ("tier", "string", "durable or emergency"),
                     ("sha256", "string", "the manifest digest the ledger recorded")])
    return dg.MaterializeResult(
        metadata={
            "checkpoint": best["checkpoint_key"],
            "metric": best["metric_name"],
            "value": dg.MetadataValue.float(float(best["metric_value"])),
            "mode": best["metric_mode"],
            "source": best["metric_source"],
            "resolved_from": best["resolved_from"],
            "candidates": int(best["candidates"]),
            "inputs": inputs,
            "lineage": lineage,
            "deleted_by_retention": ", ".join(deleted) or "none",
        }
    )
