"""Dagster runs of a job: which are in progress, whether their workers live, and terminating them."""
from __future__ import annotations

import time
from dataclasses import dataclass

import dagster as dg

from ..control import liveness
from ..ledger import Ledger

IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED]
# Not started yet: no worker to judge (Dagster's run monitoring fails a run stuck starting).
PENDING = {dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING}
# A worker that has not written its record yet is loading the code location (~2 s here; more
# on a loaded machine). Past this, a run without a record is judged by its pid.
RECORD_GRACE_S = 120.0


@dataclass(frozen=True)
class Verdict:
    """What is known of a run's worker: does its process live, does it still do the run's work."""

    alive: bool
    working: bool
    why: str = ""


LIVE = Verdict(True, True)


def _started_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The pid that reported the run's start (its worker), from Dagster's own event log."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.RUN_START, limit=1).records
    event = records[0].event_log_entry.dagster_event if records else None
    return event.pid if event is not None else None


def _unrecorded(instance: dg.DagsterInstance, record: dg.RunRecord, now: float) -> Verdict:
    started = record.start_time or record.create_timestamp.timestamp()
    if now - started < RECORD_GRACE_S:
        return LIVE
    pid = _started_pid(instance, record.dagster_run.run_id)
    if pid is None or liveness.pid_alive_here(pid):
        return LIVE  # nothing to judge it by: never fail what cannot be shown dead
    return Verdict(False, False, f"its worker process (pid {pid}) is gone and it never wrote a liveness record")


def verdicts(instance: dg.DagsterInstance, ledger: Ledger, records: list[dg.RunRecord], *,
             timeout_s: float = liveness.DEFAULT_TIMEOUT_S) -> dict[str, Verdict]:
    """Each run's verdict (one ledger query for all of them)."""
    started = [r for r in records if r.dagster_run.status not in PENDING]
    found = liveness.workers(ledger, [r.dagster_run.run_id for r in started])
    now = time.time()
    out: dict[str, Verdict] = {}
    for record in records:
        run_id = record.dagster_run.run_id
        worker = found.get(run_id)
        if record.dagster_run.status in PENDING:
            out[run_id] = LIVE
        elif worker is None:
            out[run_id] = _unrecorded(instance, record, now)
        else:
            alive = worker.process_alive(timeout_s=timeout_s, now=now)
            working = alive and worker.ended_at is None
            out[run_id] = Verdict(alive, working, "" if working else
                                  ("its worker ended its work" if alive else worker.why_dead()))
    return out


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
