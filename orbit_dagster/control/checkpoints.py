"""Registering checkpoints: only complete, verified ones, each in exactly one lineage.

A checkpoint's key names its job, the attempt that wrote it and its step
(`<job>/a<attempt>/<step>`); its lineage is the lineage that attempt trained (see
`lineage.py`). Resume and evaluation use a checkpoint only when its bytes still match the
sha256 the ledger recorded when it was registered, not merely its own manifest (which
whoever changed the bytes could have rewritten too).
"""
from __future__ import annotations

import json
import math
from datetime import datetime

from ..core.errors import CheckpointIntegrityError
from ..core.host_contract import Checkpoint
from ..ledger import Ledger, as_datetime, utcnow
from ..ledger import records as R
from ..storage import open_store, store_of
from ..storage.base import PART_DIR, StoreError, parse_checkpoint_dir


def row_from_event(ev: Checkpoint, *, job_id: str, run_id: str | None, lineage: str | None,
                   experiment: str | None) -> dict:
    step, attempt = ev.step, ev.attempt
    return {
        "checkpoint_key": R.checkpoint_key(job_id, attempt, step),
        "job_id": job_id,
        "experiment": experiment,
        "run_id": run_id,
        "attempt": attempt,
        "lineage": lineage,
        "step": step,
        "tier": ev.tier,
        "parent_key": key_from_uri(ev.parent, job_id),
        "uri": ev.uri,
        "sha256": ev.sha256,
        "bytes": ev.bytes,
        "weights_sha256": ev.weights_sha256,
        "train_loss": _finite(ev.train_loss),
        "save_seconds": _finite(ev.save_seconds),
        "created_at": as_datetime(ev.ts) if 0 < ev.ts < 4e9 else utcnow(),  # (False for a NaN)
        "registered_at": utcnow(),
        "trained_at": trained_at(ev),
    }


def trained_at(ev: Checkpoint) -> datetime | None:
    """When training went on past the checkpoint's step, by the host's clock (as `created_at`):
    an SDK save's call returned once the training thread's share was done (`blocked_seconds`
    of its `save_seconds`); a script's published files began their upload to the store
    (`write_seconds` before the event). After a loss, the work done since is what is wasted,
    even though the save became durable later. None when the event cannot say."""
    if ev.save_seconds is not None and ev.blocked_seconds is not None:
        behind = ev.save_seconds - ev.blocked_seconds
    else:
        behind = ev.write_seconds
    if behind is None or not 0 <= behind < 4e9 or not 0 < ev.ts < 4e9:  # (False for a NaN)
        return None
    return as_datetime(max(ev.ts - behind, 0.0))


def key_from_uri(uri: str | None, job_id: str) -> str | None:
    """`.../<job>/step-000000120-a2` -> `<job>/a2/120` (a parent always belongs to the same job)."""
    if not uri:
        return None
    parsed = parse_checkpoint_dir(uri.rstrip("/").rsplit("/", 1)[-1])
    return R.checkpoint_key(job_id, parsed[1], parsed[0]) if parsed else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def verify_event(ev: Checkpoint) -> str | None:
    """None when the checkpoint in the store is complete and matches its event; else why not."""
    try:
        manifest = store_of(ev.uri).verify(ev.uri)
    except StoreError as exc:
        return str(exc)
    if manifest.digest != ev.sha256:
        return f"manifest digest {manifest.digest[:12]} differs from the reported {ev.sha256[:12]}"
    if manifest.step != ev.step or manifest.attempt != ev.attempt:
        return f"the manifest says step {manifest.step} of attempt {manifest.attempt}, the event another"
    return None


def register(ledger: Ledger, rows: list[dict], *, eval_suite: str | None, events: list[dict] | None = None) -> list[dict]:
    """Insert verified checkpoints (and, when the job is evaluable, their evaluation requests)
    in one transaction. Returns the rows that were new. A key already registered with other
    bytes is refused and recorded, never replaced: two different bytes never share a key."""
    new: list[dict] = []
    notes = list(events or [])
    with ledger.write() as tx:
        for row in rows:
            have = tx.one("SELECT sha256 FROM checkpoints WHERE checkpoint_key = ?", [row["checkpoint_key"]])
            if have is not None:
                if have["sha256"] != row["sha256"]:
                    notes.append(R.event("checkpoint_conflict", job_id=row["job_id"], checkpoint_key=row["checkpoint_key"],
                                         registered=have["sha256"], offered=row["sha256"]))
                continue
            tx.insert("checkpoints", [row])
            if eval_suite:
                tx.insert("evaluations", [{"checkpoint_key": row["checkpoint_key"], "suite": eval_suite,
                                           "job_id": row["job_id"], "experiment": row["experiment"],
                                           "state": "PENDING", "tries": 0, "requested_at": utcnow()}])
            new.append(row)
        tx.insert("events", notes)
    return new


