"""Lightning's side of a command workload: `OrbitCallback` (docs/bring-your-own.md).

Add it to the Trainer's callbacks and resume through Lightning's own mechanism:

    trainer = L.Trainer(..., callbacks=[OrbitCallback()])
    trainer.fit(model, ckpt_path=resume_from() or None)

Under orbit it (a) appends the logged metrics as `{"step": global_step, ...}` lines to
ORBIT_METRICS_FILE, (b) saves `step-<global_step>.ckpt` into ORBIT_CHECKPOINT_DIR every
ORBIT_CHECKPOINT_EVERY steps (written under a name the watcher ignores, moved into place with
`os.replace`, then the sibling marker `step-<N>.ckpt.orbit-complete`; with Lightning's
`AsyncCheckpointIO` plugin, by its writer thread once the write is done), and (c) on SIGTERM or
the stop file saves at the current step, waits until it is published and stops. Outside orbit
(no ORBIT_JOB_ID) it does nothing.

How it works with Lightning's own SIGTERM handling (lightning 2.6, `_SignalConnector`, outside
SLURM): at the start of `fit` Lightning installs a SIGTERM handler that only sets
`trainer.received_sigterm` and then calls the handler that was there before; its loops raise
`SIGTERMException` (a `SystemExit` without a code, so the process exits 0) after the
`on_train_batch_end` hooks of the batch in flight. This callback installs its handler when it
is constructed, before `fit`, so Lightning's handler chains it: the one signal reaches both.
The callback saves in `on_train_batch_end`, before Lightning raises; a signal that lands
later in the batch (in validation) is saved from `on_exception`. So after a SIGTERM `fit` does
not return: it raises `SIGTERMException` and the script exits 0 after the save. After the stop
file alone (no signal), the callback sets `trainer.should_stop` and `fit` returns normally.
"""
from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from orbit_dagster.integrations import env


def checkpoint_name(step: int) -> str:
    """The name the watcher's default pattern registers at `step` (`step-100.ckpt`)."""
    return f"step-{int(step)}.ckpt"


