"""Reconcile the ledger with the providers: every non-terminal state has an owner and a deadline.

| state                 | owner                                   | when the owner is gone or late |
|-----------------------|-----------------------------------------|--------------------------------|
| job DISPATCHING       | the run that won QUEUED -> DISPATCHING  | no live run follows it, or past `deadline_at`: what it rented is released, the attempt ends LOST (infrastructure) and is retried |
| job RUNNING           | the run following the attempt           | no live run: re-attach (host alive) or LOST and billed (host gone) |
| job CANCELLED, run still RUNNING | the run following it         | no live run: the workload is stopped and billed |
| job LOST              | this pass                               | requeued (next attempt) or FAILED past `max_interruptions` |
| evaluation RUNNING    | its evaluation run                      | see `evaluate.reconcile_evaluations` |

Notices are recorded as soon as a provider publishes them. Every write is an idempotent
compare-and-set, so this pass and the runs it watches can race without harm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..core.lifecycle import JobState
from ..ledger import Ledger
from ..ledger import records as R
from ..providers.base import InstanceHandle, RunHandle
from .billing import close_lost_attempt, release, stop_cancelled
from .context import bundle_and_provider
from .providers import provider_for
from .recovery import recover_lost
from .settings import Settings

Followed = Callable[[str, int], bool]


@dataclass
class ReconcileReport:
    notices: list[dict] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    reattach: list[dict] = field(default_factory=list)
    recovered: list[dict] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)

    @property
    def actions(self) -> int:
        return len(self.notices) + len(self.lost) + len(self.reattach) + len(self.recovered) + len(self.abandoned)

    def lines(self) -> list[str]:
        out = [f"notice for {n['job_id']} on {n['instance_id']}, deadline {n['deadline']}" for n in self.notices]
        out += [f"{j}: host gone while no run followed it, marked LOST" for j in self.lost]
        out += [f"{r['job_id']} attempt {r['attempt']}: no run follows it, re-attaching" for r in self.reattach]
        out += [f"{j}: dispatch abandoned (its run is gone or past its deadline), attempt ended" for j in self.abandoned]
        out += [f"{r['job_id']}: {r['action']} {r.get('attempt', '')} {r.get('reason', '')}".strip() for r in self.recovered]
        return out


def active_attempts(ledger: Ledger) -> list[dict]:
    return ledger.rows(
        """SELECT j.job_id, j.attempt, r.run_id, r.handle, r.instance_id FROM runs r
           JOIN jobs j ON j.job_id = r.job_id AND j.attempt = r.attempt
           WHERE r.state = 'RUNNING' AND j.state = 'RUNNING'""")


def cancelled_but_running(ledger: Ledger) -> list[dict]:
    """Attempts of cancelled jobs whose workload was never stopped (no run followed it)."""
    return ledger.rows(
        """SELECT j.job_id, r.attempt, r.run_id, r.handle FROM runs r
           JOIN jobs j ON j.job_id = r.job_id AND j.attempt = r.attempt
           WHERE r.state = 'RUNNING' AND j.state = 'CANCELLED'""")


def record_notices(settings: Settings, ledger: Ledger, attempts: list[dict], report: ReconcileReport) -> None:
    noticed = {r["instance_id"] for r in ledger.rows(
        """SELECT DISTINCT e.instance_id FROM runs r JOIN events e ON e.instance_id = r.instance_id
           WHERE r.state = 'RUNNING' AND e.kind = 'notice'""")}
    for row in attempts:
        if row["instance_id"] in noticed:
            continue
        handle = RunHandle.model_validate_json(row["handle"])
        _, provider = bundle_and_provider(settings, ledger, row["job_id"], int(row["attempt"]))
        for notice in provider.notices(handle.instance):
            lead = (notice.deadline - notice.received_at).total_seconds() if notice.deadline else None
            ledger.commit({"events": [R.event("notice", job_id=row["job_id"], run_id=row["run_id"],
                                              instance_id=handle.instance.instance_id, action=notice.action,
                                              deadline=notice.deadline, lead_seconds=lead, source=notice.source)]})
            report.notices.append({"job_id": row["job_id"], "instance_id": handle.instance.instance_id,
                                   "deadline": notice.deadline})


def abandon_dispatch(settings: Settings, ledger: Ledger, followed: Followed, report: ReconcileReport) -> None:
    """DISPATCHING whose run is gone or late: release what it rented, end the attempt."""
    now = time.time()
    for job in ledger.rows("SELECT job_id, attempt, deadline_at FROM jobs WHERE state = 'DISPATCHING'"):
        job_id, attempt = job["job_id"], int(job["attempt"])
        late = job["deadline_at"] is not None and now > float(job["deadline_at"])
        if not late and followed(job_id, attempt):
            continue
        run_id = R.run_id_for(job_id, attempt)
        for inst in ledger.rows("SELECT handle FROM instances WHERE run_id = ? AND stopped_at IS NULL", [run_id]):
            instance = InstanceHandle.model_validate_json(inst["handle"])
            _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
            release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                    checkpoints=[], lost=False, last_progress=None, reason="dispatch abandoned")
        why = "past its dispatch deadline" if late else "the run dispatching it is gone"
        if R.transition(ledger, job_id, JobState.LOST, attempt=attempt, reason=f"dispatch abandoned: {why}",
                        failure_class="infrastructure", only_from={JobState.DISPATCHING},
                        extra={"events": [R.event("dispatch_abandoned", job_id=job_id, run_id=run_id, reason=why)]}):
            report.abandoned.append(job_id)


def release_orphans(settings: Settings, ledger: Ledger) -> int:
    """Training instances still metered although their attempt has ended (a run that died
    between the end of its workload and its bill): stop and bill them."""
    rows = ledger.rows(
        """SELECT i.instance_id, i.handle, i.job_id, i.run_id, r.attempt FROM instances i
           JOIN runs r ON r.run_id = i.run_id AND r.instance_id = i.instance_id
           WHERE i.stopped_at IS NULL AND i.purpose = 'train' AND r.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')""")
    for row in rows:
        instance = InstanceHandle.model_validate_json(row["handle"])
        release(settings, ledger, provider_for(settings, _backend(settings, ledger, row)), instance,
                job_id=row["job_id"], run_id=row["run_id"], attempt=int(row["attempt"]),
                checkpoints=[], lost=False, last_progress=None, reason="attempt already ended")
    return len(rows)


