"""The fsdpscript's async saves go through one stager kept for the run: its host buffers are
allocated by the first save and reused by the next. A reused buffer must never carry one
save's data into another's checkpoint: each checkpoint, loaded back, holds exactly the state
of its own step (CPU only; the pinned variant needs CUDA and is the same code path)."""
import json
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from orbit_dagster.workloads.fsdpscript import train
from tests.helpers import same_tensors


def clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def test_the_reused_stager_copies_into_the_same_host_buffer_and_holds_the_current_values():
    stager = train.KeptStager()
    try:
        w = torch.arange(4096, dtype=torch.float32)
        first = stager.stage({"w": w})
        assert torch.equal(first["w"], w) and first["w"].data_ptr() != w.data_ptr()  # a copy, not a view
        w.mul_(3).add_(1)
        second = stager.stage({"w": w})
        assert second["w"].data_ptr() == first["w"].data_ptr()  # no new host memory for the second save
        assert torch.equal(second["w"], w)  # refreshed, not the first save's values
    finally:
        stager.close()


def test_a_state_with_other_keys_than_the_first_save_gets_new_buffers_and_plain_values_stay_current():
    stager = train.KeptStager()
    try:
        w = torch.ones(8)
        first = stager.stage({"w": w, "step": 1})
        w.add_(1)
        moments = torch.full((8,), 5.0)
        second = stager.stage({"w": w, "m": moments, "step": 2})  # an optimiser's state made since
        assert second["step"] == 2 and torch.equal(second["w"], w) and torch.equal(second["m"], moments)
        assert torch.equal(first["w"], torch.ones(8))  # the first save's copy was not written over
        w.add_(1)
        third = stager.stage({"w": w, "m": moments, "step": 3})
        assert third["m"].data_ptr() == second["m"].data_ptr() and torch.equal(third["w"], w)
        assert third["step"] == 3
    finally:
        stager.close()


def test_two_async_saves_through_one_stager_each_hold_their_own_step(tmp_path):
    model, opt = train.build(seed=7, lr=0.05, sharded=False)
    saver = train.Saver(str(tmp_path), local_rank=0, distributed=False)
    staged = []  # what the stager handed to DCP's writer, to see that it was this stager, reused
    stage = saver.stager.stage
    saver.stager.stage = lambda state_dict, **kw: staged.append(stage(state_dict, **kw)) or staged[-1]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    expected = {}
    for step in (1, 2):
        x, y = train.batch(7, step, 32, rank=0, world=1)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()  # in place: the tensors the stager copied from last time now hold new values
        state = train.state_of(model, opt, step)
        expected[step] = clone(state)
        saver.save(state, step, sync=False)
    saver.close()

    assert len(staged) == 2
    assert staged[1]["model"]["0.weight"].data_ptr() == staged[0]["model"]["0.weight"].data_ptr()
    assert not torch.equal(expected[1]["model"]["0.weight"], expected[2]["model"]["0.weight"])
    for step in (1, 2):
        fresh, fresh_opt = train.build(seed=99, lr=0.05, sharded=False)
        loaded = train.state_of(fresh, fresh_opt, 0)
        dcp.load(loaded, checkpoint_id=str(tmp_path / f"ckpt_{step}"))
        assert same_tensors(expected[step], loaded, f"ckpt_{step}") >= 7  # 4 parameters, their Adam moments, step
    assert not list(tmp_path.glob(".tmp-ckpt_*"))  # each one published whole


def test_a_written_async_save_is_published_at_once_not_when_the_next_save_begins(tmp_path):
    """The script in one process, a save every 10000 steps: `ckpt_10000` must appear while
    training goes on towards the next save (a host lost before step 20000 keeps it), not when
    that save waits for its writer. The reading lags the script by at most a pipe's worth of
    lines (~1500 steps), so a checkpoint still missing when the script has printed step 14000
    was not published before step 20000 either: the script is killed there."""
    every = 10000
    proc = subprocess.Popen([sys.executable, train.__file__, "--output_dir", str(tmp_path), "--steps", str(3 * every),
                             "--save_every", str(every)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            step = json.loads(line)["step"]
            published = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt_"))
            if published or step >= every + 4000:
                break
    finally:
        proc.kill()
        proc.wait()
    assert (published, every < step < every + 4000) == (["ckpt_10000"], True), step


def test_a_failed_async_writer_stops_the_script_at_once_and_publishes_nothing_of_it(tmp_path):
    """A save whose background writer fails (here: its directory cannot be made, a file is in
    the way, as a full or broken disk would fail it) stops the script with the writer's error
    at the next step, not an interval later, and nothing of that save is published; the
    checkpoint before it stays whole and loadable."""
    every = 5000
    (tmp_path / f".tmp-ckpt_{2 * every}").write_bytes(b"")
    proc = subprocess.run([sys.executable, train.__file__, "--output_dir", str(tmp_path), "--steps", str(4 * every),
                           "--save_every", str(every)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = json.loads(proc.stdout.splitlines()[-1])["step"]
    assert proc.returncode != 0 and "FileExistsError" in proc.stderr, proc.stderr[-2000:]
    assert 2 * every <= last < 2 * every + 3000, last  # the next save (which would wait for it) is at 3 * every
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt_")) == [f"ckpt_{every}"]
    model, opt = train.build(1234, 0.05, False)
    loaded = train.state_of(model, opt, 0)
    dcp.load(loaded, checkpoint_id=str(tmp_path / f"ckpt_{every}"))
    assert int(loaded["step"]) == every