def _scalar(value: Any) -> float | None:
    """A finite float for a scalar tensor or number; None for anything else (JSON has no NaN)."""
    if hasattr(value, "numel"):
        if value.numel() != 1:
            return None
        value = value.detach().cpu().item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def metrics_from(callback_metrics: dict, outputs: Any = None, skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """The metric keys of one line: every scalar in `callback_metrics` (as logged, e.g.
    `train/loss`, `val/loss`) but those in `skip`, plus the training step's `loss` output as
    `train/loss` when the module logged no `train/loss` itself."""
    values = {str(k): v for k, v in ((k, _scalar(v)) for k, v in callback_metrics.items())
              if v is not None and str(k) not in skip}
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    loss = _scalar(loss) if loss is not None else None
    if loss is not None and "train/loss" not in values:
        values["train/loss"] = loss
    return values


def _publish(partial: Path, final: Path, step: int) -> None:
    """A whole checkpoint file into place, then its marker (the watcher registers it from here)."""
    os.replace(partial, final)
    final.with_name(f"{final.name}{env.COMPLETE_MARKER}").write_text(f"{step}\n")


class OrbitCallback(Callback):
    """Metrics lines, periodic and stop-time checkpoints for orbit; a no-op outside orbit.

    Periodic saves follow the agent's schedule (`env.checkpoint_due`: the interval it re-decides
    after each durable save as the instance ages, ORBIT_CHECKPOINT_EVERY before it has one).
    `every` fixes the interval instead (steps between periodic saves; none = only on stop).
    """

    def __init__(self, every: int | None = None) -> None:
        self.active = env.under_orbit() and env.checkpoint_dir() is not None
        self.fixed_every = every is not None  # given here: the agent's re-decided schedule is not followed
        self.every = every if every is not None else env.checkpoint_every()
        self.signalled = False
        self.saved: list[Path] = []
        self._previous: Any = None
        # Keys validation logged: Lightning keeps their last value in callback_metrics, so a
        # training line would repeat a stale one; they go on validation lines only.
        self._eval_keys: frozenset[str] = frozenset()
        self._before_eval: dict[str, float] = {}
        self._installed = False
        if self.active:
            self._install_handler()

    # -- the stop signal ---------------------------------------------------------------
    def _install_handler(self) -> None:
        # Installed before fit so that Lightning's own handler (registered at fit start)
        # finds it and calls it after setting `received_sigterm`; signals can only be set
        # from the main thread.
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.signalled = True
        previous = self._previous
        if callable(previous) and previous is not self._on_sigterm:
            previous(signum, frame)  # chain; SIG_DFL/SIG_IGN are not callable and stay unused

    def _stop_requested(self) -> bool:
        return self.signalled or env.stop_requested()

    # -- saving ------------------------------------------------------------------------
    def save(self, trainer: Any, step: int, *, wait: bool = False) -> Path | None:
        """Save Lightning's full checkpoint at `step` as step-<step>.ckpt, then its marker.

        With Lightning's `AsyncCheckpointIO` the write goes on in its thread after
        `save_checkpoint` returns: the file is published (renamed, marked) by that same
        one-worker thread, queued after the write, so it appears as soon as it is whole and
        never before; a write that failed publishes nothing (Lightning raises its error at the
        next save or at the end of `fit`). `wait`: return only once it is published (a stop)."""
        directory = env.checkpoint_dir()
        if directory is None or step <= 0:
            return None
        final = directory / checkpoint_name(step)
        if final in self.saved:
            return final
        partial = directory / f".{final.name}.partial"  # a name the watcher never registers
        trainer.save_checkpoint(partial, weights_only=False)  # the full state: optimizer, loops, loaders
        self.saved.append(final)
        if not trainer.is_global_zero:  # only global rank 0 writes the file
            return final
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if not isinstance(io, AsyncCheckpointIO):
            _publish(partial, final, step)
            return final
        executor = getattr(io, "_executor", None)
        if executor is None:  # another Lightning's internals: wait for the write (public), then publish
            io.teardown()
            _publish(partial, final, step)
            return final

        def publish_if_written() -> None:
            if getattr(io, "_error", None) is None:  # the write queued before it did not fail
                _publish(partial, final, step)

        published = executor.submit(publish_if_written)
        if wait:
            published.result()
        return final

    def _write(self, trainer: Any, outputs: Any = None, skip: frozenset[str] = frozenset()) -> None:
        if trainer.is_global_zero:
            values = metrics_from(trainer.callback_metrics, outputs, skip)
            if values:
                env.write_metrics(trainer.global_step, values)

    # -- hooks -------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.active:
            return
        step = trainer.global_step
        due = None if self.fixed_every else env.checkpoint_due(step)  # the agent's schedule (the interval as the instance ages)
        periodic = due if due is not None else bool(self.every) and step > 0 and step % self.every == 0
        stopping = self._stop_requested()
        if periodic or stopping or step % max(1, trainer.log_every_n_steps) == 0:
            self._write(trainer, outputs, self._eval_keys)
        if periodic or stopping:
            self.save(trainer, step, wait=stopping)
        if stopping:
            trainer.should_stop = True

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.active:
            self._before_eval = metrics_from(trainer.callback_metrics)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.active and not trainer.sanity_checking:
            now = metrics_from(trainer.callback_metrics)
            self._eval_keys = self._eval_keys | {k for k, v in now.items() if self._before_eval.get(k) != v}
            self._write(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning raised SIGTERMException where no batch end came first (the signal landed
        # in validation): save now, at the step the weights are at.
        if self.active and (isinstance(exception, SIGTERMException) or self._stop_requested()):
            self.save(trainer, trainer.global_step, wait=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
