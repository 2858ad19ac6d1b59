"""Price and reclaim-rate forecasts (policy/forecast.py) on series whose answer is known."""
import math
import random

import pytest

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.forecast import (
    MIN_RECLAIMS,
    NaiveState,
    SeasonalEW,
    SeasonalRate,
    TrailingRate,
    choose_rate,
    fit_price_model,
    fit_rate_model,
    naive_errors,
    phase_of,
    rate_bins,
    rate_errors,
    step_series,
)


def test_a_step_function_of_change_points_read_on_a_grid():
    points = [(100.0, 2.0), (250.0, 3.0), (400.0, None), (500.0, 1.0)]
    assert step_series(points, start_s=0.0, step_s=100.0, count=7) == [None, 2.0, 2.0, 3.0, None, 1.0, 1.0]
    assert phase_of(3 * 3600.0 + 5, 3600.0, 24) == 3 and phase_of(25 * 3600.0, 3600.0, 24) == 1


def test_the_level_moves_by_alpha_of_each_error_and_alpha_one_is_the_last_value():
    assert SeasonalEW(0.5, 0.0, 1).forecast([1.0, 3.0], 2) == [2.0, 2.0]
    assert SeasonalEW(0.5, 0.0, 1).forecast([1.0, 3.0, 3.0], 1) == [2.5]
    series = [5.0, 7.0, None, 4.0, 9.0]
    assert SeasonalEW(1.0, 0.0, 3).forecast(series, 3) == [9.0, 9.0, 9.0]
    assert NaiveState("last").read(1.0).read(None).forecast(2) == [1.0, 1.0]
    assert NaiveState("mean").read(1.0).read(3.0).forecast(1) == [2.0]
    assert SeasonalEW(0.3, 0.2, 4).forecast([None, None], 2) == [None, None]
    with pytest.raises(OrbitError, match="alpha must be in"):
        SeasonalEW(1.5)


def test_a_seasonal_price_is_forecast_from_its_season_and_beats_the_naive_baselines():
    pattern = [1.0, 2.0, 4.0, 2.0]
    series = [10.0 + pattern[k % 4] for k in range(200)]
    model = SeasonalEW(0.1, 0.3, 4)
    got = model.forecast(series, 4)  # the next steps are phases 0..3 again
    assert got == pytest.approx([10.0 + p for p in pattern], abs=0.05)
    errors = model.rolling_errors(series, horizon=4, start=100)
    for kind in ("last", "mean"):
        assert sum(errors) / len(errors) < 0.1 * (sum(e := naive_errors(kind, series, horizon=4, start=100)) / len(e))


def test_the_season_follows_the_clock_not_the_series_start():
    pattern = [0.0, 0.0, 3.0]
    series = [pattern[(k + 1) % 3] for k in range(90)]  # this series starts at phase 1
    assert SeasonalEW(0.05, 0.5, 3).forecast(series, 3, phase0=1) == pytest.approx([0.0, 3.0, 0.0], abs=0.1)


def test_fitting_finds_the_season_where_there_is_one_and_the_last_value_on_a_random_walk():
    pattern = [1.0, 2.0, 4.0, 2.0]
    rng = random.Random(7)
    seasonal = [10.0 + pattern[k % 4] + rng.gauss(0, 0.05) for k in range(160)]
    model, _ = fit_price_model([(seasonal, 0)], horizon=2, period=4, start=40)
    assert model.gamma > 0
    walk, x = [], 10.0
    for _ in range(300):
        x += rng.gauss(0, 1.0)
        walk.append(x)
    model, mae = fit_price_model([(walk, 0)], horizon=1, period=4, start=50)
    assert model.alpha == 1.0 and model.gamma == 0.0
    last = naive_errors("last", walk, horizon=1, start=50)
    assert mae == pytest.approx(sum(last) / len(last))


def test_sessions_become_exposure_and_reclaims_per_step():
    exposure, reclaims = rate_bins([(0.0, 5400.0, True), (7200.0, 9000.0, False), (9000.0, 20000.0, True)],
                                   start_s=0.0, step_s=3600.0, count=4)
    assert exposure == pytest.approx([1.0, 0.5, 1.0, 0.5 + 0.5])
    assert reclaims == [0, 1, 0, 0]  # the last reclaim lies after the window