def scan_store(ledger: Ledger, store_uri: str, job_id: str, *, eval_suite: str | None) -> list[dict]:
    """Register complete checkpoints the store holds but the ledger does not (a host lost
    before its events were read). Each belongs to the lineage of the attempt that wrote it;
    one written by an attempt the ledger does not know is left alone. Returns the new rows."""
    known = {r["checkpoint_key"] for r in R.checkpoints(ledger, job_id, live_only=False)}
    runs = {int(r["attempt"]): r for r in ledger.rows(
        "SELECT attempt, run_id, lineage, experiment FROM runs WHERE job_id = ?", [job_id])}
    store = open_store(store_uri)
    rows = []
    for uri in store.list(job_id):
        parsed = parse_checkpoint_dir(uri.rstrip("/").rsplit("/", 1)[-1])
        if parsed is None or R.checkpoint_key(job_id, parsed[1], parsed[0]) in known or parsed[1] not in runs:
            continue
        try:
            m = store.verify(uri)
        except StoreError:
            continue
        run = runs[parsed[1]]
        # The record the host would have written for it (the host contract's), from its manifest.
        ev = Checkpoint(step=m.step, tier=m.tier, uri=uri, sha256=m.digest, bytes=m.total_bytes,
                        weights_sha256=m.weights_sha256, parent=m.parent, attempt=m.attempt,
                        train_loss=(m.meta.get("metrics") or {}).get("train/loss"),
                        ts=_iso_ts(m.created_at) if m.created_at else 0.0)  # 0: registered now
        if (m.step, m.attempt) != parsed:
            continue  # a manifest that disagrees with its own directory name
        rows.append(row_from_event(ev, job_id=job_id, run_id=run["run_id"], lineage=run["lineage"],
                                   experiment=run["experiment"]))
    if not rows:
        return []
    return register(ledger, rows, eval_suite=eval_suite, events=[R.event(
        "checkpoints_recovered_from_store", job_id=job_id, keys=[r["checkpoint_key"] for r in rows])])


def record_missed_uploads(ledger: Ledger, job_id: str, run_id: str) -> list[str]:
    """An attempt's emergency saves whose copy landed on the host's own disk (`local_checkpoint`)
    but whose upload never committed in the store: the host went first, and the copy with it.
    Each is recorded once (`emergency_upload_missed`, its event id names the run and step) and
    never registered; returns what this call recorded, in words. The copy is an SDK job's save
    or a command workload's own files (whose record carries no sha256)."""
    have = {r["checkpoint_key"] for r in R.checkpoints(ledger, job_id, live_only=False)}
    have |= {r["checkpoint_key"] for r in ledger.rows(  # recorded by an earlier reading: once is enough
        "SELECT checkpoint_key FROM events WHERE run_id = ? AND kind = 'emergency_upload_missed'", [run_id])}
    notes, said = [], []
    for row in ledger.rows("SELECT detail FROM events WHERE run_id = ? AND kind = 'host_local_checkpoint'", [run_id]):
        d = json.loads(row["detail"])
        key = R.checkpoint_key(job_id, int(d["attempt"]), int(d["step"]))
        if key in have:
            continue
        newest = ledger.scalar("SELECT max(step) FROM checkpoints WHERE job_id = ? AND step < ?", [job_id, d["step"]])
        reason = (f"the emergency save of step {d['step']} landed on the host's disk ({d['bytes']} bytes) but its "
                  f"upload never committed before the host went: lost with the instance; "
                  + (f"the checkpoint of step {newest} stands" if newest is not None else "no checkpoint stands"))
        notes.append(R.event("emergency_upload_missed", job_id=job_id, run_id=run_id, checkpoint_key=key,
                             event_id=f"emergency_upload_missed:{run_id}:{int(d['step'])}", step=int(d["step"]),
                             # None: a command workload's files, never hashed before their upload
                             # (core/host_contract.py, LocalCheckpoint)
                             bytes=d["bytes"], local_sha256=d.get("sha256"), reason=reason))
        said.append(reason)
    if notes:
        ledger.commit({"events": notes})
    return said


