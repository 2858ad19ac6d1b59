"""`evaluation`: one eval job per checkpoint partition and suite, on a rented GPU; metrics as metadata.

Nothing is rented for a checkpoint whose bytes no longer match the ledger's sha256 (its
integrity check fails and the evaluation with it) or that was deleted. The suite comes from
the run's `orbit/suite` tag (sensor, backfill) or the job template's current suite.
Terminating the run stops the evaluation, releases its instance and marks it CANCELLED.
With ORBIT_EVAL_SHARE > 1 the run also evaluates its job's other pending checkpoints of the
suite on the same instance, and reports each as a materialisation of that checkpoint's own
partition (metadata `evaluated_with`: the partition the run was for). A run of a backfill
evaluates its own partition only: a backfill is a selection (a person's subset in the UI,
the schedule's missing pairs), and its daemon launches the rest of it run by run, so a run
that took more would evaluate what was not selected, or what a later run of it is for.
"""

import dagster as dg

from ..control.evaluate import evaluate_checkpoint
from ..core.errors import CheckpointIntegrityError, OrbitError
from ..ops.runs import in_flight_tags
from ..resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource, active
from .partitions import add_checkpoint_partitions, checkpoint_key_of, checkpoints_partitions, partition_of
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
                                         dagster_run_id=context.run_id, reporter=DagsterReporter(context),
                                         share=share_of(context.run.tags, settings.eval_share),
                                         exclude=queued_elsewhere(context.instance))
        except CheckpointIntegrityError as exc:
            name = "checkpoint_present" if "deleted" in str(exc) else "checkpoint_integrity"
            context.log_event(check_result(CHECKPOINT_KEY, name, key, False, detail=str(exc)[:1000]))
            raise dg.Failure(description=f"{exc}; nothing was rented", allow_retries=False) from None
        except OrbitError as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
    if result.get("already"):
        raise dg.Failure(description=f"{key} ({result['suite']}) is {result['state']} already "
                                     f"(run {result['dagster_run_id']}); nothing was rented", allow_retries=False)
    # The checkpoints evaluated on the same instance: each its own partition's materialisation,
    # reported by this run (its lineage in the UI is the same as if it had a run of its own).
    shared = result.get("shared", [])
    add_checkpoint_partitions(context.instance, [other["checkpoint_key"] for other in shared])  # present already, as a rule
    for other in shared:
        context.log_event(dg.AssetMaterialization(
            asset_key=context.asset_key, partition=str(partition_of(other["checkpoint_key"])),
            metadata={**_metadata(other), "evaluated_with": key}))
    for other, why in result.get("shared_failed", {}).items():
        context.log.warning(f"evaluation of {other} (on the same instance) failed and was given back: {why}")
    return dg.MaterializeResult(metadata=_metadata(result))


def _metadata(result: dict) -> dict:
    metadata: dict = {name: dg.MetadataValue.float(float(v)) for name, v in result["metrics"].items()}
    metadata.update({"suite": result["suite"], "seconds": round(result["seconds"], 3), "instance": result["instance_id"],
                     "usd": dg.MetadataValue.float(round(float(result.get("usd") or 0.0), 8)),
                     "checkpoint": result["checkpoint_key"]})
    return metadata


def share_of(tags: dict, eval_share: int) -> int:
    """How many checkpoints this run may evaluate: ORBIT_EVAL_SHARE, or 1 in a backfill."""
    return 1 if "dagster/backfill" in tags else eval_share


def queued_elsewhere(instance: dg.DagsterInstance) -> set[str]:
    """Checkpoints whose own evaluation run is queued or in progress (a backfill's, the UI's):
    left to it, not taken onto this run's instance."""
    keys = set()
    for tags in in_flight_tags(instance):
        partition = tags.get("dagster/partition", "")
        if tags.get("orbit/checkpoint"):
            keys.add(tags["orbit/checkpoint"])
        elif "|" in partition:  # a checkpoint's partition (a training run's is its job)
            keys.add(checkpoint_key_of(partition))
    return keys