def _backend(settings: Settings, ledger: Ledger, row: dict) -> str:
    bundle, _ = bundle_and_provider(settings, ledger, row["job_id"], int(row["attempt"]))
    return bundle.spec.execution_request.backend_key


def reconcile(settings: Settings, followed: Followed = lambda job_id, attempt: True) -> ReconcileReport:
    """`followed(job_id, attempt)` says whether a live run follows (or dispatches) that attempt."""
    ledger = settings.ledger()
    report = ReconcileReport()
    attempts = active_attempts(ledger)
    record_notices(settings, ledger, attempts, report)
    for row in attempts:
        job_id, attempt = row["job_id"], int(row["attempt"])
        if followed(job_id, attempt):
            continue
        handle = RunHandle.model_validate_json(row["handle"])
        _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
        status = provider.status(handle)
        if status.state == "lost":
            if close_lost_attempt(settings, ledger, provider, handle, job_id=job_id, attempt=attempt,
                                  run_id=row["run_id"], reason=status.reason or "host lost"):
                report.lost.append(job_id)
        else:
            report.reattach.append({"job_id": job_id, "attempt": attempt})
    for row in cancelled_but_running(ledger):
        if followed(row["job_id"], int(row["attempt"])):
            continue  # the run following it stops it
        handle = RunHandle.model_validate_json(row["handle"])
        _, provider = bundle_and_provider(settings, ledger, row["job_id"], int(row["attempt"]))
        stop_cancelled(settings, ledger, provider, handle, job_id=row["job_id"], attempt=int(row["attempt"]),
                       run_id=row["run_id"])
        report.lost.append(f"{row['job_id']} (cancelled: workload stopped)")
    abandon_dispatch(settings, ledger, followed, report)
    release_orphans(settings, ledger)
    for row in ledger.rows("SELECT job_id FROM jobs WHERE state = 'LOST'"):
        result = recover_lost(settings, row["job_id"])
        if result["action"] != "none":
            report.recovered.append(result)
    return report
