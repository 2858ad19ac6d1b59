"""Tiered checkpoints on the host.

1. memory: a clone of the state every few steps (cheap; lets an emergency save proceed even
   when a training step is long and the notice lands mid-step);
2. durable: every N steps to the checkpoint store, serialised on the training thread (a
   consistent snapshot in a few ms) and written by a background thread while training
   continues;
3. emergency: on a reclaim notice, the newest state is persisted synchronously, ahead of
   anything else, and reported before the deadline.
A checkpoint becomes visible only with its manifest (see orbit_dagster.storage).
"""
from __future__ import annotations

import hashlib
import io
import queue
import threading
import time
from datetime import datetime, timezone
from typing import Any

import torch

from ..storage.base import CheckpointManifest, CheckpointStore, checkpoint_dir_name, sha256_bytes
from . import delta as D
from .events import EventWriter

STATE_FILE = "state.pt"


def weights_digest(model_state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of the weights: 'same model' exactly."""
    h = hashlib.sha256()
    for name in sorted(model_state):
        t = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def serialise(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def clone_state(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return obj


class Checkpointer:
    def __init__(
        self,
        store: CheckpointStore,
        events: EventWriter,
        *,
        job_id: str,
        attempt: int,
        parent_uri: str | None,
    ):
        self.store = store
        self.events = events
        self.job_id = job_id
        self.attempt = attempt
        self.parent_uri = parent_uri
        self.last_durable_step: int | None = None
        self.memory: tuple[int, dict, dict] | None = None  # (step, state, metrics)
        self.save_seconds: list[float] = []
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._lock = threading.Lock()  # serialises puts (emergency vs background writer)
        self._saved_steps: set[int] = set()
        self._durable_digests: dict[str, str] | None = None  # of the last durable state
        self._durable_uri: str | None = None
        self._writer = threading.Thread(target=self._drain, name="durable-writer", daemon=True)
        self._writer.start()
        self._errors: list[BaseException] = []

    # ---- tier 1 -------------------------------------------------------------------
    def snapshot_memory(self, step: int, state: dict, metrics: dict) -> None:
        self.memory = (step, clone_state(state), dict(metrics))

    # ---- tier 2 -------------------------------------------------------------------
    def save_durable_async(self, step: int, state: dict, metrics: dict) -> None:
        self._raise_writer_errors()
        blob = serialise(state)
        digest = weights_digest(state["model"])
        # Kept for a later emergency delta; taken now, while the state is this step's.
        self._durable_digests = D.digests(state)
        self._durable_uri = self.store.uri_for(self.job_id, checkpoint_dir_name(step, self.attempt))
        # Blocks only if the previous durable save is still being written (backpressure).
        self._queue.put((step, blob, digest, dict(metrics), "durable", time.time()))

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._put(*item)
            except BaseException as exc:  # surfaced on the training thread
                self._errors.append(exc)
            finally:
                self._queue.task_done()

    def _raise_writer_errors(self) -> None:
        if self._errors:
            raise self._errors.pop(0)

    # ---- tier 3 -------------------------------------------------------------------
    def save_emergency(self, step: int, state: dict, metrics: dict, *, source: str) -> str | None:
        """Persist the newest state now, ahead of any queued durable write."""
        if step in self._saved_steps:
            return None
        t0 = time.time()
        extra: dict = {}
        payload = state
        if self._durable_digests is not None and self._durable_uri is not None:
            delta, fraction = D.make_delta(state, self._durable_digests, self._durable_uri)
            extra = {"changed_fraction": round(fraction, 6)}
            if delta is not None:
                payload, extra["delta_of"] = delta, self._durable_uri
        blob = serialise(payload)
        return self._put(step, blob, weights_digest(state["model"]), metrics, "emergency", t0, source=source,
                         extra=extra)

    def emergency_from_memory(self, *, source: str) -> str | None:
        if self.memory is None:
            return None
        step, state, metrics = self.memory
        return self.save_emergency(step, state, metrics, source=source)

    # ---- common -------------------------------------------------------------------
    def _put(self, step: int, blob: bytes, weights_sha: str, metrics: dict, tier: str, t0: float, source: str = "",
             extra: dict | None = None) -> str | None:
        name = checkpoint_dir_name(step, self.attempt)
        with self._lock:
            # Claim the step and link the chain under the lock, then write outside it, so an
            # emergency save never waits for an older durable write still in flight.
            if step in self._saved_steps:
                return None
            self._saved_steps.add(step)
            parent = self.parent_uri
            self.parent_uri = self.store.uri_for(self.job_id, name)
        manifest = CheckpointManifest(
            job_id=self.job_id,
            step=step,
            tier=tier,
            files={STATE_FILE: {"sha256": sha256_bytes(blob), "bytes": len(blob)}},
            weights_sha256=weights_sha,
            parent=parent,
            created_at=datetime.now(timezone.utc).isoformat(),
            attempt=self.attempt,
            meta={"metrics": metrics, **(extra or {})},
        )
        uri = self.store.put(self.job_id, name, {STATE_FILE: blob}, manifest)
        seconds = time.time() - t0
        self.save_seconds.append(seconds)
        if tier == "durable":
            self.last_durable_step = max(step, self.last_durable_step or 0)
        self.events.emit(
            "checkpoint",
            step=step,
            tier=tier,
            uri=uri,
            sha256=manifest.digest,
            bytes=manifest.total_bytes,
            weights_sha256=weights_sha,
            parent=parent,
            train_loss=metrics.get("train/loss"),
            save_seconds=round(seconds, 6),
            attempt=self.attempt,
            source=source or None,
            **(extra or {}),
        )
        return uri

    def flush(self) -> None:
        """Wait for queued durable writes (before exit or an emergency's report)."""
        self._queue.join()
        self._raise_writer_errors()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
