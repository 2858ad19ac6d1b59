"""Run (or re-attach to) one attempt of a training job, end to end.

dispatch: QUEUED -> DISPATCHING, choose an offer, provision, launch, RUNNING;
monitor:  read the host's events, register verified checkpoints, record metrics;
finish:   collect artifacts, release the instance, bill it, and move the job on.
Idempotent per (job, attempt): a second caller for the same attempt re-attaches to the
running workload rather than launching it again.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime

from ..core.errors import OrbitError, ProviderError
from ..core.failures import FailureClass, retried_as_interruption
from ..core.host_contract import (
    Checkpoint,
    Entry,
    Exit,
    HostEvent,
    Interval,
    LocalCheckpoint,
    Metrics,
    Notice,
    Probe,
    Progress,
    Rebalance,
    Rejected,
    Resumed,
    Started,
    fields_of,
)
from ..core.lifecycle import JobState
from ..ledger import Ledger, as_datetime, utcnow
from ..ledger import records as R
from ..providers.base import Provider, RunHandle, RunStatus
from ..settings import Settings
from . import checkpoints as C
from . import handoff
from .billing import attempt_checkpoints
from .context import NullReporter, Reporter, bundle_and_provider, bundle_of, eval_suite_for, store_for
from .dispatch import dispatch
from .group import GroupWatch, collect_nodes, instances_of, release_group, where
from .group_recovery import recover_group, release_planned
from .recovery import after_failure, recover_lost

FINAL_RUN_STATES = {"SUCCEEDED", "FAILED", "LOST", "CANCELLED"}
# What a host's `started`, `notice`, `rebalance`, `probe`, `resumed` and `local_checkpoint` lines become in
# the ledger: a `host_<kind>` event with the record's fields (the dispatcher and the observations read
# them; `finish` reads `host_local_checkpoint` to say which emergency upload never committed).
NOTED = (Started, Notice, Rebalance, Probe, Resumed, LocalCheckpoint)


def _when(ev: HostEvent) -> datetime:
    """When the host wrote the line (its clock), or now if that is no time at all."""
    return as_datetime(ev.ts) if 0 < ev.ts < 4e9 else utcnow()  # (False for a NaN)


@dataclass
class AttemptOutcome:
    job_id: str
    attempt: int
    run_id: str
    state: str  # SUCCEEDED | FAILED | LOST | CANCELLED, or RUNNING when handed off
    failure_class: str | None = None
    reason: str = ""
    exit_code: int | None = None
    instance_id: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    last_step: int | None = None
    usd: float = 0.0
    reattached: bool = False
    already_ended: bool = False  # the attempt had ended before this call: nothing was launched or followed
    handed_off: bool = False  # still running; the daemon watches it (control/handoff.py)


class AttemptMonitor:
    """Follows a launched attempt's events until its workload ends or its host is gone."""

    def __init__(self, settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, reporter: Reporter,
                 *, job_id: str, run_id: str, store_uri: str, lineage: str | None, experiment: str | None,
                 eval_suite: str | None):
        self.settings, self.ledger, self.provider, self.handle = settings, ledger, provider, handle
        self.store_uri = store_uri
        self.reporter, self.job_id, self.run_id = reporter, job_id, run_id
        self.lineage, self.experiment, self.eval_suite = lineage, experiment, eval_suite
        self.offset = 0
        self.registered = {r["checkpoint_key"] for r in R.checkpoints(ledger, job_id, live_only=False)}
        self.new_checkpoints: list[str] = []
        self.metric_rows: list[dict] = []
        self.last_step: int | None = None
        self.last_progress: datetime | None = None
        self.exit_event: Exit | None = None
        # A group (control/group.py): every node's event stream is read, its status is the group's.
        self.group = GroupWatch(provider, handle) if handle.nodes else None
        self.node_offsets: dict[int, int] = {}

    def _checkpoint(self, ev: Checkpoint, notes: list[dict]) -> dict | None:
        """The ledger row of a checkpoint event, once its files are here and verified."""
        key = R.checkpoint_key(self.job_id, ev.attempt, ev.step)
        if key in self.registered:
            return None
        try:
            ev = self.provider.localize_checkpoint(self.handle, ev, self.store_uri)
        except (OSError, ProviderError) as exc:
            notes.append(R.event("checkpoint_rejected", job_id=self.job_id, run_id=self.run_id, checkpoint_key=key,
                                 reason=f"could not copy it from the host: {exc}"))
            return None
        problem = C.verify_event(ev)
        if problem:
            notes.append(R.event("checkpoint_rejected", job_id=self.job_id, run_id=self.run_id, checkpoint_key=key,
                                 reason=problem))
            return None
        self._progress(ev.step, ev)
        return C.row_from_event(ev, job_id=self.job_id, run_id=self.run_id, lineage=self.lineage,
                                experiment=self.experiment)

    def _on_events(self, events: list[Entry], node: int = 0) -> None:
        """Act on the host contract's records (read_events) of node `node` (0 but in a group); a
        refused line is recorded, skipped."""
        ckpt_rows: list[dict] = []
        notes: list[dict] = []
        decisions: list[dict] = []
        for ev in events:
            try:
                if isinstance(ev, Interval):
                    decisions.append(self._interval_decision(ev))
                    continue
                self._on_event(ev, ckpt_rows, notes, node)
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
                # A record the contract accepts that still cannot be acted on (a checkpoint uri no
                # store opens, say): recorded and skipped, like a refused line. A host (or its
                # workload, which can write events) never stops the run that follows the attempt.
                notes.append(R.event("event_rejected", job_id=self.job_id, run_id=self.run_id,
                                     reason=f"{type(exc).__name__}: {exc}"[:500], line=str(ev)[:500]))
        if decisions:
            self.ledger.commit({"decisions": decisions})
        new = C.register(self.ledger, ckpt_rows, eval_suite=self.eval_suite, events=notes) if (ckpt_rows or notes) else []
        self.registered |= {r["checkpoint_key"] for r in ckpt_rows}
        if new:
            self.new_checkpoints += [r["checkpoint_key"] for r in new]
            self.reporter.checkpoints(new)

    def _interval_decision(self, ev: Interval) -> dict:
        """The agent's re-decided checkpoint interval as a decision row. Named by the line's
        number in the attempt's stream: a re-read (a re-attach reads from the start) records it once."""
        inputs = fields_of(ev)
        inputs.pop("reason", None)
        return {"decision_id": f"interval:{self.run_id}:{ev.seq}", "job_id": self.job_id,
                "attempt": self.handle.attempt, "kind": "checkpoint_interval", "chosen": str(ev.steps),
                "runner_up": None if ev.policy_steps is None else str(ev.policy_steps),
                "inputs": R.dumps({"decided_on": "host", "reason": ev.reason, **inputs}), "ts": _when(ev)}

    def _where(self, node: int, name: str, at: int) -> dict:
        return where(self.handle, self.run_id, node, name, at)

    def _on_event(self, ev: Entry, ckpt_rows: list[dict], notes: list[dict], node: int = 0) -> None:
        if isinstance(ev, Rejected):  # not a line of the contract: its kind, version or field named
            # Named by its place in the file: a re-read (a re-attach reads from the start) records it once.
            notes.append(R.event("event_rejected", job_id=self.job_id, run_id=self.run_id, reason=ev.reason[:500],
                                 line=ev.line[:500], offset=ev.offset, host_kind=ev.kind,
                                 **(self._where(node, "event_rejected", ev.offset) if self.handle.nodes
                                    else {"event_id": f"event_rejected:{self.run_id}:{ev.offset}"})))
        elif isinstance(ev, Checkpoint):
            row = self._checkpoint(ev, notes)
            if row is not None:
                ckpt_rows.append(row)
        elif isinstance(ev, Metrics):
            for name, value in ev.values.items():
                # A NaN is the workload's divergence, reported by its exit: never stored.
                if math.isfinite(value) and 0 < len(name) <= 200:
                    self._metric(ev.step, name, value, ev)
            self._progress(ev.step, ev)
        elif isinstance(ev, Progress):
            self._progress(ev.step, ev)
        elif isinstance(ev, Exit):
            self.exit_event = ev
        elif isinstance(ev, Notice) and ev.plan is not None:
            # The agent's emergency plan, announced before its write (runtime/emergency.py): its
            # own event, once per line (a re-attach reads from the start), next to the notice.
            notes.append(R.event("emergency_plan", job_id=self.job_id, run_id=self.run_id, ts=ev.ts, **fields_of(ev),
                                 **{"event_id": f"emergency_plan:{self.run_id}:{ev.seq}",
                                    **self._where(node, "emergency_plan", ev.seq)}))
        elif isinstance(ev, NOTED):
            detail = {"ts": ev.ts, **fields_of(ev)}
            notes.append(R.event(f"host_{ev.KIND}", job_id=self.job_id, run_id=self.run_id,
                                 **self._where(node, f"host_{ev.KIND}", ev.seq), **detail))

    def _progress(self, step: int, ev: HostEvent) -> None:
        if self.last_step is None or step >= self.last_step:
            self.last_step = step
            self.last_progress = _when(ev)

    def _metric(self, step: int, name: str, value: float, ev: HostEvent) -> None:
        self.metric_rows.append({
            "job_id": self.job_id, "experiment": self.experiment, "run_id": self.run_id, "step": step, "name": name,
            "value": value, "source": "train", "ts": _when(ev),
        })

    def take_up(self, run_row: dict) -> None:
        """Continue where the run that handed this attempt off stopped reading."""
        if run_row.get("handed_off_at") is None:
            return
        self.offset = int(run_row.get("follow_offset") or 0)
        if run_row.get("follow_step") is not None:
            self.last_step = int(run_row["follow_step"])
        if run_row.get("follow_progress_at") is not None:
            self.last_progress = as_datetime(float(run_row["follow_progress_at"]))

    def hand_off(self, grace_s: float, poll_s: float = 0.25) -> RunStatus | None:
        """Follow for `grace_s`; if the workload still runs then, record where to take up and
        return None: the daemon watches it from here. Else the status that ends it."""
        status = self.follow(poll_s, until=time.time() + grace_s)
        if status is not None:
            return status
        progress = self.last_progress.timestamp() if self.last_progress else None
        if not handoff.hand_off(self.ledger, self.run_id, offset=self.offset, last_step=self.last_step,
                                last_progress=progress):
            return self.follow(poll_s)  # it ended meanwhile: follow it to its end
        return None

    def flush_metrics(self) -> None:
        if self.metric_rows:
            self.ledger.commit({"metric_points": self.metric_rows})
            self.metric_rows = []

    def pump(self) -> None:
        events, self.offset = self.provider.read_events(self.handle, self.offset)
        if events:
            self._on_events(events)
        for node, member in enumerate(self.handle.nodes, 1):  # a group's other nodes (metrics, notices)
            events, self.node_offsets[node] = self.provider.read_events(member, self.node_offsets.get(node, 0))
            if events:
                self._on_events(events, node)

    def status(self) -> RunStatus:
        return self.group.status() if self.group is not None else self.provider.status(self.handle)

    def cancelled(self) -> bool:
        row = R.job(self.ledger, self.job_id)
        return row is not None and row["state"] == JobState.CANCELLED.value

    def _reachable(self, what, *args):
        """One call to the host; a retryable error is logged and returns None (out of reach now)."""
        try:
            return what(*args)
        except ProviderError as exc:
            if not exc.retryable:
                raise
            self.reporter.log(f"{self.job_id}: {exc}; still following")
            return None

    def follow(self, poll_s: float = 0.25, flush_every_s: float = 2.0, until: float | None = None) -> RunStatus | None:
        """Until the workload ends (its status), or None at `until` if it still runs then."""
        last_flush = time.time()
        while True:
            # Events and status are asked separately: a host whose event file cannot be read
            # is still asked for its status, and the provider says `lost` once it has been out
            # of reach for longer than its grace period, so an unreachable host ends the
            # attempt instead of keeping this run waiting for good.
            self._reachable(self.pump)
            status = self._reachable(self.status)
            if status is None:
                time.sleep(max(poll_s, 1.0))
                continue
            if time.time() - last_flush >= flush_every_s:
                self.flush_metrics()
                last_flush = time.time()
                if status.state not in ("exited", "lost") and self.cancelled():
                    # `orbit cancel` (or the UI): stop the workload; the bill stops with it.
                    for instance in instances_of(self.handle):
                        self.provider.terminate(instance, "job cancelled")
                    self._reachable(self.pump)
                    self.flush_metrics()
                    return RunStatus(state="exited", exit_code=None, failure_class="cancelled",
                                     reason="cancelled by a person")
            if status.state in ("exited", "lost"):
                self._reachable(self.pump)  # the last lines written before the exit
                self.flush_metrics()
                return status
            if until is not None and time.time() >= until:
                self.flush_metrics()
                return None
            time.sleep(poll_s)


