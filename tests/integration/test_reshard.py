"""The reshard test: a 2-process job (FSDP2 under torchrun, gloo on the CPU) writes sharded
torch.distributed.checkpoint checkpoints through the real agent; the store records them as
format `dcp`; the job resumes in 1 process from one of them with exactly the parameters and
optimiser state the 2 ranks held at that step, compared tensor by tensor."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.storage import open_store
from tests.helpers import same_tensors

JOB = "job-shards"


def bundle(root: Path, name: str, reference: Path, **overrides):
    t = apply_overrides(load_template("fsdp-script"), overrides)
    # The script also writes each saved (and each resumed) state whole: what the test compares.
    t = t.model_copy(update={"command": (*t.command, "--reference_dir", str(reference))})
    return build_bundle(t, TaskSubmission(template=t.name), JOB, root / name)


def agent(b, workdir: Path, store: Path, *args: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(b.path / "runtime"), "OMP_NUM_THREADS": "1"}
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "agent.log", "ab") as log:
        return subprocess.run([sys.executable, "-m", "orbit_dagster.runtime.agent", str(b.path), "--workdir",
                               str(workdir), "--store", store.as_uri(), *args], env=env, stdout=log, stderr=log,
                              timeout=240).returncode


def checkpoints(workdir: Path) -> list[dict]:
    lines = (workdir / "artifacts" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == "checkpoint"]


@pytest.mark.timeout(300)
def test_a_2_process_sharded_checkpoint_resumes_in_1_process_with_the_same_parameters(tmp_path):
    store = tmp_path / "store"
    two = bundle(tmp_path, "b2", tmp_path / "ranks2", **{"config.steps": 6, "checkpoint.every_steps": 3})
    assert agent(two, tmp_path / "w1", store) == 0, (tmp_path / "w1" / "agent.log").read_text()
    saved = checkpoints(tmp_path / "w1")
    assert [e["step"] for e in saved] == [3, 6]  # step 3 written asynchronously, step 6 (the last) not
    uri = saved[0]["uri"]  # resume from the earlier one: a chain that goes on from the middle
    manifest = open_store(store.as_uri()).verify(uri)
    assert manifest.format == "dcp" and manifest.meta["layout"] == "dir"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(manifest.files)  # one shard per rank

    one = bundle(tmp_path, "b1", tmp_path / "ranks1", **{"config.steps": 6, "checkpoint.every_steps": 3,
                                                          "resources.processes": 1})
    assert agent(one, tmp_path / "w2", store, "--attempt", "2", "--resume-from", uri,
                 "--expect-sha256", saved[0]["sha256"]) == 0, (tmp_path / "w2" / "agent.log").read_text()
    sharded = torch.load(tmp_path / "ranks2" / "full_3.pt", weights_only=True)  # what the 2 ranks held at step 3
    resumed = torch.load(tmp_path / "ranks1" / "full_3.pt", weights_only=True)  # what 1 process loaded
    assert same_tensors(sharded, resumed) >= 13  # 4 parameters, 3 Adam tensors each, the step
    # ... and it trained on from there: its own step-6 checkpoint, one process, one shard.
    (again,) = checkpoints(tmp_path / "w2")
    assert again["step"] == 6 and again["parent"] == uri
    assert {"__0_0.distcp", ".metadata"} == set(open_store(store.as_uri()).verify(again["uri"]).files)


@pytest.mark.timeout(300)
def test_3_ranks_train_on_the_global_batch_mean_even_when_it_does_not_split_evenly(tmp_path):
    """64 rows over 3 ranks are 22, 21 and 21. Each micro-batch's loss is weighted by its rows x
    world size / batch, so the ranks' gradients, averaged by FSDP, are the mean over the 64 rows,
    as one process computes it: the same weights after a few steps, up to the order of the sums.
    (Averaging each rank's own mean instead weights a 21-row rank's rows more than the 22-row
    rank's: the weights part from the second step on.)"""
    script = Path(__file__).parents[2] / "orbit_dagster" / "workloads" / "fsdpscript" / "train.py"
    args = ["--steps", "4", "--save_every", "100", "--batch", "64", "--micro_batch", "16", "--seed", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for launcher, name in ((["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"], "three"),
                           ([], "one")):
        subprocess.run([sys.executable, *launcher, str(script), "--output_dir", str(tmp_path / name),
                        "--reference_dir", str(tmp_path / f"whole-{name}"), *args], check=True, env=env, timeout=240,
                       capture_output=True)
    three = torch.load(tmp_path / "whole-three" / "full_4.pt", weights_only=True)["model"]
    one = torch.load(tmp_path / "whole-one" / "full_4.pt", weights_only=True)["model"]
    assert three.keys() == one.keys() and len(one) == 4
    for name, tensor in one.items():
        gap = (three[name] - tensor).abs().max().item()
        assert gap < 1e-5, f"{name}: 3 ranks and 1 process differ by {gap:.2e}"
