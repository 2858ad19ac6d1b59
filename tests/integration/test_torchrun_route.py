"""A 2-process DDP job (gloo, CPU) under torchrun: a stop reaches every rank, the group agrees
on the step, rank 0 saves it, and no rank outlives the group; resumed from that save, the
run ends with the weights of an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import orbit_dagster.workloads as shipped

SCRIPT = Path(shipped.__file__).parent / "ddpscript" / "train.py"
STEPS = 120


def torchrun(out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
            "--output_dir", str(out), "--steps", str(STEPS), "--save_every", "50", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own group: the test can tell whether a rank outlives it


def steps_of(lines: list[str]) -> list[int]:
    return [json.loads(line)["step"] for line in lines if line.startswith("{")]


def weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.timeout(600)
def test_sigterm_stops_every_rank_at_one_step_and_the_resumed_run_ends_bit_identical(tmp_path):
    plain = torchrun(tmp_path / "plain")
    assert plain.wait(timeout=300) == 0, plain.stdout.read()

    stopped = torchrun(tmp_path / "stopped")
    seen: list[str] = []
    for line in stopped.stdout:  # past the first save, then the notice
        seen.append(line)
        if steps_of(seen) and steps_of(seen)[-1] >= 60:
            break
    stopped.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
    seen += stopped.stdout.read().splitlines()
    stopped.wait(timeout=120)
    deadline = time.time() + 30
    while group_alive(stopped.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not group_alive(stopped.pid), "a rank outlived the stopped group"
    last = steps_of(seen)[-1]
    assert 60 <= last < STEPS
    saved = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "stopped").glob("ckpt_*.pt"))
    assert saved[-1] == last  # the stop's own save: no step lost
    assert not list((tmp_path / "stopped").glob(".tmp-*"))  # nothing half-written left

    resumed = torchrun(tmp_path / "stopped", "--resume_from", str(tmp_path / "stopped" / f"ckpt_{last}.pt"))
    out = resumed.stdout.read()
    assert resumed.wait(timeout=300) == 0, out
    assert steps_of(out.splitlines())[0] == last + 1
    a, b = weights(tmp_path / "plain" / f"ckpt_{STEPS}.pt"), weights(tmp_path / "stopped" / f"ckpt_{STEPS}.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
