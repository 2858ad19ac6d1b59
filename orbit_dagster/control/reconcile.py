"""Reconcile the ledger with the providers: notices, dead hosts, unfollowed and LOST attempts.

Runs from the spot-interruption sensor every few seconds. An active attempt is normally
followed by its `training_run` run, which handles its end; this pass covers what that run
cannot: a notice is recorded as soon as the provider publishes it, a host that died while
no run followed it is marked LOST and billed, an attempt whose run died while its host
lives is re-attached, and LOST jobs are requeued. Every write is an idempotent transition.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..ledger import records as R
from ..providers.base import RunHandle
from .billing import close_lost_attempt, stop_cancelled
from .context import bundle_and_provider
from .recovery import recover_lost
from .settings import Settings


@dataclass
class ReconcileReport:
    notices: list[dict] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    reattach: list[dict] = field(default_factory=list)
    recovered: list[dict] = field(default_factory=list)

    @property
    def actions(self) -> int:
        return len(self.notices) + len(self.lost) + len(self.reattach) + len(self.recovered)

    def lines(self) -> list[str]:
        out = [f"notice for {n['job_id']} on {n['instance_id']}, deadline {n['deadline']}" for n in self.notices]
        out += [f"{j}: host gone while no run followed it, marked LOST" for j in self.lost]
        out += [f"{r['job_id']} attempt {r['attempt']}: no run follows it, re-attaching" for r in self.reattach]
        out += [f"{r['job_id']}: {r['action']} {r.get('attempt', '')} {r.get('reason', '')}".strip() for r in self.recovered]
        return out


def cancelled_but_running(ledger) -> list[dict]:
    """Attempts of cancelled jobs whose workload was never stopped (no run followed it)."""
    return ledger.rows(
        """SELECT s.job_id, r.attempt, r.run_id, r.handle FROM job_status s
           JOIN run_status r ON r.job_id = s.job_id AND r.attempt = s.attempt
           WHERE s.state = 'CANCELLED' AND r.state = 'RUNNING'"""
    )


def active_attempts(ledger) -> list[dict]:
    return ledger.rows(
        """SELECT s.job_id, s.attempt, r.run_id, r.handle FROM job_status s
           JOIN run_status r ON r.job_id = s.job_id AND r.attempt = s.attempt
           WHERE s.state = 'RUNNING' AND r.state = 'RUNNING'"""
    )


def reconcile(settings: Settings, followed: Callable[[str, int], bool] = lambda job_id, attempt: True) -> ReconcileReport:
    """`followed(job_id, attempt)` says whether a live run follows that attempt."""
    ledger = settings.ledger()
    report = ReconcileReport()
    noticed = {r["instance_id"] for r in ledger.rows("SELECT DISTINCT instance_id FROM events WHERE kind = 'notice'")}
    for row in active_attempts(ledger):
        job_id, attempt = row["job_id"], int(row["attempt"])
        handle = RunHandle.model_validate_json(row["handle"])
        _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
        inst = handle.instance
        if inst.instance_id not in noticed:
            for notice in provider.notices(inst):
                lead = (notice.deadline - notice.received_at).total_seconds() if notice.deadline else None
                ledger.commit({"events": [R.event("notice", job_id=job_id, run_id=row["run_id"], instance_id=inst.instance_id,
                                                  action=notice.action, deadline=notice.deadline, lead_seconds=lead,
                                                  source=notice.source)]})
                report.notices.append({"job_id": job_id, "instance_id": inst.instance_id, "deadline": notice.deadline})
        if followed(job_id, attempt):
            continue
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
    for row in ledger.rows("SELECT job_id FROM job_status WHERE state = 'LOST'"):
        result = recover_lost(settings, row["job_id"])
        if result["action"] != "none":
            report.recovered.append(result)
    return report
