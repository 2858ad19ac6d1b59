"""Dagster runs of a job: which are in progress, and terminating them (a person's cancel)."""
from __future__ import annotations

import dagster as dg

IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED]


def in_flight_tags(instance: dg.DagsterInstance) -> list[dict[str, str]]:
    """The tags of every run queued, in progress or being cancelled (one storage query)."""
    statuses = [*IN_PROGRESS, dg.DagsterRunStatus.CANCELING]
    return [dict(r.dagster_run.tags) for r in instance.get_run_records(dg.RunsFilter(statuses=statuses))]


def tag_limits(instance: dg.DagsterInstance) -> list[dict]:
    """The run queue's tag concurrency limits as dagster.yaml has them (none without a queue)."""
    queue = instance.get_concurrency_config().run_queue_config
    return [dict(item) for item in (queue.tag_concurrency_limits if queue else [])]


def runs_in_progress(instance: dg.DagsterInstance, job_id: str) -> list[dg.DagsterRun]:
    """Runs that work on this job now: its training runs (partition) and its evaluations (tag)."""
    found = {}
    for tags in ({"dagster/partition": job_id}, {"orbit/job": job_id}):
        for record in instance.get_run_records(dg.RunsFilter(statuses=IN_PROGRESS, tags=tags)):
            found[record.dagster_run.run_id] = record.dagster_run
    return list(found.values())


def terminate_runs_of(instance: dg.DagsterInstance, job_id: str, *, but: str | None = None) -> list[str]:
    """Terminate them (they show CANCELED); a queued one is dropped from the queue."""
    stopped = []
    for run in runs_in_progress(instance, job_id):
        if run.run_id == but:
            continue
        if run.status == dg.DagsterRunStatus.QUEUED:
            instance.report_run_canceled(run, message="the job was cancelled")
        else:
            instance.run_launcher.terminate(run.run_id)
        stopped.append(run.run_id)
    return stopped
