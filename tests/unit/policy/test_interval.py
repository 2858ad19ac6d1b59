from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.interval import (
    EMERGENCY_MARGIN,
    age_aware_interval,
    checkpoint_interval,
    daly_interval,
    emergency_covered,
)


def young_interval(mtbf_s: float, save_s: float) -> float:
    """Young's (1974) first-order optimum sqrt(2 * save * MTBF): the reference Daly's refines."""
    return math.sqrt(2.0 * save_s * mtbf_s)


mtbf = st.floats(min_value=1.0, max_value=1e7, allow_nan=False)
save = st.floats(min_value=0.0, max_value=3600.0, allow_nan=False)
notice = st.sampled_from([0.0, 30.0, 120.0, 600.0])


@settings(max_examples=200)
@given(mtbf, mtbf, save, notice)
def test_interval_shrinks_as_reclaims_get_more_frequent(m1, m2, s, n):
    lo, hi = sorted((m1, m2))
    assert checkpoint_interval(lo, s, notice_s=n) <= checkpoint_interval(hi, s, notice_s=n) + 1e-9


@settings(max_examples=200)
@given(mtbf, save, notice, st.floats(min_value=0, max_value=600), st.floats(min_value=600, max_value=86400))
def test_interval_is_never_negative_and_within_bounds(m, s, n, lo, hi):
    tau = checkpoint_interval(m, s, notice_s=n, min_s=lo, max_s=hi)
    assert 0 <= lo <= tau <= hi


@settings(max_examples=100)
@given(mtbf, st.floats(min_value=1.0, max_value=300.0))
def test_a_notice_that_covers_the_emergency_save_never_shortens_the_interval(m, s):
    covered = s * (1 + EMERGENCY_MARGIN)
    assert emergency_covered(covered, s) and not emergency_covered(covered * 0.99, s)
    assert checkpoint_interval(m, s, notice_s=covered) >= checkpoint_interval(m, s, notice_s=0.0)


@settings(max_examples=100)
@given(st.floats(min_value=3600, max_value=1e6), st.floats(min_value=1, max_value=30))
def test_daly_is_close_to_young_when_saves_are_cheap(m, s):
    assert daly_interval(m, s) == pytest.approx(young_interval(m, s), rel=0.05)


@settings(max_examples=100)
@given(mtbf, mtbf, save)
def test_daly_is_increasing_in_mtbf(m1, m2, s):
    lo, hi = sorted((m1, m2))
    assert daly_interval(lo, s) <= daly_interval(hi, s) + 1e-9


def test_known_values():
    assert checkpoint_interval(7200, 60) == pytest.approx(daly_interval(7200, 60))
    assert daly_interval(math.inf, 60) == math.inf
    assert checkpoint_interval(math.inf, 60, max_s=5000) == 5000


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=0, max_value=1e5), st.floats(min_value=600, max_value=1e5), st.floats(min_value=1, max_value=300))
def test_memoryless_age_aware_interval_is_youngs(age, m, s):
    assume(young_interval(m, s) > 60)
    assert age_aware_interval(age, m, s, shape=1.0, max_s=1e9) == pytest.approx(young_interval(m, s), rel=0.01)


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=0, max_value=3e4), st.floats(min_value=0, max_value=3e4),
       st.floats(min_value=1800, max_value=1e5), st.floats(min_value=0.3, max_value=0.95))
def test_heavy_tailed_lifetimes_checkpoint_young_instances_more_often(a1, a2, m, k):
    lo, hi = sorted((a1, a2))
    assert age_aware_interval(lo, m, 60, shape=k) <= age_aware_interval(hi, m, 60, shape=k) + 1.0


@pytest.mark.parametrize("kw, field", [
    ({"mtbf_s": 0, "save_s": 1}, "mtbf_s"),
    ({"mtbf_s": 10, "save_s": -1}, "save_s"),
    ({"mtbf_s": 10, "save_s": 1, "notice_s": -5}, "notice_s"),
    ({"mtbf_s": 10, "save_s": 1, "min_s": 100, "max_s": 10}, "max_s"),
    ({"mtbf_s": float("nan"), "save_s": 1}, "mtbf_s"),
])
def test_bad_input_names_the_field(kw, field):
    with pytest.raises(OrbitError) as err:
        checkpoint_interval(**kw)
    assert err.value.field == field


@settings(max_examples=100)
@given(st.floats(min_value=600, max_value=1e6), st.floats(min_value=1, max_value=600),
       st.floats(min_value=0, max_value=1e5), st.floats(min_value=0.3, max_value=1.5),
       st.floats(min_value=1e-4, max_value=1.0))
def test_insuring_against_fewer_reclaims_never_shortens_the_interval(m, s, age, shape, u):
    full = age_aware_interval(age, m, s, shape=shape, min_s=1.0, max_s=math.inf)
    part = age_aware_interval(age, m, s, shape=shape, min_s=1.0, max_s=math.inf, uncovered=u)
    assert part >= full - 1.0
    assert age_aware_interval(age, m, s, shape=shape, max_s=7200.0, uncovered=0.0) == 7200.0


def test_memoryless_full_insurance_is_young():
    assert age_aware_interval(5000.0, 7200.0, 60.0, shape=1.0, min_s=1.0, max_s=1e9) == pytest.approx(
        young_interval(7200.0, 60.0), abs=1.0)
    assert age_aware_interval(5000.0, 7200.0, 60.0, shape=1.0, min_s=1.0, max_s=1e9, uncovered=0.25) == pytest.approx(
        young_interval(4 * 7200.0, 60.0), abs=1.0)