def drop_group_parts(ledger: Ledger, store_uri: str, job_id: str, attempt: int) -> list[str]:
    """Delete the nodes' parts an ended attempt of a group left in the store: node 0 deletes
    each part once it has put the checkpoint together, so what is left is a checkpoint some
    node never saved its part of (a node lost without notice) or one node 0 was stopped
    while gathering. Never a checkpoint: the names are the parts' own (storage PART_DIR)."""
    store = open_store(store_uri)
    dropped, steps = [], {}
    for uri in store.parts(job_id):
        m = PART_DIR.match(uri.rstrip("/").rsplit("/", 1)[-1])
        if m and int(m.group(2)) == attempt:
            try:
                emergency = store.read_manifest(uri).tier == "emergency"  # saved after a notice
            except (OSError, ValueError, StoreError):
                emergency = False  # half-written: its node went mid-save, before its manifest
            try:
                store.delete(uri)
            except (OSError, StoreError):
                continue  # tried again when the job's next attempt of a group ends; garbage, not data
            dropped.append(uri)
            step = steps.setdefault(int(m.group(1)), {"step": int(m.group(1)), "nodes": [], "emergency": False})
            step["nodes"].append(int(m.group(3)))
            step["emergency"] = step["emergency"] or emergency
    if dropped:
        by_step = [steps[k] for k in sorted(steps)]
        with ledger.write() as tx:
            tx.insert("events", [R.event("group_parts_dropped", job_id=job_id, attempt=attempt, uris=dropped,
                                         steps=by_step, reason=_parts_reason(ledger, job_id, by_step))])
    return dropped


def _parts_reason(ledger: Ledger, job_id: str, steps: list[dict]) -> str:
    """What the dropped parts mean, in words: which checkpoints never came together and, when a
    part was saved after a notice, that the notice was not met; which checkpoint stands."""
    said = []
    for s in steps:
        what = "the emergency save" if s["emergency"] else "the checkpoint"
        said.append(f"{what} of step {s['step']} never came together (parts of node(s) "
                    f"{', '.join(map(str, sorted(s['nodes'])))} were in the store; node 0 never stored the whole)")
    newest = ledger.scalar("SELECT max(step) FROM checkpoints WHERE job_id = ? AND step < ?",
                           [job_id, min(s["step"] for s in steps)])
    return ("; ".join(said) + ": the parts are dropped; "
            + (f"the checkpoint of step {newest} stands" if newest is not None else "no checkpoint stands"))


def _iso_ts(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def check_against_ledger(row: dict) -> None:
    """Raise CheckpointIntegrityError unless the stored bytes match the ledger's sha256 (and,
    for a delta, its base too). Deleted checkpoints are refused as well."""
    key = row["checkpoint_key"]
    if row.get("deleted_at") is not None:
        raise CheckpointIntegrityError(f"checkpoint {key} was deleted ({row.get('deleted_reason') or 'retention'})",
                                       field="checkpoint", value=key, fix="choose a live checkpoint (`orbit status JOB`)")
    try:
        manifest = store_of(row["uri"]).verify(row["uri"])
    except StoreError as exc:
        raise CheckpointIntegrityError(f"checkpoint {key} cannot be used: {exc}", field="checkpoint", value=key,
                                       fix="it is skipped; an older checkpoint is used where there is one") from None
    if manifest.digest != row["sha256"]:
        raise CheckpointIntegrityError(
            f"checkpoint {key}: its files and manifest were changed after registration (sha256 {manifest.digest[:12]}, "
            f"the ledger recorded {row['sha256'][:12]})", field="checkpoint", value=key,
            fix="treat it as tampered: it is never resumed from or evaluated")
    base = (manifest.meta or {}).get("delta_of")
    if base:
        try:
            store_of(base).verify(base)
        except StoreError as exc:
            raise CheckpointIntegrityError(f"checkpoint {key} is a delta whose base cannot be used: {exc}",
                                           field="checkpoint", value=key, fix="an older full checkpoint is used") from None


def newest_complete(ledger: Ledger, store_uri: str, job_id: str, *, lineage: str | None,
                    eval_suite: str | None) -> dict | None:
    """The checkpoint to resume from: the highest step of this lineage whose bytes still match
    the ledger. None: start from scratch (a new lineage, or nothing usable)."""
    if lineage is None:
        return None
    scan_store(ledger, store_uri, job_id, eval_suite=eval_suite)
    for row in sorted(R.checkpoints(ledger, job_id, lineage=lineage), key=lambda r: r["step"], reverse=True):
        try:
            check_against_ledger(row)
            return row
        except CheckpointIntegrityError as exc:
            ledger.commit({"events": [R.event("checkpoint_unusable", job_id=job_id, checkpoint_key=row["checkpoint_key"],
                                              reason=str(exc))]})
    return None
