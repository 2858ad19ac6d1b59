from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.migration import MAKE_BEFORE_BREAK, risk_rising, should_migrate

CUR = Offer(offer_id="cur", provider="sim", instance_type="x", gpu="V100", gpu_count=1, usd_per_gpu_second_spot=1 / 3600)
TGT = Offer(offer_id="tgt", provider="sim", instance_type="x", gpu="V100", gpu_count=1, usd_per_gpu_second_spot=1.1 / 3600)
RISING = [0.2, 0.5, 1.0, 2.0]


def test_risk_rising_needs_three_consecutive_rises():
    assert risk_rising([0.1, 0.2, 0.3, 0.4])
    assert not risk_rising([0.2, 0.3, 0.4])  # only two rises
    assert not risk_rising([0.1, 0.2, 0.2, 0.4])  # a flat window breaks the run
    assert risk_rising([5, 0.1, 0.2, 0.3, 0.4])


@settings(max_examples=100)
@given(st.lists(st.floats(min_value=0, max_value=10), min_size=0, max_size=8))
def test_no_migration_unless_risk_rose_three_windows(hist):
    d = should_migrate(hist, remaining_work_s=1e6, current=CUR, target=TGT, target_rate_per_hour=0.01, notice_s=0)
    if d.migrate:
        assert risk_rising(hist)


def test_long_remaining_work_on_a_rising_offer_moves_make_before_break():
    d = should_migrate(RISING, remaining_work_s=20 * 3600, current=CUR, target=TGT, target_rate_per_hour=0.1, notice_s=0)
    assert d.migrate and d.steps == MAKE_BEFORE_BREAK
    assert d.steps.index("provision_replacement") < d.steps.index("checkpoint") < d.steps.index("switch") < d.steps.index("release_old")
    rec = d.as_record()
    assert rec["inputs"]["stay_usd"] > rec["inputs"]["move_usd"] + rec["inputs"]["finish_on_target_usd"]


def test_short_remaining_work_stays():
    d = should_migrate(RISING, remaining_work_s=600, current=CUR, target=TGT, target_rate_per_hour=0.1, notice_s=0)
    assert not d.migrate and "too short" in d.reason


def test_budget_blocks_a_move():
    d = should_migrate(RISING, remaining_work_s=20 * 3600, current=CUR, target=TGT, target_rate_per_hour=0.1,
                       notice_s=0, budget_left_usd=5.0)
    assert not d.migrate and "budget" in d.reason


@settings(max_examples=60)
@given(st.floats(min_value=60, max_value=1e6), st.floats(min_value=60, max_value=1e6))
def test_more_remaining_work_never_turns_a_move_into_a_stay(w1, w2):
    lo, hi = sorted((w1, w2))
    kw = dict(current=CUR, target=TGT, target_rate_per_hour=0.1, notice_s=0)
    if should_migrate(RISING, remaining_work_s=lo, **kw).migrate:
        assert should_migrate(RISING, remaining_work_s=hi, **kw).migrate


def test_bad_inputs():
    with pytest.raises(OrbitError) as err:
        should_migrate([0.1, -1], remaining_work_s=1, current=CUR, target=TGT, target_rate_per_hour=0.1)
    assert err.value.field == "risk_history"
    with pytest.raises(OrbitError) as err:
        should_migrate(RISING, remaining_work_s=-1, current=CUR, target=TGT, target_rate_per_hour=0.1)
    assert err.value.field == "remaining_work_s"


def test_a_rebalance_recommendation_is_the_trigger_and_the_work_left_decides():
    """`checkpoint.on_rebalance: migrate`: no three rising windows needed; the same costs decide,
    so a long job moves and a job near its end stays with its early checkpoint."""
    from orbit_dagster.policy.migration import decide_on_rebalance, rebalance_rate

    cur, other = CUR, TGT
    now = 1_000_000.0
    # The fleet saw the offer reclaim often; the recommendation counts as one more reclaim.
    lost = [now - 3600 + 10 * i for i in range(100)]
    spans = [(t - 10, t) for t in lost]
    rate = rebalance_rate(cur, lost, spans, now=now)
    assert rate > rebalance_rate(cur, lost[:-1], spans[:-1], now=now) > 0
    with pytest.raises(OrbitError) as err:
        should_migrate([rate], remaining_work_s=1, current=CUR, target=TGT, target_rate_per_hour=0.1, trigger="price")
    assert err.value.field == "trigger"
    kw = dict(current=cur, ranked=[cur, other], save_s=1.0, restore_s=10.0, notice_s=120.0)
    target, long = decide_on_rebalance(rate, remaining_work_s=3600, **kw)
    assert target.offer_id == "tgt" and long.migrate and long.inputs["trigger"] == "rebalance"
    assert "rebalancing" in long.reason
    _, short = decide_on_rebalance(rate, remaining_work_s=60, **kw)
    assert not short.migrate and "too short" in short.reason
    assert decide_on_rebalance(rate, remaining_work_s=60, **{**kw, "ranked": [cur]}) is None
