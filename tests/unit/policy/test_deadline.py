from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.deadline import (
    OD, SPOT, DeadlineSetup, Greedy, UniformProgress, coarsen, loss_ticks_for, run_deadline, setup_from_trace,
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
