from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.deadline import (
    OD,
    SPOT,
    DeadlineSetup,
    Greedy,
    UniformProgress,
    coarsen,
    loss_ticks_for,
    run_deadline,
    setup_from_trace,
)
from orbit_dagster.policy.deadline_plan import OrbitDeadline, optimal

from .helpers import expand, make_trace, model, runs

M = model()


def _setup(bits, work, deadline, c, r, spot=1.0, od=3.0, history=()):
    avail = tuple(bool(b) for b in bits) + (False,) * max(0, deadline + r + 2 - len(bits))
    return DeadlineSetup(avail=avail, spot_cost=(spot,) * len(avail), od_cost=od, work_ticks=work,
                         deadline_ticks=deadline, changeover_ticks=c, loss_ticks=r, gap_s=195.0,
                         history=tuple(bool(b) for b in history))


POLICIES = [Greedy, UniformProgress, lambda: OrbitDeadline(M, replan_s=195.0 * 5)]


@settings(max_examples=60, deadline=None)
@given(runs, st.integers(1, 25), st.integers(0, 40), st.integers(0, 2), st.integers(1, 2), runs)
def test_a_feasible_deadline_is_never_missed_and_optimal_is_a_floor(rs, work, slack, c, r, hist):
    s = _setup(expand(rs), work, work + c + slack, c, r, history=expand(hist))
    assert s.feasible
    best = optimal(s)
    assert not best.missed
    assert best.cost_usd == pytest.approx(best.extra["dp_cost_usd"])  # the DP and the replay agree
    for make in POLICIES:
        res = run_deadline(s, make())
        assert res.finished and not res.missed, res.actions
        assert best.cost_usd <= res.cost_usd + 1e-9


@settings(max_examples=30, deadline=None)
@given(runs, st.integers(5, 25), st.integers(1, 2))
def test_an_infeasible_deadline_is_reported_missed(rs, work, c):
    s = _setup(expand(rs), work, work + c - 1, c, 1)
    assert not s.feasible
    for make in POLICIES:
        res = run_deadline(s, make())
        assert res.missed and res.finished  # best effort: on-demand, finished late
    assert optimal(s).missed


def test_on_demand_only_when_there_is_no_spot():
    s = _setup([0] * 50, 10, 20, 1, 1)
    for make in POLICIES:
        res = run_deadline(s, make())
        assert res.spot_ticks == 0 and not res.missed
    # waiting is free, so greedy and orbit start on-demand once, as late as is safe
    for make in (Greedy, POLICIES[2]):
        res = run_deadline(s, make())
        assert res.cost_usd == pytest.approx((10 + 1) * 3.0) and res.changeovers == 1


def test_all_spot_when_spot_never_fails():
    s = _setup([1] * 60, 10, 40, 1, 1)
    for make in POLICIES + [lambda: _Opt()]:
        res = run_deadline(s, make(), enforce_safety=False) if isinstance(make(), _Opt) else run_deadline(s, make())
        assert res.od_ticks == 0 and res.cost_usd == pytest.approx(11 * 1.0)


class _Opt:
    name = "opt"

    def decide(self, obs):
        return SPOT if obs.available else OD


def test_a_policy_that_breaks_the_safety_rule_is_stopped():
    class Reckless:
        name = "reckless"

        def decide(self, obs):
            return SPOT if obs.available else "N"

    s = _setup([1, 0] * 40, 10, 12, 1, 1)
    with pytest.raises(OrbitError, match="safe set"):
        run_deadline(s, Reckless())


def test_spot_tick_before_a_reclaim_makes_no_progress():
    s = _setup([1, 1, 1, 0, 0], 2, 5, 0, 1)
    assert s.spot_productive()[:4] == [True, True, False, False]


def test_loss_ticks():
    assert loss_ticks_for(195, notice_s=120, save_s=60, emergency_save_s=None, mtbf_s=7200) == 1
    no_notice = loss_ticks_for(195, notice_s=0, save_s=60, emergency_save_s=None, mtbf_s=7200)
    assert no_notice > 1  # a periodic interval's worth


def test_fine_traces_are_coarsened():
    avail, cost = coarsen([1, 1, 1, 0, 1, 1], [1, 1, 1, 3, 1, 1], 3, 1)
    assert avail == [True, False] and cost == [1, 5 / 3]
    t = make_trace([1] * 600, gap=32, prices=[0.9] * 600)
    s = setup_from_trace(t, start_tick=60, work_s=3600, deadline_s=7200, changeover_s=300, notice_s=120,
                         save_s=60, emergency_save_s=None, mtbf_s=7200, spot_usd_per_hour=0.9, od_usd_per_hour=3.0)
    assert s.gap_s == 192 and s.work_ticks == 19 and s.deadline_ticks == 37 and s.changeover_ticks == 2
    assert len(s.history) == 10 and s.spot_cost[0] == pytest.approx(0.9 * 192 / 3600)


# ---------------------------------------------------------------- the control plane's door: spot_or_on_demand

def _door(**kw):
    from orbit_dagster.policy.deadline_plan import spot_or_on_demand
    args = dict(work_left_s=10 * 3600, time_left_s=16 * 3600, spot_available=True, spot_usd_per_hour=0.9,
                on_demand_usd_per_hour=3.06, restore_s=300, save_s=60, notice_s=120, mtbf_s=7200, model=M)
    args.update(kw)
    return spot_or_on_demand(**args)


