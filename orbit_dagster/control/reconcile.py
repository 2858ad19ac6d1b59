"""Reconcile the ledger with the providers: every non-terminal state has an owner and a deadline.

| state                 | owner                                   | when the owner is gone or late |
|-----------------------|-----------------------------------------|--------------------------------|
| job DISPATCHING       | the run that won QUEUED -> DISPATCHING  | no live run follows it, or past `deadline_at`: what it rented is released, the attempt ends LOST (infrastructure) and is retried |
| job RUNNING           | the run following the attempt           | no live run: re-attach (host alive) or LOST and billed (host gone) |
| job CANCELLED, run still RUNNING | the run following it         | no live run: the workload is stopped and billed |
| job LOST              | the run that closed the attempt         | requeued (next attempt) or FAILED past `max_interruptions` |
| instance metered, attempt ended | the run that ended it         | stopped and billed |
| evaluation RUNNING    | its evaluation run                      | see `evaluate.reconcile_evaluations` |

"A live run" is one whose worker process lives (control/liveness.py): a run left STARTED by a
SIGKILLed worker, a killed code server or a reboot owns nothing, so after any death of the
control plane the next ticks take up what it left: re-attach (host up, from the recorded
offset), close and bill (host gone, or workload ended), requeue.

`decide()` only reads (and records notices as soon as a provider publishes them); every
decision that rents, releases or requeues is a `Decision` the Dagster sensor turns into a
run that carries it out (`act()`), so each has a run record with its tags. `reconcile()`
decides and acts in one go, for the CLI and for tests without Dagster. Every write is an
idempotent compare-and-set, so two deciders, or a decider and the run it watches, race
without harm.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..core.lifecycle import JobState
from ..ledger import Ledger
from ..ledger import records as R
from ..providers.base import InstanceHandle, RunHandle
from ..settings import Settings
from .billing import attempt_checkpoints, close_lost_attempt, release, stop_cancelled
from .context import Attempts, bundle_and_provider, concurrently
from .group import GroupWatch
from .handoff import WATCH, Watch
from .recovery import recover_lost

Followed = Callable[[str, int], bool]
LOST_GRACE_S = 15.0


@dataclass(frozen=True)
class Decision:
    action: str  # reattach | close_lost | stop_cancelled | abandon_dispatch | release_orphan | recover
    job_id: str
    attempt: int
    reason: str = ""
    run_id: str | None = None
    instance_id: str | None = None
    provider: str | None = None
    offer_id: str | None = None
    failure_class: str | None = None

    @property
    def key(self) -> str:
        """One run per decision, whoever decides it how often."""
        return f"{self.action}:{self.instance_id or self.run_id or self.job_id}:attempt-{self.attempt}"

    def tags(self) -> dict[str, str]:
        tags = {"orbit/job": self.job_id, "orbit/attempt": str(self.attempt), "orbit/action": self.action,
                "orbit/kind": "rental"}
        for k, v in (("orbit/provider", self.provider), ("orbit/offer", self.offer_id),
                     ("orbit/instance", self.instance_id), ("orbit/failure_class", self.failure_class)):
            if v:
                tags[k] = v
        return tags

    def line(self) -> str:
        return f"{self.job_id} attempt {self.attempt}: {self.action}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class ReconcileReport:
    notices: list[dict] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    done: list[str] = field(default_factory=list)

    @property
    def actions(self) -> int:
        return len(self.notices) + len(self.decisions)

    @property
    def reattach(self) -> list[Decision]:
        return [d for d in self.decisions if d.action == "reattach"]

    def lines(self) -> list[str]:
        out = [f"notice for {n['job_id']} on {n['instance_id']}, deadline {n['deadline']}" for n in self.notices]
        return out + [d.line() for d in self.decisions]


def active_attempts(ledger: Ledger) -> list[dict]:
    return ledger.rows(
        """SELECT j.job_id, j.attempt, r.run_id, r.handle, r.instance_id, r.provider, r.offer_id, r.handed_off_at,
                  r.follow_offset FROM runs r
           JOIN jobs j ON j.job_id = r.job_id AND j.attempt = r.attempt
           WHERE r.state = 'RUNNING' AND j.state = 'RUNNING'""")


def cancelled_but_running(ledger: Ledger) -> list[dict]:
    """Attempts of cancelled jobs whose workload was never stopped (no run followed it)."""
    return ledger.rows(
        """SELECT j.job_id, r.attempt, r.run_id, r.handle, r.instance_id, r.provider, r.offer_id FROM runs r
           JOIN jobs j ON j.job_id = r.job_id AND j.attempt = r.attempt
           WHERE r.state = 'RUNNING' AND j.state = 'CANCELLED'""")


def record_notices(settings: Settings, ledger: Ledger, attempts: list[dict], report: ReconcileReport,
                   contexts: Attempts | None = None) -> None:
    contexts = contexts or Attempts(settings, ledger)
    noticed = {r["instance_id"] for r in ledger.rows(
        """SELECT DISTINCT e.instance_id FROM runs r JOIN events e ON e.run_id = r.run_id
           WHERE r.state = 'RUNNING' AND e.kind = 'notice'""")}
    # Every node of a group: a notice for any of them stops the whole group (control/group.py).
    todo = [(row, node, member, len(handle.members) > 1) for row in attempts
            for handle in [RunHandle.model_validate_json(row["handle"])]
            for node, member in enumerate(handle.members) if member.instance.instance_id not in noticed]

    def ask(item: tuple[dict, int, RunHandle, bool]):
        row, _, handle, _ = item
        _, provider = contexts(row["job_id"], int(row["attempt"]))
        return provider.notices(handle.instance)

    for (row, node, handle, grouped), notices in zip(todo, concurrently(ask, todo)):
        for notice in notices:
            lead = (notice.deadline - notice.received_at).total_seconds() if notice.deadline else None
            ledger.commit({"events": [R.event("notice", job_id=row["job_id"], run_id=row["run_id"],
                                              instance_id=handle.instance.instance_id, action=notice.action,
                                              deadline=notice.deadline, lead_seconds=lead, source=notice.source,
                                              **({"node": node, "group": row["run_id"]} if grouped else {}))]})
            report.notices.append({"job_id": row["job_id"], "instance_id": handle.instance.instance_id,
                                   "deadline": notice.deadline})


def _decision(action: str, row: dict, reason: str = "", failure_class: str | None = None) -> Decision:
    return Decision(action, row["job_id"], int(row["attempt"]), reason, row.get("run_id"), row.get("instance_id"),
                    row.get("provider"), row.get("offer_id"), failure_class)


def decide(settings: Settings, followed: Followed = lambda job_id, attempt: True,
           watch: Watch = WATCH) -> ReconcileReport:
    """What needs doing; `followed(job_id, attempt)` says whether a live run follows (or
    dispatches) that attempt. An attempt handed off to the daemon (control/handoff.py) gets
    a re-attach only when `watch` says a run has something to do."""
    ledger = settings.ledger()
    report = ReconcileReport()
    contexts = Attempts(settings, ledger)
    attempts = active_attempts(ledger)
    record_notices(settings, ledger, attempts, report, contexts)
    unfollowed = [row for row in attempts if not followed(row["job_id"], int(row["attempt"]))]

    def status_of(row: dict):
        _, provider = contexts(row["job_id"], int(row["attempt"]))
        handle = RunHandle.model_validate_json(row["handle"])
        # A group's status from its nodes' (control/group.py); a run that takes it up waits for the rest.
        status = GroupWatch(provider, handle).status() if handle.nodes else provider.status(handle)
        if row["handed_off_at"] is None:
            return status, None
        if status.state in ("exited", "lost"):
            return status, "handed off; " + ("its workload ended" if status.state == "exited" else "its host is lost")
        return status, watch.wants_run(provider, row, handle, every_s=settings.follow_every_s)

    watch.forget({row["run_id"] for row in unfollowed if row["handed_off_at"] is not None})
    for row, (status, wake) in zip(unfollowed, concurrently(status_of, unfollowed)):
        if row["handed_off_at"] is not None:
            # Its run closes it the way a following run would, whatever happened to the host.
            if wake:
                report.decisions.append(_decision("reattach", row, wake))
        elif status.state == "lost":
            report.decisions.append(_decision("close_lost", row, status.reason or "host lost", "reclaim"))
        else:
            report.decisions.append(_decision("reattach", row, "no run follows it"))
    for row in cancelled_but_running(ledger):
        if not followed(row["job_id"], int(row["attempt"])):  # else the run following it stops it
            report.decisions.append(_decision("stop_cancelled", row, "cancelled while no run followed it"))
    now = time.time()
    for job in ledger.rows("SELECT job_id, attempt, deadline_at FROM jobs WHERE state = 'DISPATCHING'"):
        late = job["deadline_at"] is not None and now > float(job["deadline_at"])
        if late or not followed(job["job_id"], int(job["attempt"])):
            why = "past its dispatch deadline" if late else "the run dispatching it is gone"
            report.decisions.append(_decision("abandon_dispatch", {**job, "run_id": R.run_id_for(job["job_id"],
                                                                                                 int(job["attempt"]))},
                                              why, "infrastructure"))
    for row in ledger.rows(
            """SELECT i.instance_id, i.provider, i.offer_id, i.job_id, i.run_id, r.attempt FROM instances i
               JOIN runs r ON r.run_id = i.run_id
               WHERE i.stopped_at IS NULL AND i.purpose = 'train' AND r.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')"""):
        report.decisions.append(_decision("release_orphan", row, "its attempt has ended"))
    # Kept or rented ahead for an attempt that never ran (a group's nodes, a migration's
    # replacement) while the job ended meanwhile (failed, cancelled).
    for row in ledger.rows(
            """SELECT i.instance_id, i.provider, i.offer_id, i.job_id, i.run_id, j.attempt FROM instances i
               JOIN jobs j ON j.job_id = i.job_id
               WHERE i.stopped_at IS NULL AND i.purpose = 'train' AND j.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
               AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = i.run_id)"""):
        report.decisions.append(_decision("release_orphan", row, "its job ended before the attempt it was kept for"))
    # A LOST attempt is requeued by the run that closed it; one still LOST a while later (that
    # run died first) is requeued here.
    for row in ledger.rows("SELECT job_id, attempt, failure_class FROM jobs WHERE state = 'LOST' AND state_at < ?",
                           [now - LOST_GRACE_S]):
        report.decisions.append(_decision("recover", row, "still LOST", row["failure_class"]))
    return report


