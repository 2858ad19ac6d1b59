"""The launchpad's doors: submit a job, retry it, cancel it, from the Dagster UI.

Each is a one-op job whose config is typed (the template is a choice among those this
code location knows) and goes through the same validation, with the same one-line
messages, as `orbit submit`/`retry`/`cancel`. A refused launch fails its run with that
message and writes nothing; a valid submit creates the job (QUEUED) and its `training_run`
partition, and the queue sensor launches its training run within seconds.
"""

from enum import Enum
from typing import List

import dagster as dg

from ..assets.partitions import JOBS
from ..control.submit import cancel, retry, submit
from ..core.errors import OrbitError
from ..core.submission import parse_set_args
from ..core.templates import list_templates
from ..resources import OrbitResource
from ..settings import Settings
from .runs import terminate_runs_of

# The launchpad's choice of templates, read when the code location loads: the shipped ones and
# the settings' template directories (ORBIT_TEMPLATES, else $ORBIT_HOME/templates).
TemplateName = Enum("TemplateName", {name.replace("-", "_"): name
                                     for name in list_templates(Settings.from_env().template_dirs)})


class SubmitConfig(dg.Config):
    """A new job: a template, the overrides it allows (`key=value`, as `orbit submit --set`), an experiment."""

    template: TemplateName = next(iter(TemplateName))  # type: ignore[valid-type]
    overrides: List[str] = []
    experiment: str = "default"
    project: str = "default"


class RetryConfig(dg.Config):
    """A new attempt of a finished job (same job id), changed only through its template's whitelist."""

    job_id: str
    overrides: List[str] = []
    from_scratch: bool = False


class CancelConfig(dg.Config):
    """Stop a job now: its workload stopped, its instance released and billed to the second."""

    job_id: str


def _refused(exc: OrbitError) -> dg.Failure:
    return dg.Failure(description=str(exc), metadata={"field": str(exc.field or ""), "value": str(exc.value)[:200]},
                      allow_retries=False)


@dg.op(description="Validate and queue a new job; its training run follows from the queue sensor.")
def submit_op(context: dg.OpExecutionContext, config: SubmitConfig, orbit: OrbitResource) -> str:
    template = config.template.value if isinstance(config.template, Enum) else str(config.template)
    try:
        job_id = submit(orbit.settings(), template, parse_set_args(config.overrides), experiment=config.experiment,
                        project=config.project)
    except OrbitError as exc:
        raise _refused(exc) from None
    context.instance.add_dynamic_partitions(JOBS, [job_id])
    context.instance.add_run_tags(context.run_id, {"orbit/job": job_id, "orbit/experiment": config.experiment})
    context.log.info(f"queued {job_id} ({template}, experiment {config.experiment}); the job_queue_sensor launches "
                     "its training_run within seconds")
    return job_id


@dg.op(description="Queue the next attempt of a finished job.")
def retry_op(context: dg.OpExecutionContext, config: RetryConfig, orbit: OrbitResource) -> int:
    try:
        attempt = retry(orbit.settings(), config.job_id, parse_set_args(config.overrides),
                        from_scratch=config.from_scratch)
    except OrbitError as exc:
        raise _refused(exc) from None
    context.instance.add_run_tags(context.run_id, {"orbit/job": config.job_id, "orbit/attempt": str(attempt)})
    context.log.info(f"{config.job_id}: attempt {attempt} queued")
    return attempt


@dg.op(description="Cancel a job: its workload stopped, its instance released and billed, its runs terminated.")
def cancel_op(context: dg.OpExecutionContext, config: CancelConfig, orbit: OrbitResource) -> bool:
    try:
        changed = cancel(orbit.settings(), config.job_id, reason=f"cancelled from Dagster run {context.run_id}")
    except OrbitError as exc:
        raise _refused(exc) from None
    stopped = terminate_runs_of(context.instance, config.job_id, but=context.run_id)
    context.log.info(f"{config.job_id}: {'cancelled' if changed else 'had already ended'}; "
                     f"{len(stopped)} run(s) terminated")
    return changed


@dg.job(tags={"orbit/kind": "submit"}, description="Launch a new training job: template, overrides, experiment.")
def submit_job() -> None:
    submit_op()


@dg.job(tags={"orbit/kind": "retry"}, description="Retry a finished job as a new attempt.")
def retry_job() -> None:
    retry_op()


@dg.job(tags={"orbit/kind": "cancel"}, description="Cancel a job now: workload stopped, instance released and billed.")
def cancel_job() -> None:
    cancel_op()
