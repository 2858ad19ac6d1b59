"""`training_run` (one partition per job) and `checkpoint` (one partition per (job, checkpoint)).

Materialising a `training_run` partition launches the job's queued attempt through its
GPU-rental resource (or re-attaches to it) and follows it: to its end, or with hand-off
(`ORBIT_FOLLOW=daemon`, the team profile) for `ORBIT_HANDOFF_AFTER_S`; an attempt still
running then is materialised as RUNNING, and the daemon requests the next run when there is
something to do (a checkpoint, the end). Each checkpoint the attempt registers is reported
as a materialisation of the `checkpoint` asset, with the results of its integrity and
presence checks. Checkpoints come only from training, so `checkpoint` is
declared but not materialisable on its own; its upstream is exactly its own job's
`training_run` partition. Terminating the run (the UI's Terminate, or `orbit cancel`)
cancels the attempt: the instance is released and billed to the second, the job is
CANCELLED, and the run shows CANCELED.
"""

import warnings

import dagster as dg

from ..control.attempt import run_attempt
from ..control.submit import cancel
from ..core.errors import NotFound, OrbitError
from ..resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource, active
from .metadata import loss_curve
from .partitions import JOB_DIM, checkpoints_partitions, jobs_partitions
from .reporting import DagsterReporter

# Chosen on purpose: a checkpoint's upstream is exactly its own job's training partition,
# which only this (beta) mapping says. Filtered once here, not on every code-server load.
warnings.filterwarnings("ignore", message="Class `MultiToSingleDimensionPartitionMapping` is currently in beta",
                        category=dg.BetaWarning)

checkpoint = dg.AssetSpec(
    "checkpoint",
    partitions_def=checkpoints_partitions,
    deps=[dg.AssetDep("training_run", partition_mapping=dg.MultiToSingleDimensionPartitionMapping(JOB_DIM))],
    description="A complete, verified checkpoint (manifest + sha256 of every file), reported by its own job's "
                "training run. Partition: (job, `a<attempt>/<step>`).",
    group_name="training",
    kinds={"torch"},
)


@dg.asset(
    partitions_def=jobs_partitions,
    group_name="training",
    kinds={"python"},
    pool="orbit-train",
    description="One job's training: its current attempt on a rented GPU, resumed from the last checkpoint "
                "of its lineage. Launch new jobs with the `submit_job` launchpad or `orbit submit`.",
)
def training_run(context: dg.AssetExecutionContext, orbit: OrbitResource, sim_market: SimMarketResource,
                 ssh_rental: SshRentalResource, aws_spot: AwsSpotResource) -> dg.MaterializeResult:
    job_id = context.partition_key
    settings = orbit.settings()
    with active(sim_market, ssh_rental, aws_spot):
        try:
            outcome = run_attempt(settings, job_id, dagster_run_id=context.run_id, reporter=DagsterReporter(context))
        except NotFound:
            raise dg.Failure(description=f"no job {job_id!r} in the ledger: a training_run partition is made by "
                                         "submitting a job (the submit_job launchpad, or `orbit submit`); nothing "
                                         "was rented", allow_retries=False) from None
        except OrbitError as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        except dg.DagsterExecutionInterruptedError:
            # A person terminated this run: the attempt ends here, its GPU released.
            cancel(settings, job_id, reason=f"its Dagster run {context.run_id} was terminated")
            raise
    tags = {"orbit/attempt": str(outcome.attempt), "orbit/outcome": outcome.state,
            "orbit/failure_class": outcome.failure_class or "none"}
    if outcome.handed_off:
        tags["orbit/handed_off"] = "1"
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
        "handed_off": outcome.handed_off,
        **loss_curve(settings.ledger(), job_id),
    }
    if outcome.already_ended and not context.run.tags.get("orbit/reattach"):
        raise dg.Failure(description=f"{job_id} attempt {outcome.attempt} had already ended {outcome.state}; nothing "
                                     "was launched (a new attempt is a retry: the retry_job launchpad or "
                                     "`orbit retry`)", metadata=metadata, allow_retries=False)
    if outcome.handed_off:
        # Still training: the daemon watches it and requests a run when there is something
        # to collect or to close (control/handoff.py); that run materialises this again.
        return dg.MaterializeResult(metadata=metadata)
    if outcome.state != "SUCCEEDED":
        raise dg.Failure(
            description=f"{job_id} attempt {outcome.attempt} ended {outcome.state} "
            f"({outcome.failure_class or 'unknown'}): {outcome.reason}",
            metadata=metadata,
            allow_retries=False,  # retries are orbit's (per failure class), not Dagster's
        )
    return dg.MaterializeResult(metadata=metadata)
