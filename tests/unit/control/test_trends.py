"""The trend shown beside the advice: fitted on the ledger's own history when there is enough, else the
last price and the cumulative rate, and it says which."""
import pytest

from orbit_dagster.control.recorded import OfferRecord, Session
from orbit_dagster.control.trends import HORIZON, offer_trends
from orbit_dagster.settings import Settings

HOUR = 3600.0


def record(offer_id: str, hours: int, reclaim_every: int | None) -> OfferRecord:
    rec = OfferRecord(offer_id, "aws", "g5.xlarge", "A10G", 1, "use1-az1", 1.0)
    for h in range(hours):
        rec.sessions.append(Session(h * HOUR, (h + 1) * HOUR, bool(reclaim_every) and h % reclaim_every == 0, 0.4))
    return rec


def test_with_days_of_history_both_models_are_fitted_and_the_flaky_offer_forecasts_more_reclaims(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    steady, flaky = record("aws:g5.xlarge:use1-az1", 72, None), record("aws:g5.xlarge:use1-az2", 72, 2)
    # The feed: dearer in the afternoon (UTC), every day.
    ledger.commit({"price_ticks": [{"offer_id": flaky.offer_id, "ts": h * HOUR,
                                    "usd_per_hour_spot": 0.5 if 12 <= h % 24 < 18 else 0.4} for h in range(72)]})
    got = offer_trends(ledger, {steady.offer_id: steady, flaky.offer_id: flaky})
    for f in got.values():
        assert len(f["price_usd_per_hour"]) == len(f["reclaims_per_hour"]) == HORIZON
        assert f["price_model"].startswith("seasonal EW fitted") and f["rate_model"].startswith("seasonal EW rate")
    assert got[steady.offer_id]["price_usd_per_hour"] == [pytest.approx(0.4)] * HORIZON
    assert min(got[flaky.offer_id]["reclaims_per_hour"]) > 3 * max(got[steady.offer_id]["reclaims_per_hour"])


def test_with_little_history_it_falls_back_and_says_so(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    rec = record("aws:g5.xlarge:use1-az1", 5, 2)
    [f] = offer_trends(ledger, {rec.offer_id: rec}).values()
    assert f["price_usd_per_hour"] == [0.4] * HORIZON and "too little history" in f["price_model"]
    assert "cumulative rate over the fitted prior" in f["rate_model"]
    assert len(set(f["reclaims_per_hour"])) == 1
