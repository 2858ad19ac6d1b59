"""The replay is faithful to the trace (gangs, prices, per-cloud notice) and orbit's interval policy learns."""
from __future__ import annotations

import math

import pytest

from orbit_dagster.catalog.traces import Trace, record_name_convention
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.checkpointing import FixedInterval, NoCheckpoint, OrbitInterval, make_strategy
from orbit_dagster.policy.compare import simulate_trace, summarise
from orbit_dagster.policy.reclaim_rate import NoticeReliability, RateBook
from orbit_dagster.policy.simulate import JobParams, replay, replay_jobs, start_offsets, trace_mtbf_s, warm_up

from .helpers import make_trace, model

M = model()


def _gang_trace(name: str = "aws-2023-08-27_us-west-2a_v100_3node") -> Trace:
    # 3 nodes up for 60 ticks, one node lost for 10 ticks (a reclaim for the gang, not for one node), ...
    data = (3,) * 60 + (2,) * 10 + (3,) * 60 + (0,) * 10 + (3,) * 200
    # a trace of the shared data set, its name convention recorded as loading it there does
    return record_name_convention(Trace(name=name, gap_seconds=60.0, data=data, prices=None, kind="multinode"))


def test_an_n_node_trace_needs_all_n_nodes():
    t = _gang_trace()
    job = JobParams(work_s=3 * 3600, save_s=60, restore_s=120, notice_s=0, nodes=3, spot_usd_per_hour=1.0)
    gang = replay(t, FixedInterval(600), job)
    one = replay(t, FixedInterval(600), JobParams(**{**job.__dict__, "nodes": 1}))
    assert gang.reclaims == 2 and one.reclaims == 1  # losing one node of three interrupts the gang
    assert gang.cost_usd == pytest.approx(3 * gang.paid_s / 3600)  # it pays for all three
    assert trace_mtbf_s(t, 3) == pytest.approx((60 + 60 + 200) * 60 / 2)
    res = simulate_trace(t, job_hours=2, starts=2, model=M, policy="fixed-30m")
    assert res["market"]["nodes"] == 3
    assert summarise([gang], res["market"]["nodes"])["paid_gpu_hours"] == pytest.approx(3 * gang.paid_s / 3600, abs=1e-4)


def test_same_trace_same_numbers():
    t = _gang_trace()
    a = simulate_trace(t, job_hours=2, starts=3, model=M, notice_seconds=0)
    assert a == simulate_trace(t, job_hours=2, starts=3, model=M, notice_seconds=0)


def test_each_cloud_gets_its_own_notice_and_its_own_prices_by_default():
    bits = ([1] * 50 + [0] * 5) * 8
    def shared(name: str) -> Trace:
        return record_name_convention(make_trace(bits, name=name))

    aws = simulate_trace(shared("aws-2023-01-01_us-east-1a_v100_1"), job_hours=2, starts=2, model=M)
    gcp = simulate_trace(shared("gcp-2023-01-01_us-east1-b_c3-88"), job_hours=2, starts=2, model=M)
    assert (aws["notice_seconds"], gcp["notice_seconds"]) == (120.0, 30.0)
    assert gcp["market"]["spot_usd_per_hour_per_node"] == pytest.approx(0.344256)
    given = simulate_trace(shared("gcp-2023-01-01_us-east1-b_c3-88"), job_hours=2, starts=2, model=M,
                           notice_seconds=120)
    assert given["notice_seconds"] == 120 and given["assumptions"]["notice"] == "given"
    rows = {r["policy"]: r for r in gcp["results"]}
    paid = rows["notice-only"]["paid_gpu_hours"]
    assert rows["notice-only"]["cost_usd"] == pytest.approx(paid * 0.344256, rel=1e-3)