def test_the_rate_is_the_gamma_poisson_posterior_and_follows_recent_evidence_when_it_decays():
    exposure = [1.0] * 100
    reclaims = [0] * 50 + [1] * 50  # the zone got worse half way through
    still = SeasonalRate(0.0, math.inf, 1, prior_reclaims=1.0, prior_hours=2.0)
    assert still.forecast(exposure, reclaims, 1) == [pytest.approx((50 + 1.0) / (100 + 2.0))]
    moving = SeasonalRate(0.1, math.inf, 1, prior_reclaims=1.0, prior_hours=2.0)
    n, e = sum(0.9 ** k for k in range(50)), sum(0.9 ** k for k in range(100))  # discounted evidence
    assert moving.forecast(exposure, reclaims, 1) == [pytest.approx((n + 1.0) / (e + 2.0))]
    assert TrailingRate(None, 1.0, 2.0).read(1.0, 1).read(1.0, 0).forecast(1) == [pytest.approx(2 / 4)]
    assert TrailingRate(1, 0.0, 1.0).read(1.0, 1).read(1.0, 0).forecast(1) == [0.0]
    model, _ = fit_rate_model([(exposure, reclaims, 0)], horizon=5, period=1, start=20, prior_rate_per_hour=0.5,
                              prior_strength=1.0)
    assert model.alpha > 0
    fitted = model.rolling_errors(exposure, reclaims, horizon=5, start=20)
    mean = rate_errors(lambda: TrailingRate(None, model.prior_reclaims, model.prior_hours), exposure, reclaims,
                       horizon=5, start=20)
    assert sum(fitted) < sum(mean)


def test_a_seasonal_reclaim_pattern_raises_its_phases_forecast():
    exposure = [1.0] * 240
    reclaims = [1 if k % 24 == 18 else 0 for k in range(240)]  # every day at 18:00
    model = SeasonalRate(0.0, 5.0, 24, prior_reclaims=0.1, prior_hours=1.0)
    rates = model.forecast(exposure, reclaims, 24)
    assert rates[18] > 10 * rates[3]
    assert sum(rates) / 24 == pytest.approx((10 + 0.1) / (240 + 1.0), rel=0.15)


# The rate gate's question: an hour of up-time per step, the offer's prior 0.05 reclaims an hour.
GATE = dict(horizon=6, prior_rate_per_hour=0.05, prior_strength=1.0)


def test_no_reclaim_held_back_is_no_evidence_for_a_rate_forecast():
    # Reclaims every third hour for 4 days, then none for 6: held back (the last 24 h) there is
    # none, so a decayed forecast near 0 beats the cumulative rate by default...
    exposure = [1.0] * 240
    reclaims = [1 if k % 3 == 0 and k < 4 * 24 else 0 for k in range(240)]
    unguarded = choose_rate(exposure, reclaims, min_reclaims=0, **GATE)
    assert unguarded.used and unguarded.forecast_error < unguarded.baseline_error
    # ...which the minimum-evidence rule does not count as earned: the cumulative rate stays, unfitted.
    kept = choose_rate(exposure, reclaims, **GATE)
    assert kept.source == "baseline" and kept.forecast_error is None and kept.value is None
    assert kept.why == (f"too few reclaims to judge a rate forecast: 0 in the 24 held-back steps and 32 before "
                        f"them, under {MIN_RECLAIMS} in each")
    # Reclaims held back but none before them: nothing to fit a pattern on either.
    late = [1 if 10 <= k % 24 < 22 and k >= 216 else 0 for k in range(240)]
    assert "12 in the 24 held-back steps and 0 before them" in choose_rate(exposure, late, **GATE).why


def test_a_rate_forecast_is_judged_from_min_reclaims_on_each_side():
    # A daily season of reclaims (every hour from 10:00 to 22:00): 12 held back, 108 before.
    exposure = [1.0] * 240
    reclaims = [1 if 10 <= k % 24 < 22 else 0 for k in range(240)]
    assert MIN_RECLAIMS <= 12
    judged = choose_rate(exposure, reclaims, **GATE)
    assert judged.used and judged.forecast_error < judged.baseline_error
    assert choose_rate(exposure, reclaims, min_reclaims=12, **GATE) == judged  # exactly enough held back
    short = choose_rate(exposure, reclaims, min_reclaims=13, **GATE)
    assert short.source == "baseline" and "12 in the 24 held-back steps and 108 before them" in short.why
