"""Billing an instance: stop the meter once, attribute every second, record the stop.

The provider's times are the truth (when the meter started and stopped); the bill is
`(stopped - started) x price`, split into lines (`core.costs.attribute_instance`) that sum
to it. Exactly once per instance: the row is stopped and its lines written in one
transaction that first checks it was not stopped already, so two processes that both
release an instance (the run following it and the reconciler) bill it once.
"""
from __future__ import annotations

from datetime import datetime

from ..core.costs import Bought, attribute_instance
from ..core.lifecycle import JobState
from ..ledger import Ledger, as_datetime, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, Provider, RunHandle
from ..settings import Settings
from . import checkpoints as C
from .context import eval_suite_for, store_for


def instance_row(instance: InstanceHandle, purpose: str, job_id: str, run_id: str | None,
                 checkpoint_key: str | None = None, *, suite: str | None = None,
                 dagster_run_id: str | None = None) -> dict:
    o = instance.offer
    return {
        "instance_id": instance.instance_id, "provider": instance.provider, "offer_id": o.offer_id,
        "instance_type": o.instance_type, "gpu": o.gpu, "gpu_count": o.gpu_count, "region": o.region, "zone": o.zone,
        "usd_per_second": o.usd_per_second, "spot": int(o.spot), "purpose": purpose, "job_id": job_id,
        "run_id": run_id, "checkpoint_key": checkpoint_key, "suite": suite,
        "gpu_slots": ",".join(map(str, instance.gpu_slots)) or None, "handle": instance.model_dump_json(),
        "dagster_run_id": dagster_run_id, "started_at": instance.started_at,
    }


def attempt_checkpoints(ledger: Ledger, run_id: str) -> list[Bought]:
    """(time durable, key, time training went on past it) of the checkpoints an attempt's run
    wrote: what its seconds bought (`core.costs.attribute_instance`)."""
    return [(as_datetime(r["created_at"]), r["checkpoint_key"], as_datetime(r["trained_at"])) for r in ledger.rows(
        "SELECT created_at, checkpoint_key, trained_at FROM checkpoints WHERE run_id = ? ORDER BY step", [run_id])]


def release(settings: Settings, ledger: Ledger, provider: Provider, instance: InstanceHandle, *, job_id: str,
            run_id: str | None, attempt: int, checkpoints: list[Bought], lost: bool,
            last_progress: datetime | float | None, reason: str, purpose: str = "train",
            eval_checkpoint: str | None = None, suite: str | None = None,
            extra: dict[str, list[dict]] | None = None) -> float:
    """Stop the meter and write the bill, attributed per checkpoint. Returns the cost in USD."""
    times = provider.terminate(instance, reason) if provider.instance_alive(instance) else provider.instance_times(instance)
    stop = times.stopped_at or utcnow()
    with ledger.write() as tx:
        for table, rows in (extra or {}).items():
            tx.insert(table, rows)
        row = tx.one("SELECT stopped_at, billed_usd FROM instances WHERE instance_id = ?" + tx.for_update,
                     [instance.instance_id])
        if row is None:  # provisioned, then the process died before recording it: record it now
            tx.insert("instances", [instance_row(instance, purpose, job_id, run_id, eval_checkpoint, suite=suite)])
        elif row["stopped_at"] is not None:
            return float(row["billed_usd"] or 0.0)
        # A node kept from an earlier attempt's group had that attempt's seconds billed to it
        # then (`carry_over`): the lines go on from there, the bill covers the whole instance.
        billed_until = tx.scalar("SELECT max(end_at) FROM costs WHERE instance_id = ?", [instance.instance_id])
        start = max(as_datetime(billed_until), times.started_at) if billed_until is not None else times.started_at
        lines = attribute_instance(start=start, stop=stop if billed_until is None else max(stop, start),
                                   usd_per_second=instance.offer.usd_per_second,
                                   checkpoints=checkpoints, lost=lost, purpose=purpose, eval_checkpoint=eval_checkpoint,
                                   last_progress=as_datetime(last_progress))
        billed = max((stop - times.started_at).total_seconds(), 0.0) * instance.offer.usd_per_second
        tx.execute("UPDATE instances SET stopped_at = ?, stop_reason = ?, billed_usd = ? WHERE instance_id = ?",
                   [stop, times.reason or reason, billed, instance.instance_id])
        tx.insert("costs", cost_rows(instance, lines, id_prefix=instance.instance_id, job_id=job_id, run_id=run_id,
                                     attempt=attempt, suite=suite))
    return billed


