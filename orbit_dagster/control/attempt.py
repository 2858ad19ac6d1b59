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
from ..core.errors import OrbitError, ProviderError
from ..core.lifecycle import JobState
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, LaunchSpec, Provider, RunHandle, RunStatus
from . import checkpoints as C
from .offers import choose_offer
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
                 *, job_id: str, run_id: str):
        self.settings, self.ledger, self.provider, self.handle = settings, ledger, provider, handle
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
                    ev = self.provider.localize_checkpoint(self.handle, ev, self.settings.store_uri)
                except (OSError, ProviderError) as exc:
                    other.append(R.event("checkpoint_rejected", job_id=self.job_id, run_id=self.run_id, checkpoint=key,
                                         reason=f"could not copy it from the host: {exc}"))
                    continue
                problem = C.verify_event(self.settings.store_uri, ev)
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

    def follow(self, poll_s: float = 0.25, flush_every_s: float = 2.0) -> RunStatus:
        last_flush = time.time()
        while True:
            self.pump()
            status = self.provider.status(self.handle)
            if time.time() - last_flush >= flush_every_s:
                self.flush_metrics()
                last_flush = time.time()
            if status.state in ("exited", "lost"):
                self.pump()  # the last lines written before the exit
                self.flush_metrics()
                return status
            time.sleep(poll_s)


def _bundle_and_provider(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> tuple[JobBundle, Provider]:
    bundle = JobBundle.load(R.bundle_for(ledger, job_id, attempt)["path"])
    return bundle, provider_for(settings, bundle.spec.execution_request.backend_key)


def dispatch(settings: Settings, ledger: Ledger, job: dict, *, dagster_run_id: str | None,
             reporter: Reporter) -> tuple[RunHandle, Provider]:
    job_id, attempt = job["job_id"], int(job["attempt"])
    run_id = R.run_id_for(job_id, attempt)
    R.transition(ledger, job_id, JobState.DISPATCHING, attempt=attempt, reason=f"dagster run {dagster_run_id or '-'}")
    bundle, provider = _bundle_and_provider(settings, ledger, job_id, attempt)
    detail = json.loads(job.get("detail") or "{}")
    resume = None if detail.get("resume") == "scratch" else C.newest_complete(ledger, settings.store_uri, job_id)
    from .recovery import offers_to_avoid  # local: recovery imports this module

    offer, decision = choose_offer(provider, bundle.spec.execution_request, job_id=job_id, attempt=attempt,
                                   avoid=offers_to_avoid(ledger, job_id))
    instance: InstanceHandle | None = None
    try:
        instance = provider.provision(offer, tags={"orbit/job": job_id, "orbit/attempt": str(attempt)})
        ledger.commit({"decisions": [decision], "instances": [_instance_row(instance, "train", job_id, run_id)]})
        template = bundle.spec.template
        spec = LaunchSpec(
            task="train",
            attempt=attempt,
            store_uri=provider.host_store_uri(instance, settings.store_uri),
            resume_from=provider.stage_checkpoint(instance, resume["uri"]) if resume else None,
            checkpoint_every=template.checkpoint.every_steps,
            memory_every=template.checkpoint.memory_every_steps,
            env=dict(bundle.spec.execution_request.env),
            secret_env=tuple(bundle.spec.execution_request.secret_env),
        )
        handle = provider.launch(instance, bundle.path, spec)
    except ProviderError as exc:
        if instance is not None:
            _release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                     checkpoints=[], lost=False, last_progress=None, reason=f"launch failed: {exc}")
        if exc.retryable:
            R.transition(ledger, job_id, JobState.LOST, attempt=attempt, reason=str(exc), failure_class="capacity")
        else:
            R.transition(ledger, job_id, JobState.FAILED, attempt=attempt, reason=str(exc), failure_class="provider")
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
                                  offer=offer.offer_id, resume_from=resume["checkpoint_key"] if resume else None)]},
    )
    reporter.log(f"{job_id} attempt {attempt}: running on {offer.offer_id} ({instance.instance_id})"
                 + (f", resumed from {resume['checkpoint_key']}" if resume else ""))
    return handle, provider


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
    C.scan_store(ledger, settings.store_uri, job_id)
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
        handle, provider = dispatch(settings, ledger, job, dagster_run_id=dagster_run_id, reporter=reporter)
    monitor = AttemptMonitor(settings, ledger, provider, handle, reporter, job_id=job_id, run_id=run_id)
    status = monitor.follow(poll_s=poll_s)
    return finish(settings, ledger, provider, handle, monitor, status, job_id=job_id, attempt=attempt,
                  run_id=run_id, reattached=reattached, reporter=reporter)


def finish(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, monitor: AttemptMonitor,
           status: RunStatus, *, job_id: str, attempt: int, run_id: str, reattached: bool,
           reporter: Reporter) -> AttemptOutcome:
    # A lost host may have written checkpoints whose events we never read: the store knows.
    for row in C.scan_store(ledger, settings.store_uri, job_id):
        monitor.new_checkpoints.append(row["checkpoint_key"])
        reporter.checkpoints([row])
    lost = status.state == "lost" or status.failure_class == "reclaim"
    if status.state == "exited" and status.exit_code == 0:
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
    from .recovery import after_failure  # local: recovery imports this module

    after_failure(settings, outcome)
    return outcome
