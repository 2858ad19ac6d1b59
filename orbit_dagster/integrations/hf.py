"""The Hugging Face Trainer route: `OrbitCallback`, added to a plain Trainer script.

    from orbit_dagster.integrations.hf import OrbitCallback
    trainer = Trainer(..., callbacks=[OrbitCallback()])
    trainer.train(resume_from_checkpoint=args.resume_from or None)

Under orbit (ORBIT_JOB_ID set by the agent, docs/bring-your-own-hf.md) the callback
- writes every `Trainer.log` record (training logs and `evaluate()` results alike) to
  ORBIT_METRICS_FILE as `{"step": global_step, ...}` with the names of `metric_name`;
- on SIGTERM (a handler installed in `on_train_begin`, chaining the previous one, restored in
  `on_train_end`) or once ORBIT_STOP_FILE exists, sets `should_log`, `should_save` and
  `should_training_stop` at the next step end: HF logs that step's loss, saves
  `checkpoint-<step>` at the step it stopped on and `train()` returns;
- saves periodically where the agent's schedule says (`env.checkpoint_due`: the interval the
  agent re-decides after each durable save as the instance ages; `save_steps` is the launch
  interval, the grid before its first decision);
- after each save writes the marker `.orbit-complete` (last) into
  `output_dir/checkpoint-<step>`, so the agent's watcher never registers a half-written one.
Outside orbit it does nothing. It imports only transformers, the stdlib and `env`.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import env

metric_name = env.hf_metric_name  # the names: integrations/env.py (`orbit import-run` uses them too)
metric_values = env.hf_metric_values


def orbit_training_args(**kwargs) -> TrainingArguments:
    """`TrainingArguments(**kwargs)` with orbit's `output_dir` (ORBIT_CHECKPOINT_DIR) and
    `save_steps` (ORBIT_CHECKPOINT_EVERY, with `save_strategy="steps"`) under orbit; outside
    orbit, kwargs as given. Under orbit, orbit's values win over the same kwargs: the agent
    watches that directory only, at the recorded checkpoint policy."""
    if env.under_orbit():
        if env.checkpoint_dir() is not None:
            kwargs["output_dir"] = str(env.checkpoint_dir())
        if env.checkpoint_every():
            kwargs["save_strategy"] = "steps"
            kwargs["save_steps"] = env.checkpoint_every()
    return TrainingArguments(**kwargs)


class OrbitCallback(TrainerCallback):
    """Metrics, stop-and-save on a reclaim notice, and completion markers (module docstring)."""

    def __init__(self, stop_signal: int = signal.SIGTERM):
        self.active = env.under_orbit()
        self.stop_signal = stop_signal
        self.signalled = False
        self._previous = None  # the handler ours replaced, restored at the end of training
        self._installed = False

    # -- the notice ------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        self.signalled = True  # acted on at the next step end: the Trainer is mid-step now
        previous = self._previous
        if callable(previous):  # chain: SIG_DFL/SIG_IGN (ints) are not called, or the process would end here
            previous(signum, frame)

    def stop_requested(self) -> bool:
        return self.signalled or env.stop_requested()

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.active or self._installed:
            return
        try:
            self._previous = signal.signal(self.stop_signal, self._on_signal)
            self._installed = True
        except ValueError:  # not the main thread: the stop file still works
            self._previous = None

    def on_train_end(self, args, state, control, **kwargs):
        if self._installed:
            signal.signal(self.stop_signal, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
            self._previous = None

    def on_step_end(self, args, state, control, **kwargs):
        if not self.active:
            return control
        if self.stop_requested():
            # the Trainer logs, saves checkpoint-<global_step> and returns from train()
            control.should_log = True
            control.should_save = True
            control.should_training_stop = True
        elif env.checkpoint_schedule() is not None:
            # The agent's schedule decides the periodic saves (the interval re-decided as the
            # instance ages), not `save_steps`' grid; the Trainer's save at the end stays.
            if env.checkpoint_due(state.global_step):
                control.should_save = True
            elif state.global_step < state.max_steps:
                control.should_save = False
        return control

    # -- metrics and markers ---------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.active or not state.is_world_process_zero or not logs:
            return
        values = metric_values(logs)
        if values:
            env.write_metrics(state.global_step, values)

    def on_save(self, args, state, control, **kwargs):
        if not self.active or not state.is_world_process_zero:
            return
        saved = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if saved.is_dir():
            write_marker(saved, state.global_step)


def write_marker(directory: Path, step: int) -> Path:
    """The completion marker, written last: a temporary name renamed into place, so the marker
    exists only once every file of the checkpoint has been written."""
    marker = directory / env.COMPLETE_MARKER
    tmp = directory / f".{env.COMPLETE_MARKER}.tmp"
    tmp.write_text(f'{{"step": {int(step)}}}\n', encoding="utf-8")
    os.replace(tmp, marker)
    return marker
