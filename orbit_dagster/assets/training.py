"""`training_run` (one partition per job) and `checkpoint` (one partition per `<job>/<step>`).

Materialising a `training_run` partition launches the job's queued attempt through its
GPU-rental provider (or re-attaches to it) and follows it; each checkpoint the attempt
registers is reported as a materialisation of the `checkpoint` asset. Checkpoints come only
from training, so `checkpoint` is declared but not materialisable on its own.
"""

import dagster as dg

from ..control.attempt import run_attempt
from ..resources import OrbitResource
from .partitions import checkpoints_partitions, jobs_partitions
from .reporting import DagsterReporter

checkpoint = dg.AssetSpec(
    "checkpoint",
    partitions_def=checkpoints_partitions,
    deps=[dg.AssetDep("training_run", partition_mapping=dg.AllPartitionMapping())],
    description="A complete, verified checkpoint (manifest + sha256 of every file), reported by its training run.",
    group_name="training",
    kinds={"torch"},
)


@dg.asset(
    partitions_def=jobs_partitions,
    group_name="training",
    kinds={"python"},
    description="One job's training: its current attempt on a rented GPU, resumed from the last checkpoint.",
)
def training_run(context: dg.AssetExecutionContext, orbit: OrbitResource) -> dg.MaterializeResult:
    job_id = context.partition_key
    outcome = run_attempt(orbit.settings(), job_id, dagster_run_id=context.run_id, reporter=DagsterReporter(context))
    tags = {"orbit/attempt": str(outcome.attempt), "orbit/outcome": outcome.state,
            "orbit/failure_class": outcome.failure_class or "none"}
    context.instance.add_run_tags(context.run_id, tags)
    metadata = {
        "attempt": outcome.attempt,
        "outcome": outcome.state,
        "failure_class": outcome.failure_class or "none",
        "instance": outcome.instance_id or "",
        "checkpoints": len(outcome.checkpoints),
        "last_step": outcome.last_step if outcome.last_step is not None else -1,
        "usd": dg.MetadataValue.float(round(outcome.usd, 6)),
        "reattached": outcome.reattached,
    }
    if outcome.state != "SUCCEEDED":
        raise dg.Failure(
            description=f"{job_id} attempt {outcome.attempt} ended {outcome.state} "
            f"({outcome.failure_class or 'unknown'}): {outcome.reason}",
            metadata=metadata,
            allow_retries=False,  # retries are orbit's (per failure class), not Dagster's
        )
    return dg.MaterializeResult(metadata=metadata)
