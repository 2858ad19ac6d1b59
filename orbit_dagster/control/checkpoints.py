"""Registering checkpoints: only complete, verified ones; the store is the truth."""
from __future__ import annotations

from datetime import datetime, timezone

from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..storage import open_store, store_of
from ..storage.base import StoreError


def row_from_event(ev: dict, *, job_id: str, run_id: str | None) -> dict:
    step = int(ev["step"])
    parent_uri = ev.get("parent")
    return {
        "checkpoint_key": R.checkpoint_key(job_id, step),
        "job_id": job_id,
        "run_id": run_id,
        "attempt": int(ev.get("attempt") or 0),
        "step": step,
        "tier": ev.get("tier", "durable"),
        "parent_key": _key_from_uri(parent_uri, job_id),
        "uri": ev["uri"],
        "sha256": ev["sha256"],
        "bytes": int(ev["bytes"]),
        "weights_sha256": ev.get("weights_sha256"),
        "train_loss": ev.get("train_loss"),
        "save_seconds": ev.get("save_seconds"),
        "created_at": datetime.fromtimestamp(float(ev["ts"]), timezone.utc) if ev.get("ts") else utcnow(),
        "registered_at": utcnow(),
    }


def _key_from_uri(uri: str | None, job_id: str) -> str | None:
    """`.../<job>/step-000000120` -> `<job>/120` (parents may belong to the same job only)."""
    if not uri:
        return None
    tail = uri.rstrip("/").rsplit("/", 2)
    if len(tail) < 2 or not tail[-1].startswith("step-"):
        return None
    return R.checkpoint_key(tail[-2] if len(tail) == 3 else job_id, int(tail[-1][5:]))


def verify_event(store_uri: str, ev: dict) -> str | None:
    """None when the checkpoint in the store is complete and matches; else the reason."""
    try:
        manifest = store_of(ev["uri"]).verify(ev["uri"])
    except StoreError as exc:
        return str(exc)
    if manifest.digest != ev.get("sha256"):
        return f"manifest digest {manifest.digest[:12]} differs from the reported {str(ev.get('sha256'))[:12]}"
    return None


def scan_store(ledger: Ledger, store_uri: str, job_id: str) -> list[dict]:
    """Register complete checkpoints the store holds but the ledger does not (host lost
    before its events were read). Returns the rows registered."""
    known = {r["checkpoint_key"] for r in R.checkpoints(ledger, job_id, live_only=False)}
    store = open_store(store_uri)
    rows = []
    for uri in store.list(job_id):
        try:
            m = store.verify(uri)
        except StoreError:
            continue
        key = R.checkpoint_key(job_id, m.step)
        if key in known:
            continue
        ev = {"step": m.step, "tier": m.tier, "uri": uri, "sha256": m.digest, "bytes": m.total_bytes,
              "weights_sha256": m.weights_sha256, "parent": m.parent, "attempt": m.attempt,
              "train_loss": (m.meta.get("metrics") or {}).get("train/loss"),
              "ts": datetime.fromisoformat(m.created_at).timestamp() if m.created_at else None}
        rows.append(row_from_event(ev, job_id=job_id, run_id=R.run_id_for(job_id, m.attempt) if m.attempt else None))
    if rows:
        ledger.commit({"checkpoints": rows, "events": [R.event("checkpoints_recovered_from_store", job_id=job_id,
                                                               keys=[r["checkpoint_key"] for r in rows])]})
    return rows


def newest_complete(ledger: Ledger, store_uri: str, job_id: str) -> dict | None:
    """The checkpoint to resume from: the highest step whose files verify."""
    scan_store(ledger, store_uri, job_id)
    for row in sorted(R.checkpoints(ledger, job_id), key=lambda r: r["step"], reverse=True):
        try:
            store_of(row["uri"]).verify(row["uri"])
            return row
        except StoreError as exc:
            ledger.commit({"events": [R.event("checkpoint_unusable", job_id=job_id, checkpoint=row["checkpoint_key"],
                                              reason=str(exc))]})
    return None