def test_every_baseline_gets_the_notice_handling():
    for name in ("notice-only", "fixed-30m", "young-daly", "orbit"):
        assert make_strategy(name, model=M, band=4, save_s=60, notice_s=120).uses_notice, name
    assert not make_strategy("none", model=M, band=4, save_s=60, notice_s=120).uses_notice
    s = make_strategy("young-daly-true", model=M, band=4, save_s=60, notice_s=120, true_mtbf_s=7200.0)
    assert s.uses_notice and s.mtbf_s == 7200.0


def test_orbit_learns_how_reliable_the_notice_is():
    base = dict(save_s=60.0, notice_s=120.0, shape=1.0)
    rate = RateBook().for_offer(Offer(offer_id="o", provider="aws", instance_type="p3.2xlarge", gpu="V100",
                                      gpu_count=1, interruption_band=">20%"))
    p = OrbitInterval(rate, **base)
    before = p.interval(0.0)
    for _ in range(200):
        p.end_session(3600.0, True, noticed=True)
    assert p.notices.miss_rate < 0.001 and p.interval(0.0) > 3 * before  # reliable notices: little insurance
    q = OrbitInterval(rate, **base, notices=NoticeReliability())
    for i in range(200):
        q.end_session(3600.0, True, noticed=(i % 5 != 0))  # 20% lost
    assert q.notices.miss_rate == pytest.approx(0.2, abs=0.01) and q.interval(0.0) < p.interval(0.0)
    # no emergency save fits the notice: every reclaim is insured against, whatever the record says
    r = OrbitInterval(rate, save_s=300.0, notice_s=120.0, shape=1.0, notices=p.notices)
    assert not r.covered and r.uncovered_share == 1.0


def test_orbit_runs_to_the_end_when_the_work_left_is_short():
    p = make_strategy("orbit", model=M, band=4, save_s=60, notice_s=0)
    tau = p.interval(3600.0)
    assert math.isfinite(tau) and p.interval(3600.0, work_left_s=tau / 2) == tau / 2


def test_the_decision_record_names_its_inputs_and_reason():
    offer = Offer(offer_id="o", provider="aws", instance_type="p3.2xlarge", gpu="V100", gpu_count=1,
                  interruption_band=">20%")
    p = OrbitInterval.for_offer(offer, save_s=10.0, notice_s=120.0, model=M, nodes=4)
    d = p.decide(age_s=600.0, work_left_s=7200.0)
    assert d["policy"] == "orbit" and "fits the 120 s notice" in d["reason"]
    assert d["inputs"]["rate"]["rate_per_hour"] == pytest.approx(4 * M.band_rate(4))  # a gang of 4
    assert d["interval_s"] == pytest.approx(p.interval(600.0, 7200.0))


def test_warm_up_records_which_past_reclaims_came_with_a_notice():
    t = make_trace(([1] * 20 + [0] * 2) * 30, gap=60)
    job = JobParams(work_s=3600, notice_s=120, notice_miss_rate=0.5, start_s=t.duration_s / 2, seed=3)
    s = make_strategy("orbit", model=M, band=4, save_s=60, notice_s=120)
    warm_up(s, t, job.start_s, 1, job)
    assert 0 < s.notices.missed < s.notices.reclaims == 15


def test_lost_notices_cost_notice_only_whole_sessions():
    t = make_trace(([1] * 120 + [0] * 3) * 20, gap=60)
    jobs = [JobParams(work_s=10 * 3600, notice_s=120, save_s=60, restore_s=60, start_s=s, notice_miss_rate=1.0)
            for s in start_offsets(t, 2)]
    blind = replay_jobs(t, lambda: NoCheckpoint(name="notice-only", uses_notice=True), jobs)
    insured = replay_jobs(t, lambda: make_strategy("orbit", model=M, band=4, save_s=60, notice_s=120), jobs, warm=True)
    assert sum(r.wasted_s for r in insured) < sum(r.wasted_s for r in blind)
    assert sum(r.overhead_s for r in insured) < sum(r.overhead_s for r in blind)
