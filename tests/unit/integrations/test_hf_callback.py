"""OrbitCallback (integrations/hf.py) one hook at a time, with real transformers objects; the
whole route on real Trainer processes is tests/integration/test_hf_route.py."""
from __future__ import annotations

import ast
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from orbit_dagster.integrations import hf
from orbit_dagster.integrations.hf import OrbitCallback, metric_name, metric_values, orbit_training_args


@pytest.fixture
def outside(monkeypatch):
    for var in [k for k in os.environ if k.startswith("ORBIT_")]:
        monkeypatch.delenv(var)


@pytest.fixture
def orbit_env(tmp_path, monkeypatch, outside):
    e = SimpleNamespace(ckpt=tmp_path / "ckpt", metrics=tmp_path / "metrics.jsonl", stop=tmp_path / "stop")
    e.ckpt.mkdir()
    for var, value in {"ORBIT_JOB_ID": "j1", "ORBIT_ATTEMPT": "1", "ORBIT_TASK": "train",
                       "ORBIT_CHECKPOINT_DIR": str(e.ckpt), "ORBIT_METRICS_FILE": str(e.metrics),
                       "ORBIT_CHECKPOINT_EVERY": "25", "ORBIT_STOP_FILE": str(e.stop), "ORBIT_RESUME_FROM": ""}.items():
        monkeypatch.setenv(var, value)
    return e


@pytest.fixture
def sigterm_restored():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def state(step: int, zero: bool = True) -> TrainerState:
    return TrainerState(global_step=step, is_world_process_zero=zero)


def test_metric_names_map_hf_log_keys_into_orbit_namespaces():
    assert {k: metric_name(k) for k in ("loss", "eval_loss", "eval_accuracy", "test_loss", "train_runtime",
                                        "train_loss", "grad_norm", "learning_rate", "epoch", "custom/x")} == {
        "loss": "train/loss", "eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy", "test_loss": "test/loss",
        "train_runtime": "train/runtime", "train_loss": "train/mean_loss", "grad_norm": "train/grad_norm",
        "learning_rate": "train/learning_rate", "epoch": "train/epoch", "custom/x": "custom/x"}


def test_metric_values_keep_finite_numbers_only():
    logs = {"loss": 2.5, "eval_steps": 3, "flag": True, "note": "x", "none": None, "nan": float("nan"),
            "inf": float("inf")}
    assert metric_values(logs) == {"train/loss": 2.5, "eval/steps": 3.0}


def test_on_log_writes_one_metrics_line_at_the_global_step(orbit_env):
    cb = OrbitCallback()
    cb.on_log(None, state(40), TrainerControl(), logs={"loss": 1.5, "learning_rate": 0.001, "epoch": 0.5})
    cb.on_log(None, state(40), TrainerControl(), logs={"eval_loss": 1.7, "eval_runtime": 0.2})
    cb.on_log(None, state(40, zero=False), TrainerControl(), logs={"loss": 9.0})  # another process: not written
    lines = [json.loads(line) for line in orbit_env.metrics.read_text().splitlines()]
    assert lines == [{"step": 40, "train/loss": 1.5, "train/learning_rate": 0.001, "train/epoch": 0.5},
                     {"step": 40, "eval/loss": 1.7, "eval/runtime": 0.2}]


def test_outside_orbit_the_callback_does_nothing(outside, tmp_path, sigterm_restored):
    before = signal.getsignal(signal.SIGTERM)
    (tmp_path / "checkpoint-5").mkdir()
    args = SimpleNamespace(output_dir=str(tmp_path))
    cb = OrbitCallback()
    cb.on_train_begin(args, state(0), TrainerControl())
    assert signal.getsignal(signal.SIGTERM) is before  # no handler: SIGTERM ends the script as it did
    cb.signalled = True  # even a stop seen would not steer HF outside orbit
    control = cb.on_step_end(args, state(5), TrainerControl())
    assert control == TrainerControl()
    cb.on_log(args, state(5), TrainerControl(), logs={"loss": 1.0})
    cb.on_save(args, state(5), TrainerControl())
    cb.on_train_end(args, state(5), TrainerControl())
    assert list(tmp_path.rglob("*")) == [tmp_path / "checkpoint-5"]  # no marker, no metrics file