def run_attempt(settings: Settings, job_id: str, *, dagster_run_id: str | None = None,
                reporter: Reporter | None = None, poll_s: float = 0.25, hand_off: bool | None = None) -> AttemptOutcome:
    """Launch the job's queued attempt, or re-attach to it, and follow it to its end; with
    hand-off (`settings.follow == "daemon"` unless told), stop following once it runs."""
    hand_off = settings.follow == "daemon" if hand_off is None else hand_off
    reporter = reporter or NullReporter()
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    attempt = int(job["attempt"])
    run_id = R.run_id_for(job_id, attempt)
    existing = R.run(ledger, run_id)
    reattached = False
    if existing is not None:
        if existing["state"] in FINAL_RUN_STATES:
            return AttemptOutcome(job_id, attempt, run_id, existing["state"], existing["failure_class"],
                                  existing["reason"] or "", existing["exit_code"], existing["instance_id"],
                                  reattached=True, already_ended=True)
        _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
        handle = provider.reattach(RunHandle.model_validate_json(existing["handle"]))
        reattached = True
        if handle is None:
            handle = RunHandle.model_validate_json(existing["handle"])
        reporter.log(f"{job_id} attempt {attempt}: re-attached to {handle.instance.instance_id}")
    else:
        if job["state"] != JobState.QUEUED.value:
            raise OrbitError(
                f"job {job_id} is {job['state']} (attempt {attempt}); there is no queued attempt to launch",
                field="job", value=job_id, fix="use `orbit retry` for a finished job",
            )
        launched = dispatch(settings, ledger, job, dagster_run_id=dagster_run_id, reporter=reporter)
        if launched is None:  # another run won the race for this attempt: follow its launch
            return _wait_and_reattach(settings, job_id, dagster_run_id=dagster_run_id, reporter=reporter, poll_s=poll_s,
                                      hand_off=hand_off)
        handle, provider = launched
    run_row = R.run(ledger, run_id) or {}
    monitor = AttemptMonitor(settings, ledger, provider, handle, reporter, job_id=job_id, run_id=run_id,
                             store_uri=store_for(settings, ledger, job_id, attempt), lineage=run_row.get("lineage"),
                             experiment=job["experiment"], eval_suite=eval_suite_for(settings, ledger, job_id, attempt))
    monitor.take_up(run_row)
    if hand_off:
        # The run that launches follows a while first: a job that fails at once, or a short
        # one, ends in it; a run that takes the attempt up again collects and hands back.
        status = monitor.hand_off(0.0 if reattached else settings.handoff_after_s, poll_s)
        if status is None:
            reporter.log(f"{job_id} attempt {attempt}: running; following handed to the daemon")
            return AttemptOutcome(job_id, attempt, run_id, "RUNNING", instance_id=handle.instance.instance_id,
                                  checkpoints=monitor.new_checkpoints, last_step=monitor.last_step,
                                  reattached=reattached, handed_off=True)
    else:
        status = monitor.follow(poll_s=poll_s)
    return finish(settings, ledger, provider, handle, monitor, status, job_id=job_id, attempt=attempt,
                  run_id=run_id, reattached=reattached, reporter=reporter)


