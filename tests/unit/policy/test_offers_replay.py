"""The offers replay (`policy.offers_replay`, `orbit simulate --trace A --trace B`): dispatch's
ranking, this job's avoided offers and the price sensor's migration rule, driven on traces."""
import math

import pytest

from orbit_dagster.catalog.traces import Trace
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.checkpointing import OrbitInterval
from orbit_dagster.policy.offer_choice import AVOID_AFTER_RECLAIMS
from orbit_dagster.policy.offers_replay import TraceOffer, replay_offers
from orbit_dagster.policy.simulate import JobParams, replay, warm_up

from .helpers import model

GAP = 60.0


def offer(name: str, bits, price: float = 0.9, **meta) -> TraceOffer:
    data = tuple(int(b) for b in bits)
    trace = Trace(name=name, gap_seconds=GAP, data=data, prices=(price,) * len(data), kind="preemption",
                  metadata={"cloud": "aws", "instance_type": "p3.2xlarge", "zone": name, **meta})
    return TraceOffer.of(trace, model=model())


def test_one_offer_replays_as_the_single_trace_replay_does():
    """With one offer (no other to move to, nothing to avoid) it is `simulate.replay` of the
    warm `orbit` policy, up to what the policy learns of a session: the trace's whole up-run
    here (the zone's record), the instance's own time there."""
    bits = ([1] * 300 + [0] * 20) * 6
    only = offer("a", bits)
    job = JobParams(work_s=8 * 3600.0, save_s=60.0, restore_s=300.0, notice_s=120.0, start_s=0.0)
    mine = replay_offers([only], job, model=model())
    policy = OrbitInterval.for_offer(only.offer, save_s=60.0, notice_s=120.0, model=model())
    warm_up(policy, only.trace, 0.0, 1, job)
    theirs = replay(only.trace, policy, job)
    assert mine.finished and theirs.finished
    assert (mine.reclaims, mine.sessions, mine.emergency_checkpoints) == (theirs.reclaims, theirs.sessions,
                                                                          theirs.emergency_checkpoints)
    assert mine.overhead_s == pytest.approx(theirs.overhead_s, rel=0.05)
    assert mine.paid_s == pytest.approx(mine.useful_s + mine.checkpoint_s + mine.restart_s + mine.wasted_s
                                        + mine.in_flight_s)
    assert [d["offer"] for d in mine.extra["dispatches"]] == ["trace:a"] * mine.sessions


def test_dispatch_takes_the_cheaper_offer_and_waits_where_none_has_capacity():
    cheap = offer("cheap", [0] * 10 + [1] * 2000, price=0.5)
    dear = offer("dear", [0] * 20 + [1] * 2000, price=2.0)
    job = JobParams(work_s=3 * 3600.0, save_s=60.0, restore_s=300.0, start_s=0.0)
    r = replay_offers([dear, cheap], job, model=model())
    assert r.finished and r.extra["dispatches"] == [{"at": 10 * GAP, "offer": "trace:cheap", "first": "trace:cheap",
                                                    "avoided": []}]
    # the cheaper one down: the dearer one, rather than wait
    r = replay_offers([offer("cheap", [0] * 40 + [1] * 2000, price=0.5), dear], job, model=model())
    assert r.extra["dispatches"][0]["offer"] == "trace:dear" and r.extra["dispatches"][0]["first"] == "trace:cheap"


def test_an_offer_that_reclaimed_this_job_twice_goes_last():
    # two zones down together every 50 minutes (no capacity anywhere, so every dispatch ranks
    # both); "a" is cheaper and holds the job until this job was reclaimed there twice
    a = offer("a", ([1] * 50 + [0] * 2) * 40, price=0.5)
    b = offer("b", ([1] * 50 + [0] * 2) * 40, price=0.7)
    job = JobParams(work_s=6 * 3600.0, save_s=60.0, restore_s=300.0, start_s=0.0)
    with_rule = replay_offers([a, b], job, model=model(), migrate=False)
    picks = [(d["offer"], d["first"], d["avoided"]) for d in with_rule.extra["dispatches"]]
    assert picks[:AVOID_AFTER_RECLAIMS] == [("trace:a", "trace:a", [])] * AVOID_AFTER_RECLAIMS
    # ranked first still (cheaper, in expectation), but this job was reclaimed there twice
    assert picks[AVOID_AFTER_RECLAIMS] == ("trace:b", "trace:a", ["trace:a"])
    without = replay_offers([a, b], job, model=model(), migrate=False, avoid=False)
    assert [d["offer"] for d in without.extra["dispatches"]][:AVOID_AFTER_RECLAIMS + 1] == ["trace:a"] * 3
    assert with_rule.finished and without.finished


def test_a_rising_risk_moves_the_job_make_before_break_at_a_decision_tick():
    # "a": reclaimed at 11, 21 and 32 minutes (one reclaim in each of three 10-minute windows),
    # then up; "b" has no capacity until minute 36, then is up for good. The job starts at
    # minute 34 on "a", the only offer up; at the tick of minute 40 "a"'s risk has risen
    # three windows in a row and "b" is up: the job moves.
    a = offer("a", [1] * 11 + [0] + [1] * 9 + [0] + [1] * 10 + [0] * 2 + [1] * 2000, price=0.5)
    b = offer("b", [0] * 36 + [1] * 2000, price=0.5)
    job = JobParams(work_s=10 * 3600.0, save_s=60.0, restore_s=300.0, start_s=34 * GAP)
    r = replay_offers([a, b], job, model=model())
    assert r.extra["dispatches"][0]["offer"] == "trace:a"
    assert r.extra["moves"] == [{"at": 40 * GAP, "from": "trace:a", "to": "trace:b"}]
    assert r.emergency_checkpoints == 1 and r.reclaims == 0 and r.finished and r.sessions == 2
    # the emergency save ended the first instance: nothing lost, the save paid on it
    assert r.wasted_s == 0
    stay = replay_offers([a, b], job, model=model(), migrate=False)
    assert stay.extra["moves"] == [] and stay.sessions == 1


def test_offers_of_different_shapes_are_refused():
    v100 = offer("a", [1] * 100)
    k80 = offer("b", [1] * 100, instance_type="p2.xlarge")
    with pytest.raises(OrbitError) as err:
        replay_offers([v100, k80], JobParams(work_s=3600.0), model=model())
    assert err.value.field == "traces"
    with pytest.raises(OrbitError):
        replay_offers([], JobParams(work_s=3600.0), model=model())


def test_the_same_inputs_give_the_same_numbers():
    a = offer("a", ([1] * 70 + [0] * 3) * 30, price=0.5)
    b = offer("b", ([1] * 45 + [0] * 9) * 40, price=0.6)
    job = JobParams(work_s=12 * 3600.0, save_s=30.0, restore_s=300.0, notice_miss_rate=0.3, seed=3)
    one, two = replay_offers([a, b], job, model=model()), replay_offers([a, b], job, model=model())
    assert one.as_dict() == two.as_dict() and math.isfinite(one.cost_usd)
