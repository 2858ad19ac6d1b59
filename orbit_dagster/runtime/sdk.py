"""The workload's side of the agent: config, resume, metrics and checkpoints.

A workload script defines `main(ctx: RunContext)` and calls `ctx.step_done(step, state_fn,
metrics)` after every optimiser step; the context decides, per the recorded policy, when
to snapshot in memory, when to write a durable checkpoint, and whether a reclaim notice
requires an emergency checkpoint now (after which it raises `Preempted`).

The device is the runtime's choice (`ctx.device`: CUDA when present, else the CPU, see
`runtime.device`); the workload moves its model and batches there, wraps its forward pass
in `ctx.autocast()` and calls `ctx.deterministic()` before building anything.
"""
from __future__ import annotations

import math
import operator
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..core.host_contract import Device, Evaluation, Loaded, Metrics, Progress, Resumed
from ..storage.base import CheckpointStore
from . import device as devices
from .checkpoint_schedule import CheckpointSchedule
from .checkpointing import STATE_FILE, Checkpointer
from .delta import DELTA_KEY, apply_delta, is_delta
from .encoding import read_state
from .events import EventWriter
from .exits import CheckpointMismatch, Diverged, Preempted
from .local_tier import local_store_for
from .notices import NOTICE_GRACE_S, NoticeWatcher

StateFn = Callable[[], dict[str, Any]]
PROGRESS_EVERY_S = 1.0
# A memory snapshot is taken only once a gap between two step boundaries has lasted this share
# of the notice grace, i.e. once a notice could have found no boundary within the grace: with
# shorter gaps the next boundary always comes in time, the emergency save is written from the
# live state there, and a snapshot would only cost time. Not less than 1: on the benchmark
# machine a first durable save's background write slowed two steps of the 100M model to
# 2.6-2.7 s (docs/benchmarks.md), which at half the 5 s grace turned the tier on for the run.
MEMORY_GAP_SHARE = 1.0


