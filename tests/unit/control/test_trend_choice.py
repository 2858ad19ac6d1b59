"""Offer choice and the deadline planner use an offer's price / reclaim-rate forecast only where it beat
the naive figure (last price; cumulative rate over the offer's prior) on the offer's own held-back history,
and their decision rows say which they used and both errors; the per-offer fit is kept while the offer's
history is unchanged."""
from __future__ import annotations

import functools
import json
import random
from types import SimpleNamespace

import pytest

from orbit_dagster.control import placement, trends
from orbit_dagster.control.deadline import choose
from orbit_dagster.control.placement import rank_for
from orbit_dagster.control.trends import HORIZON, MAX_HORIZON, trend_choices
from orbit_dagster.core.execution import ExecutionRequest
from orbit_dagster.policy import forecast
from orbit_dagster.settings import Settings
from tests.cost_ledger import T0, History, offer

HOUR = 3600.0
DAYS = 10
# The same A10G shape in two zones; the listed price is what the provider quotes now.
SEASONAL = offer("aws:g5.xlarge:use1-az1", usd_per_gpu_hour=1.0, gpu="A10G", instance_type="g5.xlarge")
FLAT = offer("aws:g5.xlarge:use1-az2", usd_per_gpu_hour=0.55, gpu="A10G", instance_type="g5.xlarge")


class Listing:
    """A provider that lists fixed offers (no market clock: time scale 1)."""

    def __init__(self, offers):
        self.offers = offers

    def list_offers(self, resources):
        return list(self.offers)


