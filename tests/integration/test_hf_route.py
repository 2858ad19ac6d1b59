"""The Hugging Face Trainer route, end to end on real processes: workloads/hftiny/train.py run as
the agent runs a command workload (the template's argv, the contract's ORBIT_* environment,
cwd = the workload's directory), an uninterrupted run, a run sent SIGTERM mid-training and
its resume from the checkpoint it saved, compared tensor by tensor."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "orbit_dagster" / "workloads" / "hftiny"
TEMPLATE = yaml.safe_load((REPO / "orbit_dagster" / "templates" / "hf-tiny-gpt2.yaml").read_text())
STEPS = TEMPLATE["config"]["steps"]  # 100: about 3 s of training per run on one thread
EVERY = TEMPLATE["checkpoint"]["every_steps"]  # 20
LOGGING_STEPS = 5  # train.py's default
WAIT = 240  # seconds: generous, for a loaded machine (each run takes ~15 s, most of it importing transformers)


def argv(command: list[str], **values) -> list[str]:
    """The template's argv with its placeholders filled, "python" being this interpreter (as the agent does)."""
    config = SimpleNamespace(**TEMPLATE["config"])
    out = [arg.format(config=config, **values) for arg in command]
    return [sys.executable if out[0] == "python" else out[0], *out[1:]]


def start(root: Path, name: str, *, attempt: int = 1, resume_from: str = "") -> tuple[subprocess.Popen, SimpleNamespace]:
    """One attempt of the job, with the environment the agent sets (docs/bring-your-own.md)."""
    run = SimpleNamespace(root=root / name, ckpt=root / name / "checkpoints", metrics=root / name / "metrics.jsonl",
                          stop=root / name / "stop", log=root / name / "log.txt")
    run.ckpt.mkdir(parents=True)
    (run.root / "config.json").write_text(json.dumps(TEMPLATE["config"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORBIT_")}
    env.update({"ORBIT_JOB_ID": f"hf-{name}", "ORBIT_ATTEMPT": str(attempt), "ORBIT_TASK": "train",
                "ORBIT_CHECKPOINT_DIR": str(run.ckpt), "ORBIT_RESUME_FROM": resume_from,
                "ORBIT_METRICS_FILE": str(run.metrics), "ORBIT_CHECKPOINT_EVERY": str(EVERY),
                "ORBIT_CONFIG": str(run.root / "config.json"), "ORBIT_STOP_FILE": str(run.stop),
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    cmd = argv(TEMPLATE["command"], checkpoint_dir=run.ckpt, resume_from=resume_from, checkpoint_every=EVERY,
               metrics_file=run.metrics, job_id=env["ORBIT_JOB_ID"], attempt=attempt)
    fh = open(run.log, "wb")
    proc = subprocess.Popen(cmd, cwd=WORKLOAD, env=env, stdout=fh, stderr=subprocess.STDOUT)
    fh.close()
    return proc, run


def metrics(run) -> list[dict]:
    if not run.metrics.exists():
        return []
    return [json.loads(line) for line in run.metrics.read_text().splitlines() if line.endswith("}")]


def finish(proc: subprocess.Popen, run) -> int:
    try:
        return proc.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"train.py did not finish in {WAIT} s; its log:\n{run.log.read_text()[-3000:]}")


def checkpoints(run) -> dict[int, Path]:
    return {int(p.name.rsplit("-", 1)[1]): p for p in run.ckpt.iterdir() if p.name.startswith("checkpoint-")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    began = time.monotonic()
    # (a) and (b) run side by side: most of each is the import of transformers
    full, a = start(root, "full")
    stopped, b = start(root, "stopped")
    deadline = time.monotonic() + WAIT
    # SIGTERM once a step past the first save has been logged (the handler is installed by then)
    while not any(m["step"] > EVERY for m in metrics(b)):
        if stopped.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the run to interrupt never logged a step past {EVERY}; its log:\n{b.log.read_text()[-3000:]}")
        time.sleep(0.02)
    stopped.send_signal(signal.SIGTERM)
    b.signalled_after = max(m["step"] for m in metrics(b))
    b.rc = finish(stopped, b)
    a.rc = finish(full, a)
    # the agent's resume: the registered checkpoint rebuilt at a sibling `resume/<name>` of a fresh checkpoint dir
    step = max(checkpoints(b))
    resume = root / "resumed" / "resume" / f"checkpoint-{step}"
    shutil.copytree(checkpoints(b)[step], resume)
    resumed, c = start(root / "resumed", "attempt2", attempt=2, resume_from=str(resume))
    c.rc = finish(resumed, c)
    c.resumed_from = step
    return SimpleNamespace(full=a, stopped=b, resumed=c, seconds=time.monotonic() - began)


def test_an_uninterrupted_run_saves_marked_checkpoints_every_policy_interval(runs):
    a = runs.full
    assert a.rc == 0, a.log.read_text()[-3000:]
    assert sorted(checkpoints(a)) == list(range(EVERY, STEPS + 1, EVERY))
    for step, d in checkpoints(a).items():
        assert (d / ".orbit-complete").is_file() and (d / "model.safetensors").is_file()
        assert json.loads((d / "trainer_state.json").read_text())["global_step"] == step


def test_sigterm_saves_a_marked_checkpoint_at_the_step_it_stopped_on_and_exits_0(runs):
    b = runs.stopped
    assert b.rc == 0, b.log.read_text()[-3000:]
    saved = checkpoints(b)
    stop = max(saved)
    assert b.signalled_after <= stop < STEPS, f"signalled after step {b.signalled_after}; saved {sorted(saved)}"
    assert set(saved) == {s for s in range(EVERY, stop, EVERY)} | {stop}  # the periodic ones, then the stop's
    assert (saved[stop] / ".orbit-complete").is_file()
    assert json.loads((saved[stop] / "trainer_state.json").read_text())["global_step"] == stop
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):  # what an exact resume needs
        assert (saved[stop] / name).is_file(), name
    # the stop step's loss is logged, so the emergency checkpoint has a train_loss to land on
    assert max(m["step"] for m in metrics(b) if "train/loss" in m) == stop


def test_a_run_resumed_from_the_sigterm_checkpoint_ends_with_the_uninterrupted_weights(runs):
    c, a = runs.resumed, runs.full
    assert c.rc == 0, c.log.read_text()[-3000:]
    assert c.resumed_from < STEPS
    assert min(m["step"] for m in metrics(c)) > c.resumed_from  # it went on from there, not from step 0
    want = load_file(checkpoints(a)[STEPS] / "model.safetensors")
    got = load_file(checkpoints(c)[STEPS] / "model.safetensors")
    assert set(got) == set(want)
    unequal = [k for k in want if not torch.equal(want[k], got[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[0]}"


def test_the_metrics_file_holds_train_loss_at_every_logging_step(runs):
    a = runs.full
    rows = metrics(a)
    assert sorted(m["step"] for m in rows if "train/loss" in m) == list(range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS))
    assert all(isinstance(m["step"], int) and all(isinstance(v, float) for k, v in m.items() if k != "step")
               for m in rows)
    assert any("train/learning_rate" in m for m in rows)
    summary = [m for m in rows if "train/mean_loss" in m]  # train()'s closing record, at the last step
    assert len(summary) == 1 and summary[0]["step"] == STEPS
    print(f"hf route: 3 runs in {runs.seconds:.1f} s")