def _wait_and_reattach(settings: Settings, job_id: str, *, dagster_run_id: str | None, reporter: Reporter,
                       poll_s: float, hand_off: bool, timeout_s: float = 120.0) -> AttemptOutcome:
    ledger = settings.ledger()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        job = R.require_job(ledger, job_id)
        if R.run(ledger, R.run_id_for(job_id, int(job["attempt"]))) is not None or job["state"] not in ("DISPATCHING",):
            return run_attempt(settings, job_id, dagster_run_id=dagster_run_id, reporter=reporter, poll_s=poll_s,
                               hand_off=hand_off)
        time.sleep(0.5)
    raise OrbitError(f"job {job_id}: another run has been dispatching it for {timeout_s:.0f} s without launching",
                     field="job", value=job_id, fix="look at the other run's logs in the Dagster UI")


def outcome_of(status: RunStatus, *, migrated: bool) -> tuple[JobState, str | None]:
    """The job's next state and failure class when an attempt's workload has ended."""
    if status.failure_class == "cancelled":
        return JobState.CANCELLED, None
    if status.state == "exited" and status.exit_code == 0:
        return JobState.SUCCEEDED, None
    if status.state == "lost" or retried_as_interruption(status.failure_class):
        # A move orbit chose (make-before-break) ends the attempt the same way as a reclaim,
        # but does not count against max_interruptions.
        if migrated:
            return JobState.LOST, FailureClass.MIGRATION.value
        return JobState.LOST, status.failure_class if status.failure_class == "infrastructure" else "reclaim"
    return JobState.FAILED, status.failure_class or FailureClass.USER_ERROR.value


