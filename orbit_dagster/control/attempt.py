"""Run (or re-attach to) one attempt of a training job, end to end.

dispatch: QUEUED -> DISPATCHING, choose an offer, provision, launch, RUNNING;
monitor:  read the host's events, register verified checkpoints, record metrics;
finish:   collect artifacts, release the instance, bill it, and move the job on.
Idempotent per (job, attempt): a second caller for the same attempt re-attaches to the
running workload rather than launching it again.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from ..core.bundle import JobBundle
from ..core.costs import attribute_instance
from ..core.errors import NoCapacity, OrbitError, ProviderError
from ..core.lifecycle import JobState
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, LaunchSpec, Provider, RunHandle, RunStatus
from . import checkpoints as C
from .offers import rank_for
from .providers import provider_for
from .settings import Settings

FINAL_RUN_STATES = {"SUCCEEDED", "FAILED", "LOST", "CANCELLED"}


class Reporter(Protocol):
    def checkpoints(self, rows: list[dict]) -> None: ...

    def log(self, message: str) -> None: ...


class NullReporter:
    def checkpoints(self, rows: list[dict]) -> None:
        pass

    def log(self, message: str) -> None:
        pass


@dataclass
class AttemptOutcome:
    job_id: str
    attempt: int
    run_id: str
    state: str  # SUCCEEDED | FAILED | LOST | CANCELLED
    failure_class: str | None = None
    reason: str = ""
    exit_code: int | None = None
    instance_id: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    last_step: int | None = None
    usd: float = 0.0
    reattached: bool = False


def _ts(x: float) -> datetime:
    return datetime.fromtimestamp(float(x), timezone.utc)


class AttemptMonitor:
    """Follows a launched attempt's events until its workload ends or its host is gone."""

    def __init__(self, settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, reporter: Reporter,
                 *, job_id: str, run_id: str, store_uri: str):
        self.settings, self.ledger, self.provider, self.handle = settings, ledger, provider, handle
        self.store_uri = store_uri
        self.reporter, self.job_id, self.run_id = reporter, job_id, run_id
        self.offset = 0
        self.registered = {r["checkpoint_key"] for r in R.checkpoints(ledger, job_id, live_only=False)}
        self.new_checkpoints: list[str] = []
        self.metric_rows: list[dict] = []
        self.last_step: int | None = None
        self.last_progress: datetime | None = None
        self.exit_event: dict | None = None

    def _on_events(self, events: list[dict]) -> None:
        ckpt_rows: list[dict] = []
        other: list[dict] = []
        for ev in events:
            kind = ev.get("type")
            if kind == "checkpoint":
                key = R.checkpoint_key(self.job_id, int(ev["step"]))
                if key in self.registered:
                    continue
                try:
                    ev = self.provider.localize_checkpoint(self.handle, ev, self.store_uri)
                except (OSError, ProviderError) as exc:
                    other.append(R.event("checkpoint_rejected", job_id=self.job_id, run_id=self.run_id, checkpoint=key,
                                         reason=f"could not copy it from the host: {exc}"))
                    continue
                problem = C.verify_event(self.store_uri, ev)
                if problem:
                    other.append(R.event("checkpoint_rejected", job_id=self.job_id, run_id=self.run_id, checkpoint=key,
                                         reason=problem))
                    continue
                row = C.row_from_event(ev, job_id=self.job_id, run_id=self.run_id)
                ckpt_rows.append(row)
                self.registered.add(key)
                self._progress(int(ev["step"]), ev)
                if ev.get("train_loss") is not None:
                    self._metric(int(ev["step"]), "train/loss", float(ev["train_loss"]), ev, checkpoint_key=key)
            elif kind == "metrics":
                for name, value in (ev.get("values") or {}).items():
                    try:
                        self._metric(int(ev["step"]), name, float(value), ev)
                    except (TypeError, ValueError):
                        continue
                self._progress(int(ev["step"]), ev)
            elif kind == "progress":
                self._progress(int(ev["step"]), ev)
            elif kind == "exit":
                self.exit_event = ev
            elif kind in ("started", "notice", "probe", "resumed"):
                detail = {k: v for k, v in ev.items() if k not in ("type", "seq")}
                other.append(R.event(f"host_{kind}", job_id=self.job_id, run_id=self.run_id,
                                     instance_id=self.handle.instance.instance_id, **detail))
        if ckpt_rows or other:
            self.ledger.commit({"checkpoints": ckpt_rows, "events": other})
        if ckpt_rows:
            self.new_checkpoints += [r["checkpoint_key"] for r in ckpt_rows]
            self.reporter.checkpoints(ckpt_rows)

    def _progress(self, step: int, ev: dict) -> None:
        if self.last_step is None or step >= self.last_step:
            self.last_step = step
            self.last_progress = _ts(ev["ts"]) if ev.get("ts") else utcnow()

    def _metric(self, step: int, name: str, value: float, ev: dict, checkpoint_key: str | None = None) -> None:
        self.metric_rows.append({
            "job_id": self.job_id, "run_id": self.run_id, "checkpoint_key": checkpoint_key, "step": step,
            "name": name, "value": value, "source": "train", "ts": _ts(ev["ts"]) if ev.get("ts") else utcnow(),
        })

    def flush_metrics(self) -> None:
        if self.metric_rows:
            self.ledger.commit({"metric_points": self.metric_rows})
            self.metric_rows = []

    def pump(self) -> None:
        events, self.offset = self.provider.read_events(self.handle, self.offset)
        if events:
            self._on_events(events)

    def cancelled(self) -> bool:
        row = R.job(self.ledger, self.job_id)
        return row is not None and row["state"] == JobState.CANCELLED.value

    def follow(self, poll_s: float = 0.25, flush_every_s: float = 2.0) -> RunStatus:
        last_flush = time.time()
        while True:
            try:
                self.pump()
                status = self.provider.status(self.handle)
            except ProviderError as exc:
                if not exc.retryable:
                    raise
                # A host briefly out of reach: keep following; the provider itself says
                # `lost` once it has been unreachable for longer than its grace period.
                self.reporter.log(f"{self.job_id}: {exc}; still following")
                time.sleep(max(poll_s, 1.0))
                continue
            if time.time() - last_flush >= flush_every_s:
                self.flush_metrics()
                last_flush = time.time()
                if status.state not in ("exited", "lost") and self.cancelled():
                    # `orbit cancel` (or the UI): stop the workload; the bill stops with it.
                    self.provider.terminate(self.handle.instance, "job cancelled")
                    self.pump()
                    self.flush_metrics()
                    return RunStatus(state="exited", exit_code=None, failure_class="cancelled",
                                     reason="cancelled by a person")
            if status.state in ("exited", "lost"):
                self.pump()  # the last lines written before the exit
                self.flush_metrics()
                return status
            time.sleep(poll_s)


