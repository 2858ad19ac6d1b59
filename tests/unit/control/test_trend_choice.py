"""Offer choice and the deadline planner use an offer's price / reclaim-rate forecast only where it beat
the naive figure (last price; cumulative rate over the offer's prior) on the offer's own held-back history,
and their decision rows say which they used and both errors."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from orbit_dagster.control import placement
from orbit_dagster.control.deadline import choose
from orbit_dagster.control.placement import rank_for
from orbit_dagster.control.trends import HORIZON, MAX_HORIZON, trend_choices
from orbit_dagster.core.execution import ExecutionRequest
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
