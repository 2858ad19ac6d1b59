"""The Lightning route end to end in real processes: the lightningtiny example run as the
agent runs a command workload (the contract's ORBIT_* environment set here), uninterrupted,
then stopped by SIGTERM mid-training and resumed from the checkpoint it saved."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "orbit_dagster" / "workloads" / "lightningtiny"
STEPS, EVERY = 100, 20


def _env(run: Path, **extra: str) -> dict[str, str]:
    (run / "ck").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORBIT_")}
    env.update({"ORBIT_JOB_ID": "job-1", "ORBIT_ATTEMPT": "1", "ORBIT_TASK": "train",
                "ORBIT_CHECKPOINT_DIR": str(run / "ck"), "ORBIT_METRICS_FILE": str(run / "metrics.jsonl"),
                "ORBIT_STOP_FILE": str(run / "stop"), "ORBIT_CHECKPOINT_EVERY": str(EVERY),
                "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])})
    env.update(extra)
    return env


def _train(run: Path, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", "--steps", str(STEPS), *args], cwd=WORKLOAD,
                            env=_env(run, **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name[len("step-"):-len(".ckpt")]) for p in (run / "ck").glob("step-*.ckpt"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    proc = _train(run)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return run


def test_an_uninterrupted_run_saves_every_n_steps_with_markers_and_metric_lines(uninterrupted):
    assert _steps(uninterrupted) == list(range(EVERY, STEPS + 1, EVERY))
    for step in _steps(uninterrupted):
        assert (uninterrupted / "ck" / f"step-{step}.ckpt.orbit-complete").is_file()
    assert not [p for p in (uninterrupted / "ck").iterdir() if p.name.startswith(".")]  # no partial left
    lines = _lines(uninterrupted)
    assert {line["step"] for line in lines if "train/loss" in line} >= set(range(EVERY, STEPS + 1, EVERY))
    assert any("val/loss" in line for line in lines)  # validation at the epoch's end (64 batches)


def test_sigterm_saves_at_the_step_exits_0_and_the_resumed_run_equals_the_uninterrupted_one(
        uninterrupted, tmp_path):
    first = tmp_path / "first"
    proc = _train(first, "--pace_ms", "30")  # paced, so the signal lands well before the end
    deadline = time.monotonic() + 240
    while not any(line["step"] > EVERY for line in _lines(first)):  # past the first save
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stopped = _steps(first)[-1]
    assert EVERY < stopped < STEPS, (stopped, out)
    checkpoint = first / "ck" / f"step-{stopped}.ckpt"
    assert Path(f"{checkpoint}.orbit-complete").is_file()
    assert max(line["step"] for line in _lines(first)) == stopped  # metrics up to the step it stopped at

    resumed = tmp_path / "resumed"
    proc = _train(resumed, ORBIT_RESUME_FROM=str(checkpoint), ORBIT_ATTEMPT="2")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "not resumable" not in out  # the example's loader is: Lightning restores its position
    assert _steps(resumed)[0] > stopped and _steps(resumed)[-1] == STEPS
    assert min(line["step"] for line in _lines(resumed)) > stopped  # it went on from the step, not from 0
    a, b = _weights(uninterrupted / "ck" / f"step-{STEPS}.ckpt"), _weights(resumed / "ck" / f"step-{STEPS}.ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical


def test_eval_prints_one_json_line_for_a_checkpoint(uninterrupted):
    checkpoint = uninterrupted / "ck" / f"step-{STEPS}.ckpt"
    out = subprocess.run([sys.executable, "eval.py", "--checkpoint", str(checkpoint)], cwd=WORKLOAD,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["eval/step"] == STEPS and 0 < result["eval/loss"] < 10