def _store_for(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> str:
    """The checkpoint store root the job's template names (fs or s3)."""
    bundle = JobBundle.load(R.bundle_for(ledger, job_id, attempt)["path"], verify=False)
    return settings.store_uri_for(bundle.spec.template.checkpoint.store)


def _bundle_and_provider(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> tuple[JobBundle, Provider]:
    bundle = JobBundle.load(R.bundle_for(ledger, job_id, attempt)["path"])
    return bundle, provider_for(settings, bundle.spec.execution_request.backend_key)


def dispatch(settings: Settings, ledger: Ledger, job: dict, *, dagster_run_id: str | None,
             reporter: Reporter) -> tuple[RunHandle, Provider] | None:
    """Launch the queued attempt; None if another process is already dispatching it."""
    job_id, attempt = job["job_id"], int(job["attempt"])
    with ledger.lock(f"dispatch-{job_id}"):
        # Re-read under the lock: two runs of one attempt (a UI click and a sensor) must
        # not both provision. The loser re-attaches to what the winner launched.
        if not R.transition(ledger, job_id, JobState.DISPATCHING, attempt=attempt,
                            reason=f"dagster run {dagster_run_id or '-'}"):
            return None
    bundle, provider = _bundle_and_provider(settings, ledger, job_id, attempt)
    detail = json.loads(job.get("detail") or "{}")
    template = bundle.spec.template
    store_uri = settings.store_uri_for(template.checkpoint.store)
    resume = None if detail.get("resume") == "scratch" else C.newest_complete(ledger, store_uri, job_id)
    from .recovery import offers_to_avoid  # local: recovery imports this module

    try:
        ranked, decision = rank_for(ledger, provider, bundle.spec.execution_request, job_id=job_id, attempt=attempt,
                                    notice_s=provider.notice_seconds, template=template.name,
                                    avoid=offers_to_avoid(ledger, job_id))
        instance, tried = _provision_first(provider, ranked, job_id, attempt)
    except (ProviderError, OrbitError) as exc:
        retryable = isinstance(exc, ProviderError) and exc.retryable
        R.transition(ledger, job_id, JobState.LOST if retryable else JobState.FAILED, attempt=attempt, reason=str(exc),
                     failure_class="capacity" if retryable else "provider")
        raise
    offer = instance.offer
    run_id = R.run_id_for(job_id, attempt)
    interval, interval_row = checkpoint_plan(ledger, provider, template, offer, job_id=job_id, attempt=attempt)
    decision["inputs"] = R.dumps({**json.loads(decision["inputs"]), "tried": tried})
    ledger.commit({"decisions": [decision, interval_row],
                   "instances": [_instance_row(instance, "train", job_id, run_id)]})
    try:
        spec = LaunchSpec(
            task="train",
            attempt=attempt,
            store_uri=provider.host_store_uri(instance, store_uri),
            resume_from=provider.stage_checkpoint(instance, resume["uri"]) if resume else None,
            checkpoint_every=interval,
            memory_every=template.checkpoint.memory_every_steps,
            env=dict(bundle.spec.execution_request.env),
            secret_env=tuple(bundle.spec.execution_request.secret_env),
        )
        handle = provider.launch(instance, bundle.path, spec)
    except ProviderError as exc:
        _release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                 checkpoints=[], lost=False, last_progress=None, reason=f"launch failed: {exc}")
        R.transition(ledger, job_id, JobState.LOST if exc.retryable else JobState.FAILED, attempt=attempt,
                     reason=str(exc), failure_class="capacity" if exc.retryable else "provider")
        raise
    run_row = {
        "run_id": run_id, "job_id": job_id, "attempt": attempt, "bundle_hash": bundle.bundle_hash,
        "dagster_run_id": dagster_run_id, "instance_id": instance.instance_id, "provider": provider.name,
        "offer_id": offer.offer_id, "resume_from": resume["checkpoint_key"] if resume else None,
        "handle": handle.model_dump_json(), "imported": False, "experiment": job["experiment"],
        "project": job["project"], "started_at": utcnow(),
    }
    R.transition(
        ledger, job_id, JobState.RUNNING, attempt=attempt,
        reason=f"on {offer.offer_id}" + (f", resumed from {resume['checkpoint_key']}" if resume else ""),
        extra={"runs": [run_row], "run_states": [_run_state(run_id, "RUNNING")],
               "events": [R.event("launched", job_id=job_id, run_id=run_id, instance_id=instance.instance_id,
                                  offer=offer.offer_id, resume_from=resume["checkpoint_key"] if resume else None,
                                  checkpoint_every=interval)]},
    )
    reporter.log(f"{job_id} attempt {attempt}: running on {offer.offer_id} ({instance.instance_id}), "
                 f"durable checkpoint every {interval} steps"
                 + (f", resumed from {resume['checkpoint_key']}" if resume else ""))
    return handle, provider


MAX_OFFERS_TRIED = 5


def _provision_first(provider: Provider, ranked: list, job_id: str, attempt: int) -> tuple[InstanceHandle, list[dict]]:
    """Provision the best offer that has capacity now; the others tried are recorded."""
    tried: list[dict] = []
    for offer in ranked[:MAX_OFFERS_TRIED]:
        try:
            return provider.provision(offer, tags={"orbit/job": job_id, "orbit/attempt": str(attempt)}), tried
        except NoCapacity as exc:
            tried.append({"offer": offer.offer_id, "error": str(exc)})
    raise NoCapacity(f"none of the {len(tried)} best offers has capacity now: {tried[0]['error'] if tried else ''}",
                     provider=provider.name, fix="the job is retried as an interruption; or widen resources")


def checkpoint_plan(ledger: Ledger, provider: Provider, template, offer, *, job_id: str, attempt: int) -> tuple[int, dict]:
    """The durable checkpoint interval in steps, and its decision row.

    `interval_policy: young-daly` converts the policy's interval (from the offer's reclaim
    rate, the measured save time and the notice) into steps with the measured step time;
    `fixed` keeps the template's `every_steps`. Both record the policy's figure."""
    from ..policy.interval import checkpoint_interval
    from ..policy.reclaim_rate import ReclaimRateEstimator
    from .offers import measured_save_seconds
    from .observations import measured_step_seconds, observed_reclaims

    est = ReclaimRateEstimator.for_offer(offer)
    seen = observed_reclaims(ledger).get(offer.offer_id)
    if seen:
        est.observe(seen[0], seen[1] * 3600.0)
    save_s = measured_save_seconds(ledger, template.name)
    step_s = measured_step_seconds(ledger, template.name)
    interval_s = checkpoint_interval(est.mtbf_s, save_s, notice_s=provider.notice_seconds, min_s=0.0)
    policy_steps = max(1, int(round(interval_s / step_s))) if step_s else None
    fixed = template.checkpoint.every_steps
    steps = policy_steps if template.checkpoint.interval_policy == "young-daly" and policy_steps else fixed
    row = {
        "decision_id": R.event("decision")["event_id"], "job_id": job_id, "attempt": attempt,
        "kind": "checkpoint_interval", "chosen": str(steps), "runner_up": str(fixed if steps != fixed else policy_steps),
        "inputs": R.dumps({"policy": template.checkpoint.interval_policy, "mtbf_s": est.mtbf_s,
                           "rate": est.as_record(), "save_s": save_s, "step_s": step_s,
                           "notice_s": provider.notice_seconds, "interval_s": interval_s,
                           "policy_steps": policy_steps, "template_steps": fixed}),
        "ts": utcnow(),
    }
    return steps, row


def _instance_row(instance: InstanceHandle, purpose: str, job_id: str, run_id: str | None,
                  checkpoint_key: str | None = None) -> dict:
    o = instance.offer
    return {
        "instance_id": instance.instance_id, "provider": instance.provider, "offer_id": o.offer_id,
        "instance_type": o.instance_type, "gpu": o.gpu, "gpu_count": o.gpu_count, "region": o.region, "zone": o.zone,
        "usd_per_second": o.usd_per_second, "spot": o.spot, "purpose": purpose, "job_id": job_id, "run_id": run_id,
        "checkpoint_key": checkpoint_key, "gpu_slots": ",".join(map(str, instance.gpu_slots)) or None,
        "started_at": instance.started_at,
    }


def _run_state(run_id: str, state: str, *, exit_code: int | None = None, failure_class: str | None = None,
               reason: str = "") -> dict:
    return {"run_id": run_id, "state": state, "exit_code": exit_code, "failure_class": failure_class,
            "reason": reason, "ts": utcnow()}


def _release(settings: Settings, ledger: Ledger, provider: Provider, instance: InstanceHandle, *, job_id: str,
             run_id: str | None, attempt: int, checkpoints: list[tuple[datetime, str]], lost: bool,
             last_progress: datetime | None, reason: str, purpose: str = "train",
             eval_checkpoint: str | None = None, extra: dict[str, list[dict]] | None = None) -> float:
    """Stop the meter and write the bill, attributed per checkpoint. Returns the cost in USD.

    Exactly once per instance: whoever gets here first (the run following the attempt, or
    the interruption sensor when no run follows it) bills; the other finds the stop row.
    """
    times = provider.terminate(instance, reason) if provider.instance_alive(instance) else provider.instance_times(instance)
    stop = times.stopped_at or utcnow()
    batch: dict[str, list[dict]] = {}
    for table, more in (extra or {}).items():
        batch.setdefault(table, []).extend(more)
    with ledger.lock(f"bill-{instance.instance_id}"):
        done = ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [instance.instance_id])
        if done is not None:
            ledger.commit(batch)
            return float(done)
        lines = attribute_instance(start=times.started_at, stop=stop, usd_per_second=instance.offer.usd_per_second,
                                   checkpoints=checkpoints, lost=lost, purpose=purpose, eval_checkpoint=eval_checkpoint,
                                   last_progress=last_progress)
        batch["costs"] = [{
            "cost_id": f"{instance.instance_id}:{i}", "instance_id": instance.instance_id, "job_id": job_id,
            "run_id": run_id, "attempt": attempt, "checkpoint_key": line.checkpoint_key, "kind": line.kind,
            "start_ts": line.start, "end_ts": line.end, "seconds": line.seconds,
            "usd_per_second": instance.offer.usd_per_second, "usd": line.usd,
        } for i, line in enumerate(lines)]
        batch["instance_stops"] = [{"instance_id": instance.instance_id, "stopped_at": stop,
                                    "reason": times.reason or reason}]
        ledger.commit(batch)
    return sum(r["usd"] for r in batch["costs"])