def finish(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, monitor: AttemptMonitor,
           status: RunStatus, *, job_id: str, attempt: int, run_id: str, reattached: bool,
           reporter: Reporter) -> AttemptOutcome:
    # A lost host may have written checkpoints whose events we never read: the store knows.
    for row in C.scan_store(ledger, monitor.store_uri, job_id, eval_suite=monitor.eval_suite):
        monitor.new_checkpoints.append(row["checkpoint_key"])
        reporter.checkpoints([row])
    for missed in C.record_missed_uploads(ledger, job_id, run_id):  # after the scan: a late upload counts
        reporter.log(f"{job_id}: {missed}")
    migrated = bool(ledger.scalar("SELECT count(*) FROM events WHERE run_id = ? AND kind = 'migration_started'",
                                  [run_id]))
    final, failure_class = outcome_of(status, migrated=migrated)
    collect_nodes(provider, handle, settings.artifacts_dir / job_id / f"attempt-{attempt}", reporter.log)
    bill = {"job_id": job_id, "attempt": attempt, "checkpoints": attempt_checkpoints(ledger, run_id),
            "last_progress": monitor.last_progress}
    if monitor.group is not None and final is JobState.LOST:  # some nodes go on (control/group_recovery.py)
        usd = recover_group(settings, ledger, provider, handle, template=bundle_of(ledger, job_id, attempt).spec.template,
                            watch=monitor.group, reason=status.reason, **bill)
    else:
        usd = release_group(settings, ledger, provider, handle, run_id=run_id, lost=final is JobState.LOST,
                            reason=f"attempt ended: {final.value}", **bill)
    if monitor.group is not None:  # no node runs this attempt any more: a part left now is garbage
        C.drop_group_parts(ledger, monitor.store_uri, job_id, attempt)
    reason = "migrated to a safer offer" if failure_class == "migration" else status.reason
    moved = R.transition(ledger, job_id, final, attempt=attempt, reason=reason, failure_class=failure_class,
                         detail={"exit_code": status.exit_code, "last_step": monitor.last_step},
                         only_from=frozenset({JobState.DISPATCHING, JobState.RUNNING}),
                         then=lambda tx: R.run_state(tx, run_id, final.value, exit_code=status.exit_code,
                                                     failure_class=failure_class, reason=status.reason))
    if not moved:  # (already in `final` for this attempt: a retried finish, carry on)
        # Someone else ended this attempt while its workload was stopping (a person's cancel
        # is the usual one): their state stands, and nothing is recovered or retried.
        job = R.require_job(ledger, job_id)
        if int(job["attempt"]) != attempt or job["state"] != final.value:
            return AttemptOutcome(job_id, attempt, run_id, job["state"], job["failure_class"], job["reason"] or "",
                                  status.exit_code, handle.instance.instance_id, monitor.new_checkpoints,
                                  monitor.last_step, usd, reattached, already_ended=True)
    outcome = AttemptOutcome(job_id, attempt, run_id, final.value, failure_class, status.reason, status.exit_code,
                             handle.instance.instance_id, monitor.new_checkpoints, monitor.last_step, usd, reattached)
    # Decide the next attempt now rather than at the interruption sensor's next tick; the
    # sensor makes the same idempotent decision if this process dies first.
    if outcome.state == JobState.LOST.value:
        if recover_lost(settings, job_id)["action"] == "failed":  # no next attempt for a group's kept nodes
            release_planned(settings, ledger, provider, job_id, attempt + 1)
    else:
        after_failure(settings, outcome)
    return outcome
