"""Billing an instance: stop the meter once, attribute every second, record the stop."""
from __future__ import annotations

from datetime import datetime

from ..core.costs import attribute_instance
from ..core.lifecycle import JobState
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, Provider, RunHandle
from . import checkpoints as C
from .context import store_for
from .settings import Settings


def instance_row(instance: InstanceHandle, purpose: str, job_id: str, run_id: str | None,
                  checkpoint_key: str | None = None) -> dict:
    o = instance.offer
    return {
        "instance_id": instance.instance_id, "provider": instance.provider, "offer_id": o.offer_id,
        "instance_type": o.instance_type, "gpu": o.gpu, "gpu_count": o.gpu_count, "region": o.region, "zone": o.zone,
        "usd_per_second": o.usd_per_second, "spot": o.spot, "purpose": purpose, "job_id": job_id, "run_id": run_id,
        "checkpoint_key": checkpoint_key, "gpu_slots": ",".join(map(str, instance.gpu_slots)) or None,
        "handle": instance.model_dump_json(), "started_at": instance.started_at,
    }


def run_state_row(run_id: str, state: str, *, exit_code: int | None = None, failure_class: str | None = None,
               reason: str = "") -> dict:
    return {"run_id": run_id, "state": state, "exit_code": exit_code, "failure_class": failure_class,
            "reason": reason, "ts": utcnow()}


def release(settings: Settings, ledger: Ledger, provider: Provider, instance: InstanceHandle, *, job_id: str,
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
        extra={"run_states": [run_state_row(run_id, "LOST", failure_class="reclaim", reason=reason)],
               "events": [R.event("host_lost", job_id=job_id, run_id=run_id, instance_id=handle.instance.instance_id,
                                  reason=reason)]},
    )
    C.scan_store(ledger, store_for(settings, ledger, job_id, attempt), job_id)
    ckpts = [(r["created_at"], r["checkpoint_key"]) for r in R.checkpoints(ledger, job_id, live_only=False)
             if r["run_id"] == run_id]
    last = ledger.scalar("SELECT max(ts) FROM metric_points WHERE run_id = ?", [run_id])
    release(settings, ledger, provider, handle.instance, job_id=job_id, run_id=run_id, attempt=attempt,
             checkpoints=ckpts, lost=True, last_progress=last, reason=reason)
    return changed


def stop_cancelled(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, *, job_id: str,
                   attempt: int, run_id: str) -> None:
    """A cancelled job's workload that nobody follows: stop it and bill it."""
    ckpts = [(r["created_at"], r["checkpoint_key"]) for r in R.checkpoints(ledger, job_id, live_only=False)
             if r["run_id"] == run_id]
    release(settings, ledger, provider, handle.instance, job_id=job_id, run_id=run_id, attempt=attempt,
             checkpoints=ckpts, lost=False, last_progress=None, reason="job cancelled",
             extra={"run_states": [run_state_row(run_id, "CANCELLED", reason="job cancelled")]})