def dear(h: int) -> bool:
    """Hour `h` after T0 falls between 10:00 and 23:00 UTC (the last hour recorded, DAYS * 24, is 22:00)."""
    return 10 <= ((T0 + h * HOUR) // HOUR) % 24 < 23


def up_all_along(h: History, o, hours: int, *, reclaimed=lambda k: False, session_h: int = 24) -> None:
    for k, start in enumerate(range(0, hours, session_h)):
        h.attempt(f"{o.offer_id}-{k}", o, start=start * HOUR, stop=min(start + session_h, hours) * HOUR,
                  lost=reclaimed(k))


def ticks(o, prices) -> list[dict]:
    return [{"offer_id": o.offer_id, "ts": T0 + k * HOUR, "usd_per_hour_spot": p} for k, p in enumerate(prices)]


def decide(ledger, offers, monkeypatch=None, baseline=False):
    if baseline:  # what dispatch ranked with before forecasts: no trend choice at all
        monkeypatch.setattr(placement, "trend_choices", lambda *a, **k: {})
    ranked, row = rank_for(ledger, Listing(offers), ExecutionRequest(), job_id="j", attempt=1, notice_s=120.0)
    return [o.offer_id for o in ranked], json.loads(row["inputs"])


@pytest.fixture
def ledger(orbit_home):
    return Settings.from_env(orbit_home).ledger()


@pytest.fixture(autouse=True)
def fresh_trend_cache():
    """Each test fits from nothing: a choice kept from another test's identical history is right,
    but would hide what this one is about (a refit, a monkeypatched rule)."""
    trends._cache.clear()
    yield
    trends._cache.clear()


def count_fits(monkeypatch) -> dict[str, int]:
    """Counts the grid searches `choose_price` / `choose_rate` run (policy.forecast's fits)."""
    fits = {"price": 0, "rate": 0}
    for name, fit in (("price", forecast.fit_price_model), ("rate", forecast.fit_rate_model)):
        def counted(*a, _name=name, _fit=fit, **k):
            fits[_name] += 1
            return _fit(*a, **k)
        monkeypatch.setattr(forecast, f"fit_{name}_model", counted)
    return fits


def test_a_daily_season_that_beats_the_last_price_reorders_the_offers_and_the_row_says_why(ledger, monkeypatch):
    h = History(ledger)
    up_all_along(h, SEASONAL, DAYS * 24)
    up_all_along(h, FLAT, DAYS * 24)
    # SEASONAL is dear from noon to midnight UTC and cheap otherwise, every day; it is now the
    # last dear hour, so its listed price is dear, and the next hours are mostly cheap.
    ledger.commit({"price_ticks": ticks(SEASONAL, [1.0 if dear(k) else 0.2 for k in range(DAYS * 24 + 1)])
                   + ticks(FLAT, [0.55] * (DAYS * 24 + 1))})
    assert dear(DAYS * 24) and not dear(DAYS * 24 + 1)

    order, inputs = decide(ledger, [SEASONAL, FLAT])
    trends = inputs["inputs"]["trends"]
    price = trends["offers"][SEASONAL.offer_id]["price"]
    assert price["source"] == "forecast" and price["forecast_error"] < price["baseline_error"]
    assert price["value"] < 0.55 < 1.0  # mostly the cheap hours of the next HORIZON
    assert trends["horizon_hours"] == HORIZON
    assert trends["offers"][FLAT.offer_id]["price"]["source"] == "baseline"  # a flat price: no better than the last
    assert order == [SEASONAL.offer_id, FLAT.offer_id]
    scored = {c["offer_id"]: c for c in inputs["candidates"]}
    assert scored[SEASONAL.offer_id]["usd_per_hour"] == pytest.approx(price["value"])

    # Before, the dear listed price put it second.
    before, old = decide(ledger, [SEASONAL, FLAT], monkeypatch, baseline=True)
    assert before == [FLAT.offer_id, SEASONAL.offer_id] and "trends" in old["inputs"]
    assert old["inputs"]["trends"]["offers"] == {}


def test_a_random_walk_the_forecast_does_not_beat_keeps_todays_inputs_byte_for_byte(ledger, monkeypatch):
    # A price that wanders without a season: the last price is as good a guess as any.
    rng, p, walk = random.Random(7), 0.5, []
    for _ in range(DAYS * 24):
        p = max(0.05, p + rng.gauss(0, 0.02))
        walk.append(round(p, 4))
    # Reclaims at a constant rate (a coin per hour-long instance): the cumulative rate is the right model.
    flips = random.Random(5)
    lost = [flips.random() < 0.3 for _ in range(DAYS * 24)]
    up_all_along(History(ledger), SEASONAL, DAYS * 24, reclaimed=lambda k: lost[k], session_h=1)
    ledger.commit({"price_ticks": ticks(SEASONAL, walk)})

    [choice] = trend_choices(ledger, [SEASONAL]).values()
    assert {k: c.source for k, c in choice.items()} == {"price": "baseline", "rate": "baseline"}
    assert choice["price"].forecast_error is not None and choice["rate"].baseline_error is not None

    order, inputs = decide(ledger, [SEASONAL, FLAT])
    before, old = decide(ledger, [SEASONAL, FLAT], monkeypatch, baseline=True)
    assert order == before
    recorded = inputs["inputs"].pop("trends")
    assert recorded["offers"][SEASONAL.offer_id]["price"]["source"] == "baseline"
    old["inputs"].pop("trends")
    assert json.dumps(inputs, sort_keys=True) == json.dumps(old, sort_keys=True)


def test_too_little_history_keeps_todays_inputs(ledger, monkeypatch):
    up_all_along(History(ledger), SEASONAL, 40, reclaimed=lambda k: k % 2 == 0, session_h=4)
    ledger.commit({"price_ticks": ticks(SEASONAL, [1.0 if dear(k) else 0.2 for k in range(40)])})
    [choice] = trend_choices(ledger, [SEASONAL]).values()
    for c in choice.values():
        assert c.source == "baseline" and "too little history" in c.why and c.forecast_error is None
    order, inputs = decide(ledger, [SEASONAL, FLAT])
    before, old = decide(ledger, [SEASONAL, FLAT], monkeypatch, baseline=True)
    inputs["inputs"].pop("trends"), old["inputs"].pop("trends")
    assert order == before and inputs == old


def test_the_deadline_planner_prices_spot_with_the_forecast_that_earned_it(ledger):
    up_all_along(History(ledger), SEASONAL, DAYS * 24)
    ledger.commit({"price_ticks": ticks(SEASONAL, [1.0 if dear(k) else 0.2 for k in range(DAYS * 24 + 1)])})
    template = SimpleNamespace(name="t", deadline_hours=100.0, config={"steps": 10**7})  # beyond the longest horizon
    job = {"job_id": "j", "attempt": 1, "created_at": T0}
    _, row = choose(ledger, job, template, SEASONAL, notice_s=120.0, done_steps=0, now=T0 + 3600.0)
    inputs = json.loads(row["inputs"])
    price = inputs["trends"]["offers"][SEASONAL.offer_id]["price"]
    assert price["source"] == "forecast" and inputs["spot_usd_per_hour"] == pytest.approx(price["value"])
    assert inputs["trends"]["horizon_hours"] == MAX_HORIZON


def seasonal_history(ledger, o, days: int) -> History:
    """Two-hour instances of `o` for `days`, reclaimed in the dear hours (6 a day), at a seasonal price."""
    h = History(ledger)
    for k, start in enumerate(range(0, days * 24, 2)):
        h.attempt(f"{o.offer_id}-{k}", o, start=start * HOUR, stop=(start + 2) * HOUR, lost=dear(start))
    ledger.commit({"price_ticks": ticks(o, [1.0 if dear(k) else 0.2 for k in range(days * 24 + 1)])})
    return h


def test_a_second_decision_on_the_same_history_does_not_refit_and_a_new_tick_or_instance_does(ledger,
                                                                                            monkeypatch):
    h = seasonal_history(ledger, SEASONAL, DAYS)
    fits = count_fits(monkeypatch)
    first = trend_choices(ledger, [SEASONAL])
    assert {k: c.source for k, c in first[SEASONAL.offer_id].items()} == {"price": "forecast", "rate": "forecast"}
    assert fits == {"price": 1, "rate": 1}

    assert trend_choices(ledger, [SEASONAL]) == first  # the same history: the kept answer, no fit
    order, _ = decide(ledger, [SEASONAL, FLAT])  # dispatch's ranking reads it too (FLAT: no history, no fit)
    assert fits == {"price": 1, "rate": 1} and order[0] == SEASONAL.offer_id
    trend_choices(ledger, [SEASONAL], horizon=HORIZON + 1)  # another question is another fit
    assert fits == {"price": 2, "rate": 2}

    # A price tick an hour after the last one lengthens the history: the next decision refits.
    ledger.commit({"price_ticks": [{"offer_id": SEASONAL.offer_id, "ts": T0 + (DAYS * 24 + 1) * HOUR,
                                    "usd_per_hour_spot": 0.2}]})
    trend_choices(ledger, [SEASONAL])
    assert fits == {"price": 3, "rate": 3}
    # So does a newly stopped instance (the rate's exposure and reclaims change).
    h.attempt("late", SEASONAL, start=(DAYS * 24 + 1) * HOUR, stop=(DAYS * 24 + 2) * HOUR, lost=True)
    trend_choices(ledger, [SEASONAL])
    assert fits == {"price": 4, "rate": 4}


def test_the_kept_choices_are_bounded_least_recently_used_first_out(ledger, monkeypatch):
    seasonal_history(ledger, SEASONAL, DAYS)
    monkeypatch.setattr(trends, "CACHE_SIZE", 1)
    fits = count_fits(monkeypatch)
    trend_choices(ledger, [SEASONAL], horizon=3)
    trend_choices(ledger, [SEASONAL], horizon=4)  # pushes out the horizon-3 answer
    trend_choices(ledger, [SEASONAL], horizon=4)  # kept
    assert len(trends._cache) == 1 and fits["price"] == 2
    trend_choices(ledger, [SEASONAL], horizon=3)  # fitted again
    assert fits["price"] == 3


def test_an_offer_without_reclaims_held_back_keeps_the_cumulative_rate_and_the_row_says_why(ledger, monkeypatch):
    # Hour-long instances, a third of them reclaimed for 4 days, then none for 6 (a flat price).
    up_all_along(History(ledger), SEASONAL, DAYS * 24, reclaimed=lambda k: k % 3 == 0 and k < 4 * 24, session_h=1)
    # Without the minimum-evidence rule, a forecast near 0 wins the reclaim-free held-back hours:
    with monkeypatch.context() as m:
        m.setattr(trends, "choose_rate", functools.partial(forecast.choose_rate, min_reclaims=0))
        assert trend_choices(ledger, [SEASONAL])[SEASONAL.offer_id]["rate"].used
    trends._cache.clear()

    order, inputs = decide(ledger, [SEASONAL, FLAT])
    rate = inputs["inputs"]["trends"]["offers"][SEASONAL.offer_id]["rate"]
    assert rate["source"] == "baseline" and rate["value"] is None
    assert rate["why"].startswith("too few reclaims to judge a rate forecast: 0 in the 24 held-back steps")
    scored = {c["offer_id"]: c for c in inputs["candidates"]}
    before, old = decide(ledger, [SEASONAL, FLAT], monkeypatch, baseline=True)
    assert order == before
    assert scored[SEASONAL.offer_id] == {c["offer_id"]: c for c in old["candidates"]}[SEASONAL.offer_id]