def carry_over(ledger: Ledger, instance: InstanceHandle, *, job_id: str, run_id: str, attempt: int, next_run: str,
               checkpoints: list[Bought], lost: bool, last_progress: datetime | float | None) -> float:
    """A node of a group that goes on into the next attempt (kept after another node's reclaim):
    its seconds up to now are billed to this attempt, as a release would bill them (its
    checkpoints, the work lost after the last one), and it becomes the next attempt's instance.
    Once: a node already carried changes nothing. The dollars of this attempt's part."""
    now = utcnow()
    with ledger.write() as tx:
        row = tx.one("SELECT stopped_at, run_id, started_at FROM instances WHERE instance_id = ?" + tx.for_update,
                     [instance.instance_id])
        if row is None or row["stopped_at"] is not None or row["run_id"] != run_id:
            return 0.0
        billed_until = tx.scalar("SELECT max(end_at) FROM costs WHERE instance_id = ?", [instance.instance_id])
        start = as_datetime(billed_until if billed_until is not None else row["started_at"])
        lines = attribute_instance(start=start, stop=max(now, start), usd_per_second=instance.offer.usd_per_second,
                                   checkpoints=checkpoints, lost=lost, last_progress=as_datetime(last_progress))
        tx.execute("UPDATE instances SET run_id = ? WHERE instance_id = ?", [next_run, instance.instance_id])
        tx.insert("costs", cost_rows(instance, lines, id_prefix=f"{instance.instance_id}:a{attempt}", job_id=job_id,
                                     run_id=run_id, attempt=attempt, suite=None))
    return sum(line.usd for line in lines)


def cost_rows(instance: InstanceHandle, lines: list, *, id_prefix: str, job_id: str, run_id: str | None,
              attempt: int, suite: str | None) -> list[dict]:
    """The `costs` rows of an instance's attributed lines (`attribute_instance`), ids
    `<id_prefix>:<n>`: a release's prefix is the instance, a carry-over's adds its attempt, so
    a node billed for several attempts never reuses an id."""
    return [{
        "cost_id": f"{id_prefix}:{i}", "instance_id": instance.instance_id, "job_id": job_id, "run_id": run_id,
        "attempt": attempt, "checkpoint_key": line.checkpoint_key, "suite": suite, "kind": line.kind,
        "start_at": line.start, "end_at": line.end, "seconds": line.seconds,
        "gpu_count": max(instance.offer.gpu_count, 1), "usd_per_second": instance.offer.usd_per_second,
        "usd": line.usd,
    } for i, line in enumerate(lines)]


def close_lost_attempt(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, *, job_id: str,
                       attempt: int, run_id: str, reason: str, failure_class: str = "reclaim") -> bool:
    """Record a lost host when no run is following the attempt: LOST, and the bill, from
    what the ledger knows (the last metric point marks the last progress)."""
    changed = R.transition(
        ledger, job_id, JobState.LOST, attempt=attempt, reason=reason, failure_class=failure_class,
        extra={"events": [R.event("host_lost", job_id=job_id, run_id=run_id, instance_id=handle.instance.instance_id,
                                  reason=reason)]},
        then=lambda tx: R.run_state(tx, run_id, "LOST", failure_class=failure_class, reason=reason),
    )
    C.scan_store(ledger, store_for(settings, ledger, job_id, attempt), job_id,
                 eval_suite=eval_suite_for(settings, ledger, job_id, attempt))
    last = ledger.scalar("SELECT max(ts) FROM metric_points WHERE run_id = ?", [run_id])
    for member in handle.members:  # every node of a group
        release(settings, ledger, provider, member.instance, job_id=job_id, run_id=run_id, attempt=attempt,
                checkpoints=attempt_checkpoints(ledger, run_id), lost=True, last_progress=last, reason=reason)
    return changed


def stop_cancelled(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, *, job_id: str,
                   attempt: int, run_id: str) -> None:
    """A cancelled job's workload that nobody follows: stop it and bill it."""
    with ledger.write() as tx:
        R.run_state(tx, run_id, "CANCELLED", reason="job cancelled")
    for member in handle.members:  # every node of a group
        release(settings, ledger, provider, member.instance, job_id=job_id, run_id=run_id, attempt=attempt,
                checkpoints=attempt_checkpoints(ledger, run_id), lost=False, last_progress=None,
                reason="job cancelled")
