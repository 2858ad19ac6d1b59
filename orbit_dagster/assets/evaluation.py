"""`evaluation`: one eval job per checkpoint partition and suite, on a rented GPU; metrics as metadata.

Nothing is rented for a checkpoint whose bytes no longer match the ledger's sha256 (its
integrity check fails and the evaluation with it) or that was deleted. The suite comes from
the run's `orbit/suite` tag (sensor, backfill) or the job template's current suite.
Terminating the run stops the evaluation, releases its instance and marks it CANCELLED.
"""

import dagster as dg

from ..control.evaluate import evaluate_checkpoint
from ..core.errors import CheckpointIntegrityError, OrbitError
from ..resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource, active
from .partitions import checkpoint_key_of, checkpoints_partitions
from .reporting import CHECKPOINT_KEY, DagsterReporter, check_result


@dg.asset(
    partitions_def=checkpoints_partitions,
    deps=["checkpoint"],
    group_name="evaluation",
    kinds={"python"},
    pool="orbit-eval",
    description="Held-out evaluation of one checkpoint with its job's suite; the script reports "
                "{\"metrics\": {...}}. Partition: (job, `a<attempt>/<step>`), the checkpoint's own.",
)
def evaluation(context: dg.AssetExecutionContext, orbit: OrbitResource, sim_market: SimMarketResource,
               ssh_rental: SshRentalResource, aws_spot: AwsSpotResource) -> dg.MaterializeResult:
    key = checkpoint_key_of(context.partition_key)
    settings = orbit.settings()
    with active(sim_market, ssh_rental, aws_spot):
        try:
            result = evaluate_checkpoint(settings, key, suite=context.run.tags.get("orbit/suite"),
                                         dagster_run_id=context.run_id, reporter=DagsterReporter(context))
        except CheckpointIntegrityError as exc:
            name = "checkpoint_present" if "deleted" in str(exc) else "checkpoint_integrity"
            context.log_event(check_result(CHECKPOINT_KEY, name, key, False, detail=str(exc)[:1000]))
            raise dg.Failure(description=f"{exc}; nothing was rented", allow_retries=False) from None
        except OrbitError as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
    if result.get("already"):
        raise dg.Failure(description=f"{key} ({result['suite']}) is {result['state']} already "
                                     f"(run {result['dagster_run_id']}); nothing was rented", allow_retries=False)
    metrics = result["metrics"]
    metadata: dict = {name: dg.MetadataValue.float(float(v)) for name, v in metrics.items()}
    metadata.update({"suite": result["suite"], "seconds": round(result["seconds"], 3), "instance": result["instance_id"],
                     "usd": dg.MetadataValue.float(round(float(result.get("usd") or 0.0), 8)),
                     "checkpoint": key})
    return dg.MaterializeResult(metadata=metadata)