class RunContext:
    def __init__(
        self,
        *,
        job: dict,
        bundle_dir: Path,
        workdir: Path,
        attempt: int,
        events: EventWriter,
        store: CheckpointStore | None,
        watcher: NoticeWatcher,
        checkpoint_every: int,
        memory_every: int,
        metrics_every: int = 10,
        resume_from: str | None = None,
        eval_checkpoint: str | None = None,
        expect_sha256: str | None = None,
        stop_after_step: int | None = None,
        interval_plan: dict | None = None,
        notice_grace: float = NOTICE_GRACE_S,
    ):
        self.job = job
        self.job_id: str = job["job_id"]
        self.template: dict = job["template_snapshot"]
        self.config: dict = dict(self.template.get("config", {}))
        self.threads: int = int(self.template.get("resources", {}).get("cpu_threads", 1))
        self.bundle_dir = bundle_dir
        self.inputs = bundle_dir / "inputs"
        self.workdir = workdir
        self.attempt = attempt
        self.events = events
        self.store = store
        self.watcher = watcher
        # Which steps save durably; the interval is re-decided after each save (checkpoint_schedule.py).
        self.schedule = CheckpointSchedule(checkpoint_every, interval_plan)
        self.memory_every = max(1, int(memory_every))
        self.notice_grace = float(notice_grace)
        if not math.isfinite(self.notice_grace) or self.notice_grace < 0:
            raise ValueError(f"notice_grace must be a finite number of seconds >= 0, got {notice_grace!r}: "
                             f"pass --notice-grace SECONDS (default {NOTICE_GRACE_S})")
        # The longest time the workload spent between two step_done calls so far (its own
        # step: data, forward, backward, optimiser, an evaluation between steps): whether a
        # notice could wait longer than the grace for a step boundary, and so whether memory
        # snapshots pay. Time inside step_done is ours and not counted: the staging copy of a
        # save, bounded by the state's size (a first save into new memory included).
        self.longest_gap = 0.0
        self._returned_at: float | None = None
        self.metrics_every = max(1, int(metrics_every))
        self.resume_from = resume_from
        self.eval_checkpoint = eval_checkpoint
        self.expect_sha256 = expect_sha256
        self.stop_after_step = stop_after_step  # for tests: simulate a crash after this step
        # Chosen before any workload code runs (DeviceError, a user error, when ORBIT_DEVICE
        # names a device this host lacks).
        self.device_plan = devices.plan()
        events.emit(Device(**self.device_plan.describe()))
        # The instance's own disk as the emergency save's first stop, where the store is elsewhere.
        self.checkpointer = (
            Checkpointer(store, events, job_id=self.job_id, attempt=attempt, parent_uri=resume_from,
                         local_store=local_store_for(store, workdir)) if store else None
        )
        self._pending_metrics: dict[str, list[float]] = {}
        self._last_flush = time.time()
        self._last_metrics: dict[str, float] = {}
        self._emergency_done = threading.Event()
        self._durable_asked = threading.Event()  # an early durable save (a rebalance recommendation)
        self._step_lock = threading.Lock()
        self.last_step: int | None = None
        self.eval_metrics: dict[str, float] | None = None

    # ---- device -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.device_plan.device

    def autocast(self):
        """Context manager for the forward pass: bf16 autocast on a GPU that supports it, else fp32."""
        return devices.autocast(self.device_plan)

    def deterministic(self) -> None:
        """Settings under which a resumed run is bit-identical to an uninterrupted one on this host."""
        devices.make_deterministic(self.device, self.threads)

    # ---- resume -------------------------------------------------------------------
    def _load(self, uri: str, purpose: str) -> dict[str, Any]:
        if self.store is None:
            raise RuntimeError("no checkpoint store configured")
        scratch = self.workdir / f"{purpose}-{uri.rstrip('/').rsplit('/', 1)[-1]}"
        shutil.rmtree(scratch, ignore_errors=True)
        # Every part verified (on several threads); a local store's files are read where they
        # lie, a remote one's are fetched into `scratch` first.
        manifest, directory = self.store.checkout(uri, scratch)
        if purpose in ("resume", "eval") and self.expect_sha256 and manifest.digest != self.expect_sha256:
            # The files match their manifest, but not what the control plane registered:
            # both were rewritten. Never train on or evaluate such weights.
            raise CheckpointMismatch(f"checkpoint {uri} has digest {manifest.digest[:12]}, the ledger recorded "
                                     f"{self.expect_sha256[:12]}")
        try:
            state = read_state(directory / STATE_FILE, in_place=Path(directory) != scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # loaded: a fetched copy is no longer needed
        if is_delta(state):  # an emergency delta: its base first, then the changed leaves
            base = self._load(state[DELTA_KEY]["base"], f"{purpose}-base")
            state = apply_delta(base, state)
        kind = Resumed if purpose == "resume" else Loaded
        self.events.emit(kind(uri=uri, step=manifest.step, tier=manifest.tier))
        return state

    def resume_state(self) -> dict[str, Any] | None:
        """The state to continue from (None: start from scratch)."""
        return self._load(self.resume_from, "resume") if self.resume_from else None

    def load_eval_checkpoint(self) -> dict[str, Any]:
        if not self.eval_checkpoint:
            raise RuntimeError("this run has no checkpoint to evaluate")
        return self._load(self.eval_checkpoint, "eval")

    # ---- progress -----------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            v = float(v)
            if math.isnan(v) or math.isinf(v):
                self.events.emit(Metrics(step=step, values={k: v}))  # written as "nan"/"inf"
                raise Diverged(f"metric {k} is {v} at step {step}")
            self._pending_metrics.setdefault(k, []).append(v)

    def _flush_metrics(self, step: int) -> dict[str, float]:
        self._last_flush = time.time()
        if self._pending_metrics:
            # The mean since the last report: a smoother figure than one noisy batch.
            self._last_metrics = {k: sum(v) / len(v) for k, v in self._pending_metrics.items()}
            self._pending_metrics = {}
            self.events.emit(Metrics(step=step, values=self._last_metrics))
        return dict(self._last_metrics)

    def step_done(self, step: int, state_fn: StateFn, metrics: dict[str, float] | None = None, *, final: bool = False) -> None:
        """Call after each optimiser step; `step` counts completed steps (an integer: numpy's too)."""
        if self._returned_at is not None:
            self.longest_gap = max(self.longest_gap, time.perf_counter() - self._returned_at)
        try:
            # The host contract's steps are integers (numpy's too): a float step fails here, named.
            self._step_done(operator.index(step), state_fn, metrics, final=final)
        finally:
            self._returned_at = time.perf_counter()

    def _step_done(self, step: int, state_fn: StateFn, metrics: dict[str, float] | None, *, final: bool) -> None:
        if metrics:
            self.log_metrics(step, metrics)
        with self._step_lock:
            self.last_step = step
            # Every few steps, and at least once a second: the control plane's view of
            # progress (and so the wasted-time figure after a loss) is never older than that.
            if step % self.metrics_every == 0 or final or time.time() - self._last_flush >= PROGRESS_EVERY_S:
                self._flush_metrics(step)
            ck = self.checkpointer
            if ck is None:
                return
            if self.watcher.pending:
                self.events.emit(Progress(step=step))
                ck.save_emergency(step, state_fn(), self._flush_metrics(step), source=self.watcher.source,
                                  notice=self.watcher.current)
                self._emergency_done.set()
                raise Preempted(f"reclaim notice ({self.watcher.source}); emergency checkpoint at step {step}")
            if final or self.schedule.due(step) or self._durable_asked.is_set():
                self._durable_asked.clear()
                self.events.emit(Progress(step=step))
                ck.save_durable_async(step, state_fn(), self._flush_metrics(step))
                decided = None if final else self.schedule.after_save(step)
                if decided is not None:
                    self.events.emit(decided)
            elif step % self.memory_every == 0 and self.longest_gap >= MEMORY_GAP_SHARE * self.notice_grace:
                ck.snapshot_memory(step, state_fn(), self._last_metrics)
        if self.stop_after_step is not None and step >= self.stop_after_step:
            # Test hook: a crash after this step, without the run's final checkpoint. Saves
            # already started are finished first, so which checkpoints exist is decided by
            # the step, not by how fast the writer thread happened to be.
            if ck is not None:
                ck.flush()
            raise SystemExit(99)

    def request_durable(self) -> None:
        """Take a durable checkpoint at the next step boundary, whatever the schedule says (the
        agent asks on a rebalance recommendation); the schedule is re-decided after it as after any."""
        self._durable_asked.set()

    def on_notice_timeout(self, grace_s: float | None = None) -> None:
        """If no step boundary comes within `grace_s` (the context's notice grace) after a
        notice, save the in-memory snapshot."""
        grace_s = self.notice_grace if grace_s is None else grace_s

        def fallback() -> None:
            if self._emergency_done.wait(grace_s) or self.checkpointer is None:
                return
            # The training thread is stuck in a long step: the snapshot is older but it is
            # the newest state we can save before the deadline. If the step boundary comes
            # after all, it saves a newer checkpoint too; both are complete and valid.
            if self.checkpointer.emergency_from_memory(source="memory-snapshot", notice=self.watcher.current):
                self._emergency_done.set()

        threading.Thread(target=fallback, name="notice-fallback", daemon=True).start()

    @property
    def notice_pending(self) -> bool:
        return self.watcher.pending

    def report_eval(self, metrics: dict[str, float]) -> None:
        self.eval_metrics = {k: float(v) for k, v in metrics.items()}
        self.events.emit(Evaluation(metrics=self.eval_metrics, checkpoint=self.eval_checkpoint))

    @property
    def checkpoint_every(self) -> int:
        """The durable checkpoint interval in steps now (it changes as the instance ages)."""
        return self.schedule.every

    def close(self) -> None:
        if self.checkpointer:
            self.checkpointer.close()

    def elapsed(self, t0: float) -> float:
        return time.time() - t0