def close_lost_attempt(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, *, job_id: str,
                       attempt: int, run_id: str, reason: str) -> bool:
    """Record a lost host when no run is following the attempt: LOST, and the bill, from
    what the ledger knows (the last metric point marks the last progress)."""
    changed = R.transition(
        ledger, job_id, JobState.LOST, attempt=attempt, reason=reason, failure_class="reclaim",
        extra={"run_states": [_run_state(run_id, "LOST", failure_class="reclaim", reason=reason)],
               "events": [R.event("host_lost", job_id=job_id, run_id=run_id, instance_id=handle.instance.instance_id,
                                  reason=reason)]},
    )
    C.scan_store(ledger, _store_for(settings, ledger, job_id, attempt), job_id)
    ckpts = [(r["created_at"], r["checkpoint_key"]) for r in R.checkpoints(ledger, job_id, live_only=False)
             if r["run_id"] == run_id]
    last = ledger.scalar("SELECT max(ts) FROM metric_points WHERE run_id = ?", [run_id])
    _release(settings, ledger, provider, handle.instance, job_id=job_id, run_id=run_id, attempt=attempt,
             checkpoints=ckpts, lost=True, last_progress=last, reason=reason)
    return changed


def run_attempt(settings: Settings, job_id: str, *, dagster_run_id: str | None = None,
                reporter: Reporter | None = None, poll_s: float = 0.25) -> AttemptOutcome:
    """Launch the job's queued attempt, or re-attach to it, and follow it to its end."""
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
                                  reattached=True)
        _, provider = _bundle_and_provider(settings, ledger, job_id, attempt)
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
            return _wait_and_reattach(settings, job_id, dagster_run_id=dagster_run_id, reporter=reporter, poll_s=poll_s)
        handle, provider = launched
    monitor = AttemptMonitor(settings, ledger, provider, handle, reporter, job_id=job_id, run_id=run_id,
                             store_uri=_store_for(settings, ledger, job_id, attempt))
    status = monitor.follow(poll_s=poll_s)
    return finish(settings, ledger, provider, handle, monitor, status, job_id=job_id, attempt=attempt,
                  run_id=run_id, reattached=reattached, reporter=reporter)


