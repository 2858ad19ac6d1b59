"""The runtime agent on a real bundle: checkpoints, bit-identical resume, emergency save."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from tests.helpers import wait_for

SMALL = {"config.steps": 12, "checkpoint.every_steps": 4}


def small_bundle(root: Path, **extra):
    t = load_template("charlm-finetune")
    # config.* values go in unvalidated: these tests hand the agent values a submission refuses (lr=-1).
    raw = {k.split(".", 1)[1]: v for k, v in extra.items() if k.startswith("config.")}
    t = apply_overrides(t, {**SMALL, **{k: v for k, v in extra.items() if not k.startswith("config.")}})
    cfg = {**t.config, "d_model": 32, "n_heads": 2, "n_layers": 1, "seq_len": 32, "micro_batch": 4, "grad_accum": 1,
           **raw}
    t = t.model_copy(update={"config": cfg})
    return build_bundle(t, TaskSubmission(template=t.name), "job-agent", root / "bundles")


def agent(bundle: Path, workdir: Path, store: Path, *args: str, wait=True, env: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(bundle / "runtime"), "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [sys.executable, "-m", "orbit_dagster.runtime.agent", str(bundle), "--workdir", str(workdir),
            "--store", store.as_uri(), *args]
    workdir.mkdir(parents=True, exist_ok=True)
    # The agent's log goes to a file: a pipe nobody reads would fill and block it.
    log = open(workdir / "agent.log", "ab")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    if wait:
        proc.wait(180)
    return proc


def events(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "artifacts" / "events.jsonl").read_text().splitlines()]


def final_weights(workdir: Path) -> str:
    return [e for e in events(workdir) if e["type"] == "checkpoint"][-1]["weights_sha256"]


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    b = small_bundle(tmp_path)
    full = agent(b.path, tmp_path / "w1", tmp_path / "s1")
    assert full.returncode == 0, (tmp_path / "w1" / "agent.log").read_text()
    ck = [e for e in events(tmp_path / "w1") if e["type"] == "checkpoint"]
    assert [e["step"] for e in ck] == [4, 8, 12]
    assert (tmp_path / "w1" / "artifacts" / "runtime-precheck.log").read_text().startswith("bundle_sha256: " + b.bundle_hash)
    crashed = agent(b.path, tmp_path / "w2", tmp_path / "s2", "--stop-after-step", "6")
    assert crashed.returncode == 99
    resume = (tmp_path / "s2" / "job-agent" / "step-000000004-a1").as_uri()
    resumed = agent(b.path, tmp_path / "w2", tmp_path / "s2", "--attempt", "2", "--resume-from", resume)
    assert resumed.returncode == 0, (tmp_path / "w2" / "agent.log").read_text()
    assert final_weights(tmp_path / "w2") == final_weights(tmp_path / "w1")
    exit_info = json.loads((tmp_path / "w2" / "artifacts" / "exit.json").read_text())
    assert exit_info["code"] == 0 and exit_info["last_step"] == 12
    # The runtime chose the device and said so; each save reported its blocked and write time.
    (dev,) = [e for e in events(tmp_path / "w1") if e["type"] == "device"]
    if not torch.cuda.is_available():
        assert (dev["device"], dev["precision"]) == ("cpu", "fp32")
    assert all(0 <= e["blocked_seconds"] <= e["save_seconds"] and e["write_seconds"] > 0 for e in ck)


def test_a_device_the_host_lacks_is_a_user_error_naming_the_setting(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    b = small_bundle(tmp_path)
    proc = agent(b.path, tmp_path / "w", tmp_path / "s", env={"ORBIT_DEVICE": "cuda"})
    info = json.loads((tmp_path / "w" / "artifacts" / "exit.json").read_text())
    assert (proc.returncode, info["failure_class"]) == (1, "user_error")
    assert "ORBIT_DEVICE='cuda'" in info["reason"] and "fix:" in info["reason"]


def wait_for_event(workdir: Path, kind: str) -> None:
    """Wait until the agent in `workdir` has emitted an event of type `kind`."""
    log = workdir / "artifacts" / "events.jsonl"
    wait_for(lambda: log.exists() and any(e["type"] == kind for e in events(workdir)), 120, 0.1,
             what=f"a {kind} event from the agent")


def test_sigterm_takes_an_emergency_checkpoint_and_exits_as_preempted(tmp_path):
    b = small_bundle(tmp_path, **{"config.steps": 100000, "checkpoint.every_steps": 1000})
    proc = agent(b.path, tmp_path / "w", tmp_path / "s", wait=False)
    wait_for_event(tmp_path / "w", "metrics")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 75
    ev = events(tmp_path / "w")
    emergency = [e for e in ev if e["type"] == "checkpoint" and e["tier"] == "emergency"]
    assert len(emergency) == 1
    exit_ev = [e for e in ev if e["type"] == "exit"][0]
    assert exit_ev["failure_class"] == "reclaim" and exit_ev["last_step"] == emergency[0]["step"]
    assert (Path(emergency[0]["uri"][len("file://"):]) / "manifest.json").is_file()


def test_tampered_bundle_refuses_to_run(tmp_path):
    b = small_bundle(tmp_path)
    (b.path / "scripts" / "train.py").write_text("raise SystemExit('tampered')\n")
    proc = agent(b.path, tmp_path / "w", tmp_path / "s")
    assert proc.returncode == 65
    assert json.loads((tmp_path / "w" / "artifacts" / "exit.json").read_text())["failure_class"] == "user_error"


@pytest.mark.parametrize("override,code,cls", [
    ({"config.lr": -1.0}, 1, "user_error"),
    ({"config.device_memory_mb": 0.01}, 3, "oom"),
    ({"config.lr": 1e12}, 4, "divergence"),
])
def test_failures_are_classified(tmp_path, override, code, cls):
    b = small_bundle(tmp_path, **override)
    proc = agent(b.path, tmp_path / "w", tmp_path / "s")
    info = json.loads((tmp_path / "w" / "artifacts" / "exit.json").read_text())
    assert (proc.returncode, info["failure_class"]) == (code, cls), info


def _emergency_after_sigterm(tmp_path, trainable):
    b = small_bundle(tmp_path, **{"config.steps": 100000, "checkpoint.every_steps": 8, "config.trainable": trainable})
    proc = agent(b.path, tmp_path / "w", tmp_path / "s", wait=False)
    wait_for_event(tmp_path / "w", "checkpoint")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 75
    ev = events(tmp_path / "w")
    durable = [e for e in ev if e["type"] == "checkpoint" and e["tier"] == "durable"]
    emergency = [e for e in ev if e["type"] == "checkpoint" and e["tier"] == "emergency"][0]
    return b, durable, emergency


def test_emergency_is_a_delta_only_when_that_is_smaller(tmp_path):
    # Head-only fine-tune: a small part of the state changes, so the emergency save is a delta ...
    b, durable, emergency = _emergency_after_sigterm(tmp_path / "head", "head")
    # Its base is a durable checkpoint that had landed before it (one still being written may never land).
    assert emergency["delta_of"] in [e["uri"] for e in durable if e["seq"] < emergency["seq"]]
    assert emergency["changed_fraction"] < 0.5
    assert emergency["bytes"] < 0.7 * durable[-1]["bytes"]
    # ... and resuming from it (base + delta) gives exactly the weights an uninterrupted run has.
    stop = emergency["step"] + 3
    resumed = agent(b.path, tmp_path / "head" / "w2", tmp_path / "head" / "s", "--attempt", "2",
                    "--resume-from", emergency["uri"], "--stop-after-step", str(stop), "--checkpoint-every", "1")
    assert resumed.returncode == 99
    ref = agent(b.path, tmp_path / "head" / "w3", tmp_path / "head" / "s3", "--stop-after-step", str(stop),
                "--checkpoint-every", "1")
    assert ref.returncode == 99
    step_of = lambda w: {e["step"]: e["weights_sha256"] for e in events(w) if e["type"] == "checkpoint"}  # noqa: E731
    assert step_of(tmp_path / "head" / "w2")[stop] == step_of(tmp_path / "head" / "w3")[stop]
    # Full fine-tune: everything changes every step, so a full save is written instead.
    _, _, full = _emergency_after_sigterm(tmp_path / "all", "all")
    assert "delta_of" not in full and full["changed_fraction"] > 0.9
    assert full["changed_measure"] in ("bytes", "writes")  # "writes": no base kept once all of it changed


def test_the_agent_takes_more_checkpoints_to_evaluate_after_its_first():
    from orbit_dagster.providers.base import LaunchSpec
    from orbit_dagster.providers.common import agent_argv
    from orbit_dagster.runtime.agent import parse_args

    spec = LaunchSpec(task="eval", store_uri="file:///s", eval_checkpoint="file:///c/4", eval_sha256="a" * 64,
                      eval_more=(("file:///c/8", "b" * 64), ("file:///c/12", "c" * 64)))
    args = parse_args(agent_argv(sys.executable, Path("/b"), Path("/w"), spec, None)[3:])
    assert (args.checkpoint, args.expect_sha256) == ("file:///c/4", "a" * 64)
    assert args.also_evaluate == [["file:///c/8", "b" * 64], ["file:///c/12", "c" * 64]]
    one = parse_args(agent_argv(sys.executable, Path("/b"), Path("/w"), spec.model_copy(update={"eval_more": ()}),
                                None)[3:])
    assert one.also_evaluate == [] and one.checkpoint == "file:///c/4"  # `--checkpoint` alone, as before
