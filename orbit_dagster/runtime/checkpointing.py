"""Tiered checkpoints on the host.

1. memory: a host copy of the state every few steps, never more often than its cost
   allows (MEMORY_BUDGET); lets an emergency save proceed even when a training step is
   long and the notice lands mid-step (RunContext takes them only where steps are that
   long: runtime/sdk.py, MEMORY_GAP_SHARE);
2. durable: every N steps to the checkpoint store. The training thread only copies the
   state to host memory (buffers reused between saves, pinned when the state is on a
   GPU) and goes on; a background thread serialises it straight into the store, whose
   threads hash and write its parts meanwhile (storage/parts.py);
3. emergency: on a reclaim notice, the newest state is persisted synchronously, ahead of
   anything else, and reported before the deadline: the full state or a delta, whichever
   fits the time left by the throughput measured on this host's earlier saves
   (runtime/emergency.py); the plan is announced before the write and recorded in the event.
   Where the store is too slow for the notice but the instance's own disk is fast enough,
   the save goes there first and is uploaded right after (runtime/local_tier.py); a
   `local_checkpoint` record says the local copy landed, the `checkpoint` record follows
   only once the upload's manifest commits.
A checkpoint becomes visible only with its manifest (see orbit_dagster.storage).

Each byte is hashed once (see runtime.encoding; an emergency save through the local disk
hashes its bytes again as it verifies and uploads them). Every checkpoint event reports `save_seconds` (save call -> checkpoint durable),
`blocked_seconds` (of that, the training thread's share) and `write_seconds` (serialise,
hash and write, manifest last).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from ..core.host_contract import Checkpoint, LocalCheckpoint, Notice
from ..storage.base import CheckpointManifest, CheckpointStore, StoreError, checkpoint_dir_name
from ..storage.fs import FsStore
from . import delta as D
from . import local_tier
from .emergency import SaveTimes, choose, time_left
from .encoding import buffers_like, has_cuda, stage, weights_digest, write_state
from .events import EventWriter

__all__ = ["STATE_FILE", "MEMORY_BUDGET", "Checkpointer", "weights_digest"]  # weights_digest: the control plane's too

STATE_FILE = "state.pt"
MEMORY_BUDGET = 0.01  # memory snapshots may take at most this share of the training time


@dataclass
class _Ticket:
    """Timing of one durable save, filled by the training thread and read by the writer."""

    called: float
    blocked: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)


class Checkpointer:
    def __init__(
        self,
        store: CheckpointStore,
        events: EventWriter,
        *,
        job_id: str,
        attempt: int,
        parent_uri: str | None,
        local_store: FsStore | None = None,
    ):
        self.store = store
        # The instance's own disk (runtime/local_tier.py), None where there is no such tier;
        # its rate measured once, after the first durable save (None until then: not used).
        self.local_store = local_store
        self.local_times = SaveTimes()
        self._local_probed = local_store is None
        self.events = events
        self.job_id = job_id
        self.attempt = attempt
        self.parent_uri = parent_uri
        self.last_durable_step: int | None = None
        self.memory: tuple[int, dict, dict] | None = None  # (step, host state, metrics)
        self._memory_lock = threading.Lock()
        self._memory_cost: float | None = None  # seconds the last memory snapshot took
        self._memory_at = 0.0
        self.memory_copies, self.memory_seconds = 0, 0.0  # taken so far, and the training thread's time in them
        self.save_seconds: list[float] = []
        self.times = SaveTimes()  # this host's measured save throughput: what sizes an emergency save
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._lock = threading.Lock()  # serialises claims of a step (emergency vs background writer)
        self._saved_steps: set[int] = set()
        # The last landed durable checkpoint, (uri, flattened host copy): the base an
        # emergency delta is compared with. Kept only while deltas can pay off (see _keep_base).
        self._base: tuple[str, dict[str, Any]] | None = None
        self._versions: dict[str, tuple[int, int]] | None = None
        self._spare: dict[str, torch.Tensor] | None = None  # host buffers to reuse for the next durable copy
        self._writer = threading.Thread(target=self._drain, name="durable-writer", daemon=True)
        self._writer.start()
        self._errors: list[BaseException] = []

    # ---- tier 1 -------------------------------------------------------------------
    def snapshot_memory(self, step: int, state: dict, metrics: dict) -> bool:
        """Copy the state to host memory (a GPU state into the previous snapshot's pinned
        buffers). Skipped (False) while the last copy's cost exceeds MEMORY_BUDGET of the time
        since it: for a large model every few steps would be a visible share of training."""
        began = time.perf_counter()
        if self._memory_cost is not None and began - self._memory_at < self._memory_cost / MEMORY_BUDGET:
            return False
        with self._memory_lock:  # never while the notice fallback is writing the snapshot
            previous, self.memory = self.memory, None  # its buffers are overwritten: not a snapshot meanwhile
            spare = None if previous is None else {k: v for k, v in D.flatten(previous[1]).items()
                                                   if isinstance(v, torch.Tensor)}
            self.memory = (step, stage(state, spare), dict(metrics))
        self._memory_at = time.perf_counter()
        self._memory_cost = self._memory_at - began
        self.memory_copies += 1
        self.memory_seconds += self._memory_cost
        return True

    # ---- tier 2 -------------------------------------------------------------------
    def save_durable_async(self, step: int, state: dict, metrics: dict) -> None:
        ticket = _Ticket(time.perf_counter())
        self._raise_writer_errors()
        keep_base = self._keep_base(state)
        with self._lock:
            spare, self._spare = self._spare, None
        snapshot = stage(state, spare)
        # Blocks only if the previous durable save is still queued (backpressure).
        self._queue.put((step, snapshot, dict(metrics), ticket, keep_base))
        ticket.blocked = time.perf_counter() - ticket.called
        ticket.ready.set()

    def _keep_base(self, state: dict) -> bool:
        """Keep this save's host copy as the delta base only when, since the previous durable
        save, at most MAX_CHANGED_FRACTION of the bytes were written to (frozen layers, a head
        fine-tune). In a full fine-tune every emergency save is a full one, and the copy would
        only hold memory."""
        fraction, self._versions = self._written_since_durable(state)
        return fraction is None or fraction <= D.MAX_CHANGED_FRACTION

    def _written_since_durable(self, state: dict) -> tuple[float | None, dict[str, tuple[int, int]]]:
        """(fraction of tensor bytes written to since the last durable save or None before the
        first, the tensors' versions now). In-place writes bump a tensor's version counter, so
        this reads no data; an over-estimate of what changed, used to decide what to keep and
        to report, never to decide what a delta leaves out (that compares bytes)."""
        flat = {k: v for k, v in D.flatten(state).items() if isinstance(v, torch.Tensor)}
        versions = {k: (getattr(v, "_version", -1), v.data_ptr()) for k, v in flat.items()}
        if self._versions is None:
            return None, versions
        total = sum(D.nbytes(v) for v in flat.values()) or 1
        written = sum(D.nbytes(v) for k, v in flat.items() if versions[k][0] < 0 or self._versions.get(k) != versions[k])
        return written / total, versions

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._write_durable(*item)
            except BaseException as exc:  # surfaced on the training thread
                self._errors.append(exc)
            finally:
                self._queue.task_done()

    def _write_durable(self, step: int, snapshot: dict, metrics: dict, ticket: _Ticket, keep_base: bool) -> None:
        ticket.ready.wait()
        uri = self._put(step, snapshot, snapshot["model"], metrics, "durable", called=ticket.called,
                        blocked=ticket.blocked)
        if uri is None:
            return
        if not self._local_probed:  # here, on the writer thread: the training thread never waits for it
            self._local_probed = True
            try:
                self.local_times.record(*local_tier.probe(self.local_store,
                                                          sum(D.nbytes(v) for _, v in D.leaves(snapshot))))
            except (OSError, StoreError):  # a full or read-only local disk: no local tier, training goes on
                self.local_store = None
        if keep_base:
            self._base = (uri, D.flatten(snapshot))  # the old base is dropped, never recycled (a reader may hold it)
            # So the next durable save cannot copy into this one, and a copy into new memory
            # blocked the training thread 1.59 s for 1.2 GB where held buffers took 0.14 s
            # (docs/benchmarks.md, step-overhead-policy): this thread readies that save's
            # buffers now. Host memory holds two copies from here on, as it would during that
            # save anyway. A host without room for them yet is not an error: that save
            # allocates its own.
            try:
                spare = buffers_like(self._base[1])
            except RuntimeError:  # torch's "can't allocate memory"
                spare = {}
            with self._lock:
                self._spare = self._spare or spare or None
        else:
            self._base = None
            # Written and not the delta base: nothing reads this copy any more, so the next
            # durable save copies into its buffers (encoding.stage) instead of new memory.
            buffers = {k: v for k, v in D.flatten(snapshot).items() if isinstance(v, torch.Tensor)}
            with self._lock:
                self._spare = buffers or None

    def _raise_writer_errors(self) -> None:
        if self._errors:
            raise self._errors.pop(0)

    # ---- tier 3 -------------------------------------------------------------------
    def save_emergency(self, step: int, state: dict, metrics: dict, *, source: str, blocking: bool = True,
                       notice: dict | None = None) -> str | None:
        """Persist the newest state now, ahead of any queued durable write: the full state or
        a delta, whichever fits the time `notice` leaves (runtime/emergency.py).

        `blocking`: the caller is the training thread (its whole duration is blocked time).
        """
        if step in self._saved_steps:
            return None
        called = time.perf_counter()
        # On the CPU the live state is consistent (the workload stops after this save); a
        # GPU state is copied to the host, where it is compared and serialised.
        host = stage(state) if has_cuda(state) else state
        extra: dict = {}
        payload = host
        base = self._base
        delta, fraction = (None, None) if base is None else D.make_delta(host, base[1], base[0], max_fraction=1.0)
        if fraction is not None:
            extra = {"changed_fraction": round(fraction, 6), "changed_measure": "bytes"}
        elif blocking and self._versions is not None:  # the live state (a memory copy has fresh versions)
            # No base kept (a full fine-tune): say how much was written since the last durable save.
            written, _ = self._written_since_durable(state)
            extra = {"changed_fraction": round(written or 0.0, 6), "changed_measure": "writes"}
        plan = choose(full_bytes=sum(D.nbytes(v) for _, v in D.leaves(host)),
                      delta_bytes=D.delta_bytes(delta) if delta is not None and fraction < 1.0 else None,
                      usual_delta=delta is not None and fraction <= D.MAX_CHANGED_FRACTION, times=self.times,
                      notice=notice, last_durable_step=self.last_durable_step,
                      local_times=self.local_times if self.local_store is not None else None)
        if notice is not None:  # announced before the write: a notice that cannot be met says so
            self.events.emit(Notice(source=notice.get("source") or source, deadline=notice.get("deadline"),
                                    received_at=float(notice.get("received_at") or time.time()), step=step,
                                    **plan.fields()))
        if plan.kind == "delta":
            payload, extra["delta_of"] = delta, base[0]
        return self._put(step, payload, host["model"], metrics, "emergency", called=called,
                         blocked=None if blocking else 0.0, source=source,
                         extra={**extra, **(plan.fields() if notice is not None else {})},
                         local_first=notice if plan.tier == "local" else None)

    def emergency_from_memory(self, *, source: str, notice: dict | None = None) -> str | None:
        with self._memory_lock:  # the training thread may not overwrite it while it is written
            if self.memory is None:
                return None
            step, state, metrics = self.memory
            return self.save_emergency(step, state, metrics, source=source, blocking=False, notice=notice)

    # ---- common -------------------------------------------------------------------
    def _put(self, step: int, payload: dict, model_state: dict, metrics: dict, tier: str, *, called: float,
             blocked: float | None, source: str = "", extra: dict | None = None,
             local_first: dict | None = None) -> str | None:
        """Write one checkpoint (to the local disk first, then the store, when `local_first`
        holds the notice that asked for it) and report it once the store's manifest commits."""
        name = checkpoint_dir_name(step, self.attempt)
        uri = self.store.uri_for(self.job_id, name)
        with self._lock:
            # Claim the step and link the chain under the lock, then write outside it, so an
            # emergency save never waits for an older durable write still in flight.
            if step in self._saved_steps:
                return None
            self._saved_steps.add(step)
            parent, self.parent_uri = self.parent_uri, uri
        started = time.perf_counter()
        manifest = CheckpointManifest(job_id=self.job_id, step=step, tier=tier, files={}, parent=parent,
                                      created_at=datetime.now(timezone.utc).isoformat(), attempt=self.attempt,
                                      meta={"metrics": metrics, **(extra or {})}, format="torch")
        legs: dict = {}
        try:
            if local_first is not None:
                manifest, legs = self._via_local_disk(name, payload, model_state, manifest, local_first)
            else:
                with self.store.writer(self.job_id, name) as w:
                    manifest.weights_sha256 = write_state(w, STATE_FILE, payload, model_state)
                    manifest = w.commit(manifest)  # the manifest last: the checkpoint exists from here
        except BaseException:
            with self._lock:  # never landed: the next checkpoint's parent is the one before
                self._saved_steps.discard(step)
                if self.parent_uri == uri:
                    self.parent_uri = parent
            raise
        landed = time.perf_counter()
        seconds = landed - called
        self.save_seconds.append(seconds)
        if not legs:  # a save through the local disk measured each leg on its own (_via_local_disk)
            self.times.record(manifest.total_bytes, landed - started)
        if tier == "durable":
            self.last_durable_step = max(step, self.last_durable_step or 0)
        self.events.emit(Checkpoint(
            step=step,
            tier=tier,
            uri=uri,
            sha256=manifest.digest,
            bytes=manifest.total_bytes,
            weights_sha256=manifest.weights_sha256,
            parent=parent,
            train_loss=metrics.get("train/loss"),
            save_seconds=round(seconds, 6),
            blocked_seconds=round(seconds if blocked is None else blocked, 6),
            write_seconds=round(landed - started, 6),
            attempt=self.attempt,
            source=source or None,
            **(extra or {}),
            **legs,
        ))
        return uri

    def _via_local_disk(self, name: str, payload: dict, model_state: dict, manifest: CheckpointManifest,
                        notice: dict) -> tuple[CheckpointManifest, dict]:
        """The save to the instance's disk (fsynced, its manifest last), reported as a
        `local_checkpoint`, then uploaded to the store: (the store's manifest, each leg's seconds)."""
        began = time.perf_counter()
        with self.local_store.writer(self.job_id, name) as w:
            manifest.weights_sha256 = write_state(w, STATE_FILE, payload, model_state)
            local = w.commit(manifest)
        local_s = time.perf_counter() - began
        self.local_times.record(local.total_bytes, local_s)
        local_uri = self.local_store.uri_for(self.job_id, name)
        self.events.emit(LocalCheckpoint(step=manifest.step, attempt=self.attempt, uri=local_uri, sha256=local.digest,
                                         bytes=local.total_bytes, seconds=round(local_s, 6),
                                         time_left_s=round(time_left(notice)[0], 3)))
        began = time.perf_counter()
        durable = local_tier.upload(self.local_store, self.store, local_uri, self.job_id, name, local)
        upload_s = time.perf_counter() - began
        self.times.record(durable.total_bytes, upload_s)
        return durable, {"local_seconds": round(local_s, 6), "upload_seconds": round(upload_s, 6)}

    def flush(self) -> None:
        """Wait for queued durable writes (before exit or an emergency's report)."""
        self._queue.join()
        self._raise_writer_errors()

    def close(self) -> None:
        """Wait for the queued writes, then for the writer thread's end. The join matters at
        exit: the thread holds the last reference to this checkpointer (its bound `_drain`), so
        a thread still ending would free the host copies' tensors while the interpreter
        finalises, and torch's deallocator, made to exit the thread then, aborts the process
        (SIGABRT, "terminate called without an active exception") after every save landed."""
        try:
            self.flush()
        finally:
            if self._writer.is_alive():  # a second close has nothing to end
                self._queue.put(None)
                self._writer.join()