def _wait_and_reattach(settings: Settings, job_id: str, *, dagster_run_id: str | None, reporter: Reporter,
                       poll_s: float, timeout_s: float = 120.0) -> AttemptOutcome:
    ledger = settings.ledger()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        job = R.require_job(ledger, job_id)
        if R.run(ledger, R.run_id_for(job_id, int(job["attempt"]))) is not None or job["state"] not in ("DISPATCHING",):
            return run_attempt(settings, job_id, dagster_run_id=dagster_run_id, reporter=reporter, poll_s=poll_s)
        time.sleep(0.5)
    raise OrbitError(f"job {job_id}: another run has been dispatching it for {timeout_s:.0f} s without launching",
                     field="job", value=job_id, fix="look at the other run's logs in the Dagster UI")


def finish(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, monitor: AttemptMonitor,
           status: RunStatus, *, job_id: str, attempt: int, run_id: str, reattached: bool,
           reporter: Reporter) -> AttemptOutcome:
    # A lost host may have written checkpoints whose events we never read: the store knows.
    for row in C.scan_store(ledger, monitor.store_uri, job_id):
        monitor.new_checkpoints.append(row["checkpoint_key"])
        reporter.checkpoints([row])
    lost = status.state == "lost" or status.failure_class == "reclaim"
    if status.failure_class == "cancelled":
        final, failure_class = JobState.CANCELLED, None
    elif status.state == "exited" and status.exit_code == 0:
        final, failure_class = JobState.SUCCEEDED, None
    elif lost:
        final, failure_class = JobState.LOST, "reclaim"
    else:
        final, failure_class = JobState.FAILED, status.failure_class or "crash"
    dest = settings.artifacts_dir / job_id / f"attempt-{attempt}"
    try:
        provider.collect(handle, dest)
    except (OSError, ProviderError) as exc:
        reporter.log(f"could not collect artifacts: {exc}")
    ckpts = [(r["created_at"], r["checkpoint_key"]) for r in R.checkpoints(ledger, job_id, live_only=False)
             if r["run_id"] == run_id]
    usd = _release(
        settings, ledger, provider, handle.instance, job_id=job_id, run_id=run_id, attempt=attempt,
        checkpoints=ckpts, lost=lost, last_progress=monitor.last_progress, reason=f"attempt ended: {final.value}",
        extra={"run_states": [_run_state(run_id, final.value, exit_code=status.exit_code, failure_class=failure_class,
                                         reason=status.reason)]},
    )
    R.transition(ledger, job_id, final, attempt=attempt, reason=status.reason, failure_class=failure_class,
                 detail={"exit_code": status.exit_code, "last_step": monitor.last_step})
    outcome = AttemptOutcome(job_id, attempt, run_id, final.value, failure_class, status.reason, status.exit_code,
                             handle.instance.instance_id, monitor.new_checkpoints, monitor.last_step, usd, reattached)
    from .recovery import after_failure, recover_lost  # local: recovery imports this module

    # Decide the next attempt now rather than at the interruption sensor's next tick; the
    # sensor makes the same idempotent decision if this process dies first.
    if outcome.state == JobState.LOST.value:
        recover_lost(settings, job_id)
    else:
        after_failure(settings, outcome)
    return outcome
