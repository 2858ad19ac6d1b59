from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_dagster.policy.checkpointing import FixedInterval, make_strategy
from orbit_dagster.policy.simulate import JobParams, hindsight, replay, replay_jobs, start_offsets, warm_up

from .helpers import expand, make_trace, model, runs

M = model()
NAMES = ["none", "notice-only", "fixed-30m", "young-daly", "orbit"]


def _strategy(name, job):
    return make_strategy(name, model=M, band=4, save_s=job.save_s, notice_s=job.notice_s)


def _identity(r):
    return r.useful_s + r.checkpoint_s + r.restart_s + r.wasted_s + r.in_flight_s


@settings(max_examples=80, deadline=None)
@given(runs, st.sampled_from(NAMES), st.sampled_from([0.0, 30.0, 120.0]), st.floats(min_value=600, max_value=4 * 3600),
       st.floats(min_value=0, max_value=3000))
def test_every_paid_second_is_accounted_for(rs, name, notice, work, start):
    t = make_trace(expand(rs) + [1], gap=120)  # at least one available tick
    job = JobParams(work_s=work, notice_s=notice, start_s=start, save_s=60, restore_s=120)
    r = replay(t, _strategy(name, job), job)
    assert r.paid_s == pytest.approx(_identity(r), abs=1e-6)
    assert min(r.useful_s, r.checkpoint_s, r.restart_s, r.wasted_s, r.in_flight_s) >= 0
    assert r.cost_usd == pytest.approx(r.paid_s / 3600 * job.spot_usd_per_hour)
    dollars = r.useful_usd + r.checkpoint_usd + r.restart_usd + r.wasted_usd + r.in_flight_usd
    assert r.cost_usd == pytest.approx(dollars, abs=1e-6)
    assert r.overhead_s == pytest.approx(r.checkpoint_s + r.restart_s + r.wasted_s + r.in_flight_s, abs=1e-6)
    if r.finished:
        assert r.useful_s == pytest.approx(work) and r.in_flight_s == 0
    again = replay(t, _strategy(name, job), job)
    assert again == r  # deterministic


@settings(max_examples=80, deadline=None)
@given(runs, st.floats(min_value=600, max_value=4 * 3600), st.floats(min_value=1, max_value=80))
def test_an_emergency_checkpoint_that_fits_the_notice_loses_nothing(rs, work, save):
    t = make_trace(expand(rs) + [1], gap=120)
    job = JobParams(work_s=work, notice_s=save * 1.5, save_s=save, restore_s=120)
    r = replay(t, _strategy("orbit", job), job)
    assert r.wasted_s == 0
    assert r.emergency_checkpoints <= r.reclaims


@settings(max_examples=60, deadline=None)
@given(runs, st.floats(min_value=300, max_value=7200))
def test_periodic_checkpoints_bound_the_loss_per_reclaim(rs, tau):
    t = make_trace(expand(rs) + [1], gap=120)
    job = JobParams(work_s=6 * 3600, notice_s=0, save_s=60, restore_s=120)
    r = replay(t, FixedInterval(tau), job)
    assert r.wasted_s <= r.reclaims * (tau + job.save_s) + 1e-6


def test_no_checkpoint_loses_all_work_at_every_reclaim():
    t = make_trace([1] * 30 + [0] * 5 + [1] * 200, gap=60)  # one reclaim after 30 min
    job = JobParams(work_s=3600, notice_s=0, save_s=60, restore_s=120)
    r = replay(t, make_strategy("none", model=M, band=4, save_s=60, notice_s=0), job)
    assert r.finished and r.reclaims == 1
    assert r.wasted_s == pytest.approx(30 * 60 - 120)  # the whole first session after its restore


def test_hindsight_beats_every_interval_of_its_grid():
    from orbit_dagster.catalog.reclaim_model import generate_trace
    t = generate_trace(M, 5, 3 * 86400, 60)
    jobs = [JobParams(work_s=4 * 3600, notice_s=0, start_s=s) for s in start_offsets(t, 3)]
    grid = (300.0, 900.0, 1800.0, 3600.0)
    tau, best = hindsight(t, jobs, uses_notice=False, grid=grid)
    assert tau in grid
    for g in grid:
        rs = replay_jobs(t, lambda: FixedInterval(g), jobs)
        assert sum(r.paid_s for r in best) <= sum(r.paid_s for r in rs) + 1e-6


def test_orbit_warm_up_sees_only_the_past():
    t = make_trace([1, 0] * 50 + [1] * 100, gap=60)
    s = make_strategy("orbit", model=M, band=4, save_s=60, notice_s=0)
    warm_up(s, t, 0.0)
    assert s.estimator.reclaims == 0 and s.estimator.exposure_s == 0
    warm_up(s, t, 600.0)  # edges at 60, 180, ..., 540 s: five reclaims, 300 s of up-time
    assert s.estimator.reclaims == 5 and s.estimator.exposure_s == pytest.approx(300)


def test_the_cyclic_replay_invents_no_reclaim_where_the_trace_ends_up_and_starts_down():
    """Up for the trace's last 3 hours, down for its first 2: a job that runs past the end goes
    on at the trace's first up tick, unreclaimed, and pays the prices of the ticks it runs on."""
    t = make_trace([0, 0, 1, 1, 1], gap=3600, prices=[5.0, 5.0, 1.0, 2.0, 3.0])
    job = JobParams(work_s=4 * 3600 - 1, notice_s=120, start_s=2 * 3600, save_s=0, restore_s=0,
                    spot_usd_per_hour=9.0)
    r = replay(t, FixedInterval(10**6), job)
    assert r.finished and r.reclaims == 0 and r.sessions == 1
    assert r.cost_usd == pytest.approx(1.0 + 2.0 + 3.0 + 1.0 * (3600 - 1) / 3600)  # ticks 2, 3, 4, then 2 again