def test_the_stop_file_makes_the_next_step_end_log_save_and_stop(orbit_env):
    cb = OrbitCallback()
    control = cb.on_step_end(None, state(7), TrainerControl())
    assert not (control.should_save or control.should_training_stop)
    orbit_env.stop.touch()  # the agent's reclaim notice
    control = cb.on_step_end(None, state(8), TrainerControl())
    assert control.should_log and control.should_save and control.should_training_stop


def test_sigterm_is_caught_chained_to_the_previous_handler_and_restored_at_the_end(orbit_env, sigterm_restored):
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGTERM, previous)
    cb = OrbitCallback()
    args = SimpleNamespace(output_dir=str(orbit_env.ckpt))
    cb.on_train_begin(args, state(0), TrainerControl())
    assert signal.getsignal(signal.SIGTERM) == cb._on_signal
    os.kill(os.getpid(), signal.SIGTERM)
    assert cb.signalled and calls == [signal.SIGTERM]
    control = cb.on_step_end(args, state(3), TrainerControl())
    assert control.should_save and control.should_training_stop
    cb.on_train_end(args, state(3), TrainerControl())
    assert signal.getsignal(signal.SIGTERM) is previous


def test_sigterm_with_the_default_handler_before_does_not_end_the_process(orbit_env, sigterm_restored):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cb = OrbitCallback()
    cb.on_train_begin(None, state(0), TrainerControl())
    os.kill(os.getpid(), signal.SIGTERM)  # SIG_DFL is not chained: the process lives to save
    assert cb.signalled
    cb.on_train_end(None, state(0), TrainerControl())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_on_save_writes_the_completion_marker_into_the_saved_checkpoint(orbit_env):
    saved = orbit_env.ckpt / "checkpoint-12"
    saved.mkdir()
    (saved / "model.safetensors").write_bytes(b"x")
    OrbitCallback().on_save(SimpleNamespace(output_dir=str(orbit_env.ckpt)), state(12), TrainerControl())
    assert json.loads((saved / ".orbit-complete").read_text()) == {"step": 12}
    assert sorted(p.name for p in saved.iterdir()) == [".orbit-complete", "model.safetensors"]  # no temporary left


def test_orbit_training_args_take_orbits_output_dir_and_save_steps(orbit_env, tmp_path):
    args = orbit_training_args(output_dir=str(tmp_path / "mine"), save_steps=999, max_steps=10, report_to="none")
    assert Path(args.output_dir) == orbit_env.ckpt and args.save_steps == 25 and args.save_strategy == "steps"
    assert args.max_steps == 10


def test_orbit_training_args_outside_orbit_are_the_arguments_given(outside, tmp_path):
    args = orbit_training_args(output_dir=str(tmp_path / "mine"), save_steps=999, report_to="none")
    assert Path(args.output_dir) == tmp_path / "mine" and args.save_steps == 999


def test_the_callback_module_imports_only_transformers_the_stdlib_and_env():
    tree = ast.parse(Path(hf.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("." + ",".join(a.name for a in node.names) if node.level else node.module.split(".")[0])
    assert {r for r in roots if r not in sys.stdlib_module_names} == {"transformers", ".env"}


def test_periodic_saves_follow_the_agents_schedule_not_the_save_steps_grid(orbit_env, tmp_path, monkeypatch):
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps({"every": 25, "next_step": 40}))
    monkeypatch.setenv("ORBIT_CHECKPOINT_SCHEDULE", str(schedule))
    cb = OrbitCallback()

    def step_end(step: int, grid_save: bool) -> bool:
        st = TrainerState(global_step=step, is_world_process_zero=True, max_steps=100)
        return cb.on_step_end(None, st, TrainerControl(should_save=grid_save)).should_save

    assert not step_end(25, grid_save=True)  # save_steps' grid (the launch interval): not due any more
    assert step_end(40, grid_save=False) and not step_end(41, grid_save=False)  # due once, where the agent said
    assert step_end(100, grid_save=True)  # the Trainer's save at the end stays