def test_the_door_takes_the_replays_first_decision():
    """One policy, two drivers: on the same state, spot_or_on_demand answers what OrbitDeadline does."""
    from orbit_dagster.policy.deadline import setup_from_ticks
    from orbit_dagster.policy.deadline_plan import ACTION_NAMES, MarkovAvailability
    gap = 180.0
    for avail0, work_h, deadline_h in ((True, 10, 16), (False, 10, 16), (False, 10, 30), (True, 10, 10.3)):
        s = setup_from_ticks([avail0] + [True] * 400, [0.9] * 401, gap_s=gap, od_usd_per_hour=3.06,
                             work_s=work_h * 3600, deadline_s=deadline_h * 3600, changeover_s=300,
                             loss_ticks=loss_ticks_for(gap, notice_s=120, save_s=60, emergency_save_s=None, mtbf_s=7200))
        first = run_deadline(s, OrbitDeadline(M)).actions[0]
        est = MarkovAvailability.from_model(M, gap)
        est.observe([avail0])
        d = _door(work_left_s=work_h * 3600, time_left_s=deadline_h * 3600, spot_available=avail0, availability=est)
        assert d.action == ACTION_NAMES[first], (avail0, work_h, deadline_h, d)
        assert d.reason and d.inputs["tick_s"] == gap


def test_the_door_is_safe_and_says_why():
    assert _door(spot_available=False, time_left_s=40 * 3600).action == "wait"  # plenty of slack, no spot
    tight = _door(time_left_s=10 * 3600 + 300 + 100)  # less than one tick of slack
    assert tight.action == "on_demand" and "safety rule" in tight.reason
    late = _door(time_left_s=5 * 3600)
    assert late.action == "on_demand" and "can no longer meet" in late.reason
    assert _door(work_left_s=0).action == "wait"
    with pytest.raises(OrbitError) as err:
        _door(holding="gpu")
    assert err.value.field == "holding"
    with pytest.raises(OrbitError) as err:
        _door(work_left_s=-1)
    assert err.value.field == "work_left_s"


def test_deadline_setups_price_the_whole_gang():
    t = make_trace([3, 3, 2, 3] * 60, gap=200)
    t = t.__class__(name=t.name, gap_seconds=t.gap_seconds, data=t.data, prices=None, kind="multinode")
    one = setup_from_trace(t, start_tick=0, work_s=3600, deadline_s=7200, changeover_s=200, notice_s=120, save_s=60,
                           emergency_save_s=None, mtbf_s=3600, spot_usd_per_hour=1.0, od_usd_per_hour=3.0)
    gang = setup_from_trace(t, start_tick=0, work_s=3600, deadline_s=7200, changeover_s=200, notice_s=120, save_s=60,
                            emergency_save_s=None, mtbf_s=3600, spot_usd_per_hour=1.0, od_usd_per_hour=3.0, nodes=3)
    assert gang.od_cost == pytest.approx(3 * one.od_cost) and gang.spot_cost[0] == pytest.approx(3 * one.spot_cost[0])
    assert all(one.avail) and not all(gang.avail)  # a tick with 2 of 3 nodes has no spot for the gang


def test_the_availability_the_control_plane_feeds_the_planner_learns_from_its_reclaims():
    """control/deadline.choose's estimate: the prior, moved by the fleet's up-time and reclaims."""
    from orbit_dagster.catalog.reclaim_model import load_reclaim_model
    from orbit_dagster.policy.deadline_plan import MarkovAvailability

    m = load_reclaim_model()
    prior = MarkovAvailability.from_model(m, 180.0)
    calm = MarkovAvailability.from_exposure(m, 180.0, reclaims=0, exposure_s=100 * 3600.0)
    stormy = MarkovAvailability.from_exposure(m, 180.0, reclaims=50, exposure_s=10 * 3600.0)
    assert calm.q10 < prior.q10 < stormy.q10
    assert calm.q01 == prior.q01 == stormy.q01  # down-time is not in the record: the prior's
    same = MarkovAvailability.from_model(m, 180.0)
    same.observe([True] * 200 + [False])  # the trace feed's way: 200 up ticks, one reclaim
    assert MarkovAvailability.from_exposure(m, 180.0, reclaims=1, exposure_s=200 * 180.0).q10 == same.q10


def test_a_window_past_the_trace_end_goes_on_where_the_trace_is_up():
    """The window wraps as the cyclic replay does: from the trace's first up tick, not its start."""
    t = make_trace([0] * 10 + [1] * 20 + [0] * 3 + [1] * 10, gap=300)  # ends up, starts down (50 min)
    s = setup_from_trace(t, start_tick=33, work_s=3600, deadline_s=4 * 3600, changeover_s=300, notice_s=120,
                         save_s=60, emergency_save_s=None, mtbf_s=7200, spot_usd_per_hour=0.9, od_usd_per_hour=3.0)
    # 10 up ticks to the end, then 20 up (ticks 10-29), 3 down, ...: never the 10 leading down ticks
    assert s.avail[:30] == (True,) * 30 and s.avail[30:33] == (False,) * 3 and s.avail[33:43] == (True,) * 10
