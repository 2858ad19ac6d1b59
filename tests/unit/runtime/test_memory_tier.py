"""The memory tier is used only where a notice could wait longer than its grace for a step
boundary: elsewhere the emergency save is written from the live state at the next boundary,
and a snapshot every few steps would only cost the training its copies."""
from __future__ import annotations

import json
import time

import pytest
import torch

from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.runtime.notices import NoticeWatcher
from orbit_dagster.runtime.sdk import MEMORY_GAP_SHARE, RunContext
from orbit_dagster.storage.fs import FsStore


def context(tmp_path, grace: float, every: int = 10_000) -> RunContext:
    return RunContext(job={"job_id": "j", "template_snapshot": {}}, bundle_dir=tmp_path, workdir=tmp_path / "w",
                      attempt=1, events=EventWriter(tmp_path / "events.jsonl"), store=FsStore((tmp_path / "store").as_uri()),
                      watcher=NoticeWatcher(None), checkpoint_every=every, memory_every=1, notice_grace=grace)


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "step": step}


def test_with_step_boundaries_well_within_the_grace_no_snapshot_is_taken(tmp_path):
    ctx = context(tmp_path, grace=60.0)
    for step in range(1, 30):
        ctx.step_done(step, lambda s=step: state(s))
    assert ctx.longest_gap < MEMORY_GAP_SHARE * 60.0
    assert ctx.checkpointer.memory is None  # no host copy held either
    ctx.close()


def test_once_a_gap_reaches_the_grace_snapshots_are_taken(tmp_path):
    grace = 0.2
    ctx = context(tmp_path, grace=grace)
    ctx.step_done(1, lambda: state(1))
    ctx.step_done(2, lambda: state(2))
    assert ctx.checkpointer.memory is None
    time.sleep(MEMORY_GAP_SHARE * grace)  # one long step (a data stall, a compile, an eval)
    ctx.step_done(3, lambda: state(3))
    assert ctx.longest_gap >= MEMORY_GAP_SHARE * grace
    assert ctx.checkpointer.memory is not None and ctx.checkpointer.memory[0] == 3
    ctx.close()


def test_time_inside_step_done_is_not_a_step_gap(tmp_path):
    """A durable save's staging (here a slow state_fn) runs inside step_done: the training
    thread is ours then, and it is bounded; only the workload's own steps count."""
    grace = 0.2

    def slow_state(step: int) -> dict:
        time.sleep(MEMORY_GAP_SHARE * grace)
        return state(step)

    ctx = context(tmp_path, grace=grace, every=2)
    for step in range(1, 7):
        ctx.step_done(step, lambda s=step: slow_state(s))
    ctx.close()
    assert ctx.longest_gap < MEMORY_GAP_SHARE * grace
    assert ctx.checkpointer.memory is None


def test_a_step_stuck_past_the_grace_after_a_notice_writes_the_memory_snapshot(tmp_path):
    grace = 0.2
    ctx = context(tmp_path, grace=grace)
    ctx.step_done(1, lambda: state(1))
    time.sleep(MEMORY_GAP_SHARE * grace)
    ctx.step_done(2, lambda: state(2))  # a gap this long: the snapshot is taken
    ctx.on_notice_timeout()  # the notice lands; the training thread is in a long step
    deadline = time.monotonic() + 30
    while not ctx._emergency_done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    ctx.close()
    saved = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines() if '"checkpoint"' in x]
    assert [(e["step"], e["source"]) for e in saved] == [(2, "memory-snapshot")]


def test_the_grace_is_waited_for_before_the_snapshot_is_written(tmp_path):
    ctx = context(tmp_path, grace=30.0)
    time.sleep(0.01)
    ctx.step_done(1, lambda: state(1))
    ctx.on_notice_timeout()
    assert not ctx._emergency_done.wait(0.2)  # nothing written inside the grace
    ctx._emergency_done.set()  # the step boundary came: the fallback ends without writing
    ctx.close()
    assert '"checkpoint"' not in (tmp_path / "events.jsonl").read_text()


@pytest.mark.parametrize("grace", [-1.0, float("nan"), float("inf")])
def test_a_bad_notice_grace_is_refused_naming_the_flag(tmp_path, grace):
    with pytest.raises(ValueError, match=r"notice_grace .* --notice-grace"):
        context(tmp_path, grace=grace)


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "five"])
def test_the_agent_refuses_a_bad_notice_grace_naming_the_flag_and_the_value(raw, capsys):
    from orbit_dagster.runtime.agent import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["/b", "--notice-grace", raw])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--notice-grace" in err and repr(raw) in err, err
