"""Asset checks: what a person needs to trust a checkpoint, an evaluation and the bill.

| check                               | on           | passes when |
|-------------------------------------|--------------|-------------|
| `checkpoint_integrity`              | checkpoint   | the stored bytes match the sha256 the ledger recorded at registration (and a delta's base verifies) |
| `checkpoint_present`                | checkpoint   | the checkpoint was not deleted by retention (a deleted one is no longer a live partition) |
| `evaluation_metrics_valid`          | evaluation   | the evaluation's metrics are finite and its suite's (reported by each evaluation run) |
| `every_checkpoint_evaluated`        | evaluation   | every live checkpoint of an evaluable job has a result for its job's current suite |
| `cost_equals_bill` (in cost_summary)| cost_summary | the cost attribution, overhead and waste included, sums to what was billed |

The per-checkpoint checks are partitioned like their assets: the training run reports them
at registration and an evaluation run when it refuses a checkpoint; running a check from
the UI re-verifies the selected partitions now. A failed integrity check means no
evaluation is rented for that checkpoint (`control.checkpoints.check_against_ledger`).
"""

import math
import warnings

import dagster as dg

from ..control.checkpoints import check_against_ledger
from ..core.errors import CheckpointIntegrityError
from ..ledger import records as R
from ..resources import OrbitResource
from .partitions import checkpoint_key_of, checkpoints_partitions

# Chosen on purpose: a check per checkpoint partition is what "this checkpoint verifies"
# means (docs/architecture.md). Dagster marks partitioned checks as preview; said once here,
# not on every code-server load.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec",
                        category=dg.PreviewWarning)


def _checkpoint_key(context) -> str:
    """The checked checkpoint's ledger key; a run without a partition (the Checks tab's
    "Execute all" launches one) fails in one line that says what to do instead."""
    if not context.has_partition_key:
        raise dg.Failure(description=f"{context.check_specs[0].name if context.check_specs else 'this check'} checks "
                                     "one checkpoint partition (job, a<attempt>/<step>) and this run has none; "
                                     "fix: execute it for a partition (the partition's page, or eval_job for it)")
    return checkpoint_key_of(context.partition_key)


def _checkpoint_row(orbit: OrbitResource, context) -> tuple[str, dict | None]:
    key = _checkpoint_key(context)
    return key, R.checkpoint(orbit.settings().ledger(), key)


@dg.asset_check(asset="checkpoint", partitions_def=checkpoints_partitions, blocking=True,
                description="The checkpoint's bytes match the sha256 the ledger recorded when it was registered.")
def checkpoint_integrity(context: dg.AssetCheckExecutionContext, orbit: OrbitResource) -> dg.AssetCheckResult:
    key, row = _checkpoint_row(orbit, context)
    if row is None:
        return dg.AssetCheckResult(passed=False, metadata={"detail": f"no checkpoint {key} in the ledger"})
    if row["deleted_at"] is not None:
        return dg.AssetCheckResult(passed=True, metadata={"detail": "deleted by retention: nothing left to verify"})
    try:
        check_against_ledger(row)
    except CheckpointIntegrityError as exc:
        return dg.AssetCheckResult(passed=False, metadata={"detail": str(exc)[:1000], "sha256": row["sha256"]})
    return dg.AssetCheckResult(passed=True, metadata={"sha256": row["sha256"], "uri": dg.MetadataValue.path(row["uri"])})


@dg.asset_check(asset="checkpoint", partitions_def=checkpoints_partitions,
                description="The checkpoint is still there: not deleted by retention.")
def checkpoint_present(context: dg.AssetCheckExecutionContext, orbit: OrbitResource) -> dg.AssetCheckResult:
    key, row = _checkpoint_row(orbit, context)
    if row is None:
        return dg.AssetCheckResult(passed=False, metadata={"detail": f"no checkpoint {key} in the ledger"})
    if row["deleted_at"] is not None:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   metadata={"detail": f"deleted: {row['deleted_reason']}"})
    return dg.AssetCheckResult(passed=True)


@dg.asset_check(asset="evaluation", partitions_def=checkpoints_partitions,
                description="The evaluation's metrics are finite numbers (re-read from the ledger).")
def evaluation_metrics_valid(context: dg.AssetCheckExecutionContext, orbit: OrbitResource) -> dg.AssetCheckResult:
    key = _checkpoint_key(context)
    rows = orbit.settings().ledger().rows(
        "SELECT suite, name, value FROM metric_points WHERE checkpoint_key = ? AND source = 'eval'", [key])
    if not rows:
        return dg.AssetCheckResult(passed=False, metadata={"detail": f"{key} has no evaluation result"})
    bad = [f"{r['suite']}:{r['name']}" for r in rows if r["value"] is None or not math.isfinite(float(r["value"]))]
    return dg.AssetCheckResult(passed=not bad, metadata={"metrics": len(rows), "not_finite": ", ".join(bad) or "none"})


@dg.asset_check(asset="evaluation", description="Every live checkpoint of an evaluable job has a result for its "
                                                "job's current suite (none pending, failed or skipped).")
def every_checkpoint_evaluated(orbit: OrbitResource) -> dg.AssetCheckResult:
    rows = orbit.settings().ledger().rows(
        """SELECT e.state, count(*) AS n FROM evaluations e
           JOIN checkpoints c ON c.checkpoint_key = e.checkpoint_key
           WHERE c.deleted_at IS NULL GROUP BY e.state""")
    counts = {r["state"]: int(r["n"]) for r in rows}
    missing = sum(n for state, n in counts.items() if state != "SUCCEEDED")
    return dg.AssetCheckResult(passed=missing == 0, severity=dg.AssetCheckSeverity.WARN,
                               metadata={**{state.lower(): n for state, n in counts.items()}, "not_evaluated": missing})


CHECKS = [checkpoint_integrity, checkpoint_present, evaluation_metrics_valid, every_checkpoint_evaluated]
