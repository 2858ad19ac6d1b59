"""Emergency saves sized to the notice: the plan from the measured throughput and the time
left, announced before the write, recorded in the checkpoint event."""
import json

import pytest
import torch

from orbit_dagster.runtime import emergency as E
from orbit_dagster.runtime.checkpointing import Checkpointer
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.storage import open_store

NOW = 1_790_000_000.0
GB = 10**9


def measured(rate_bytes_s: float) -> E.SaveTimes:
    times = E.SaveTimes()
    for seconds in (1.0, 1.1, 0.9):
        times.record(int(rate_bytes_s * seconds), seconds)
    return times


def notice(left_s: float | None, source="metadata") -> dict:
    return {"source": source, "deadline": None if left_s is None else NOW + left_s, "received_at": NOW - 1}


def plan(**kw) -> E.Plan:
    args = dict(full_bytes=GB, delta_bytes=None, usual_delta=False, times=measured(100e6), notice=notice(30),
                last_durable_step=100, now=NOW)
    return E.choose(**{**args, **kw})


def test_the_full_state_when_it_fits():
    p = plan(times=measured(200e6))  # 1 GB at 200 MB/s: 5 s of 24 usable
    assert (p.kind, p.fits, round(p.estimate_s, 1), p.time_left_s) == ("full", True, 5.0, 30.0)
    assert "estimated 5.0 s at 200.0 MB/s measured on this host, 30.0 s left (the notice's deadline)" in p.reason


def test_a_larger_delta_when_the_full_state_does_not_fit_and_the_delta_does():
    p = plan(delta_bytes=GB * 6 // 10)  # 10 s full, 6 s delta; 30 s left, 24 usable
    assert (p.kind, p.fits) == ("full", True)
    p = plan(delta_bytes=GB * 6 // 10, notice=notice(10))  # 8 s usable: the full 10 s does not fit, the delta 6 s does
    assert (p.kind, p.fits, round(p.estimate_s, 1)) == ("delta", True, 6.0)
    assert "does not fit 10.0 s left" in p.reason and "a delta of 600.0 MB does" in p.reason


def test_a_notice_that_cannot_be_met_says_so_and_what_stands():
    p = plan(notice=notice(5))
    assert (p.kind, p.fits, round(p.estimate_s, 1)) == ("full", False, 10.0)
    assert "expected to miss the deadline" in p.reason and "the last durable checkpoint (step 100) stands" in p.reason
    assert "no durable checkpoint stands" in plan(notice=notice(5), last_durable_step=None).reason


def test_the_local_disk_first_when_the_store_does_not_fit_and_the_disk_does():
    # 1 GB: the store at 100 MB/s needs 10 s, the disk at 1 GB/s 1 s; 5 s left, 4 usable.
    p = plan(notice=notice(5), local_times=measured(1e9))
    assert (p.kind, p.fits, p.tier, round(p.estimate_s, 1)) == ("full", True, "local", 1.0)
    assert "the instance's disk does" in p.reason and "registered only when the upload's manifest commits" in p.reason
    assert "lost with the instance" in p.reason and "the last durable checkpoint (step 100) stands" in p.reason
    assert "expected to miss" not in p.reason
    assert p.fields()["plan_tier"] == "local"


def test_the_store_when_it_fits_whatever_the_disk_and_a_miss_when_neither_fits():
    p = plan(local_times=measured(1e9))  # 10 s of 24 usable: straight to the store
    assert (p.tier, p.fits) == ("store", True) and "plan_tier" not in p.fields()
    p = plan(notice=notice(0.5), local_times=measured(1e9))  # 0.4 s usable: 1 s on the disk does not fit either
    assert (p.kind, p.fits, p.tier) == ("full", False, "store") and "expected to miss the deadline" in p.reason
    p = plan(notice=notice(5), local_times=E.SaveTimes())  # the disk never measured: no local tier
    assert (p.fits, p.tier) == (False, "store")


def test_the_usual_small_delta_and_a_sigterm_without_deadline():
    p = plan(delta_bytes=GB // 100, usual_delta=True, notice=notice(None, source="sigterm"))
    assert (p.kind, p.fits, p.time_left_s) == ("delta", True, 29.0)  # 30 s assumed from receipt, 1 s ago
    assert "no deadline given (sigterm): 30 s assumed from its receipt" in p.reason
    p = plan(times=E.SaveTimes())
    assert (p.kind, p.fits, p.estimate_s) == ("full", True, None) and "no save measured on this host yet" in p.reason
    assert plan(notice=notice(-5)).time_left_s == 0.0  # a deadline already past


def test_the_measured_rate_is_the_median_of_the_recent_saves():
    times = E.SaveTimes()
    for nbytes, seconds in ((100, 1.0), (1000, 1.0), (300, 1.0), (0, 1.0), (5, 0.0)):
        times.record(nbytes, seconds)
    assert times.rate == 300.0 and times.estimate(600) == 2.0


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("left_s, fits", [(3600.0, True), (0.0, False)])
def test_the_checkpointer_announces_its_plan_then_lands_the_save_with_it(tmp_path, left_s, fits):
    import time

    store = open_store((tmp_path / "s").as_uri())
    ck = Checkpointer(store, EventWriter(tmp_path / "ev.jsonl"), job_id="j", attempt=1, parent_uri=None)
    state = {"model": {"w": torch.randn(256, 256)}, "optim": {"m": torch.randn(256, 256)}, "step": 1}
    ck.save_durable_async(1, state, {})
    ck.flush()
    assert ck.times.rate is not None  # measured on the durable save
    for t in (state["model"]["w"], state["optim"]["m"]):
        t.add_(1.0)  # a full fine-tune: everything changed, no delta
    uri = ck.save_emergency(2, state, {}, source="metadata",
                            notice={"source": "metadata", "deadline": time.time() + left_s, "received_at": time.time()})
    ck.close()
    got = events(tmp_path / "ev.jsonl")
    (announced,) = [e for e in got if e["type"] == "notice"]
    landed = [e for e in got if e["type"] == "checkpoint"][-1]
    assert got.index(announced) < got.index(landed)  # said before the write: known even if the host goes first
    assert announced["step"] == 2 and announced["plan"] == "full" and announced["plan_fits"] is fits
    assert landed["uri"] == uri and landed["plan_fits"] is fits and landed["plan_reason"] == announced["plan_reason"]
    assert ("expected to miss" in landed["plan_reason"]) is (not fits)
    assert store.read_manifest(uri).meta["plan"] == "full"