def act(settings: Settings, d: Decision) -> str:
    """Carry out one decision (idempotent: a second run of the same decision changes nothing)."""
    ledger = settings.ledger()
    if d.action == "close_lost":
        row = R.run(ledger, d.run_id)
        _, provider = bundle_and_provider(settings, ledger, d.job_id, d.attempt)
        handle = RunHandle.model_validate_json(row["handle"])
        closed = close_lost_attempt(settings, ledger, provider, handle, job_id=d.job_id, attempt=d.attempt,
                                    run_id=d.run_id, reason=d.reason or "host lost")
        result = recover_lost(settings, d.job_id)
        return f"closed {d.run_id} ({'marked LOST' if closed else 'already closed'}), then {result['action']}"
    if d.action == "stop_cancelled":
        row = R.run(ledger, d.run_id)
        _, provider = bundle_and_provider(settings, ledger, d.job_id, d.attempt)
        stop_cancelled(settings, ledger, provider, RunHandle.model_validate_json(row["handle"]), job_id=d.job_id,
                       attempt=d.attempt, run_id=d.run_id)
        return f"stopped and billed {d.instance_id}"
    if d.action == "abandon_dispatch":
        _, provider = bundle_and_provider(settings, ledger, d.job_id, d.attempt)
        for inst in ledger.rows("SELECT handle FROM instances WHERE run_id = ? AND stopped_at IS NULL", [d.run_id]):
            release(settings, ledger, provider, InstanceHandle.model_validate_json(inst["handle"]), job_id=d.job_id,
                    run_id=d.run_id, attempt=d.attempt, checkpoints=[], lost=False, last_progress=None,
                    reason="dispatch abandoned")
        moved = R.transition(ledger, d.job_id, JobState.LOST, attempt=d.attempt, reason=f"dispatch abandoned: {d.reason}",
                             failure_class="infrastructure", only_from={JobState.DISPATCHING},
                             extra={"events": [R.event("dispatch_abandoned", job_id=d.job_id, run_id=d.run_id,
                                                       reason=d.reason)]})
        result = recover_lost(settings, d.job_id) if moved else {"action": "none"}
        return f"dispatch abandoned ({'LOST, ' + result['action'] if moved else 'it had moved on'})"
    if d.action == "release_orphan":
        inst = ledger.one("SELECT handle FROM instances WHERE instance_id = ?", [d.instance_id])
        _, provider = bundle_and_provider(settings, ledger, d.job_id, d.attempt)
        release(settings, ledger, provider, InstanceHandle.model_validate_json(inst["handle"]), job_id=d.job_id,
                run_id=d.run_id, attempt=d.attempt, checkpoints=attempt_checkpoints(ledger, d.run_id), lost=False,
                last_progress=None, reason="attempt already ended")
        return f"released {d.instance_id}"
    if d.action == "recover":
        result = recover_lost(settings, d.job_id)
        return f"{result['action']} {result.get('attempt', '')} {result.get('reason', '')}".strip()
    raise ValueError(f"unknown reconcile action {d.action!r}")


def reconcile(settings: Settings, followed: Followed = lambda job_id, attempt: True) -> ReconcileReport:
    """Decide and act at once (the CLI's and the tests' door; the daemon acts through runs)."""
    report = decide(settings, followed)
    for d in report.decisions:
        if d.action != "reattach":
            report.done.append(f"{d.line()}: {act(settings, d)}")
    return report
