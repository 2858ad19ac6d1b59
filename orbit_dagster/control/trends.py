"""Per offer: the next hours' price and reclaim rate, forecast from what the ledger recorded.

The models are `policy.forecast`'s (an exponentially weighted level with a daily seasonal
term), fitted here on the ledger's own history of every offer pooled (its price feed ticks;
its instances' up-time and reclaims), hour by hour of market time. With less history than
a fit needs (a day and the horizon), the price is the last one seen and the rate the
cumulative one over the fitted reclaim model's prior, and the answer says so.

Shown by `orbit advise` and the `advice` asset, not used by offer choice or the deadline
planner: on held-back history (`bench/price_forecast.py`, docs/benchmarks.md) the fitted
price model is the last price (alpha 1, no season) and the rate model's error is lower
than the cumulative rate's on one evaluation trace and higher on two, so neither would
improve on what dispatch uses today (docs/cost.md).
"""
from __future__ import annotations

from ..catalog.reclaim_model import load_reclaim_model
from ..core.errors import OrbitError
from ..ledger import Ledger
from ..policy.forecast import SeasonalEW, SeasonalRate, fit_price_model, fit_rate_model, phase_of, rate_bins, step_series
from .recorded import OfferRecord

STEP_S, PERIOD, HORIZON = 3600.0, 24, 6


def _price_points(ledger: Ledger, record: OfferRecord) -> list[tuple[float, float]]:
    """(market seconds, $/h of one instance): the price feed's ticks, else what its instances were billed at."""
    ticks = ledger.rows("SELECT ts, usd_per_hour_spot FROM price_ticks WHERE offer_id = ? AND usd_per_hour_spot IS NOT "
                        "NULL ORDER BY ts", [record.offer_id])
    if ticks:
        return [(float(t["ts"]) * record.scale, float(t["usd_per_hour_spot"])) for t in ticks]
    return [(s.start_s, s.usd_per_hour) for s in record.sessions]


def offer_trends(ledger: Ledger, records: dict[str, OfferRecord], *, horizon: int = HORIZON) -> dict[str, dict]:
    """offer id -> its forecast: `price_usd_per_hour` and `reclaims_per_hour` for each of the next
    `horizon` market hours, and which model made each."""
    prices, rates = {}, {}
    for offer_id, rec in records.items():
        points = _price_points(ledger, rec)
        start = min([p[0] for p in points] + [s.start_s for s in rec.sessions])
        end = max([p[0] for p in points] + [s.end_s for s in rec.sessions])
        count = int((end - start) // STEP_S) + 1
        phase0 = phase_of(start, STEP_S, PERIOD)
        prices[offer_id] = (step_series(points, start_s=start, step_s=STEP_S, count=count), phase0)
        sessions = [(s.start_s, s.end_s, s.reclaimed) for s in rec.sessions]
        rates[offer_id] = (*rate_bins(sessions, start_s=start, step_s=STEP_S, count=count), phase0)
    model = load_reclaim_model()
    prior = dict(prior_rate_per_hour=model.mean_rate_per_hour, prior_strength=model.zone_rate_alpha)
    try:
        price_model, _ = fit_price_model(list(prices.values()), horizon=horizon, period=PERIOD, start=PERIOD)
        price_label = f"seasonal EW fitted on the ledger's price history (alpha {price_model.alpha:g}, " \
                      f"gamma {price_model.gamma:g})"
    except OrbitError:
        price_model, price_label = SeasonalEW(1.0, 0.0, PERIOD), "last price (too little history to fit: under " \
                                                                 f"{PERIOD + horizon} h)"
    try:
        rate_model, _ = fit_rate_model(list(rates.values()), horizon=horizon, period=PERIOD, start=PERIOD, **prior)
        rate_label = f"seasonal EW rate fitted on the ledger's history (alpha {rate_model.alpha:g}, shrink " \
                     f"{rate_model.shrink_h:g} h)"
    except OrbitError:
        rate_model = SeasonalRate.with_prior(0.0, float("inf"), PERIOD, **{
            "rate_per_hour": prior["prior_rate_per_hour"], "strength": prior["prior_strength"]})
        rate_label = f"cumulative rate over the fitted prior (too little history to fit: under {PERIOD + horizon} h)"
    out = {}
    for offer_id in records:
        series, phase0 = prices[offer_id]
        exposure, reclaims, _ = rates[offer_id]
        out[offer_id] = {
            "horizon_hours": horizon,
            "price_usd_per_hour": [None if v is None else round(v, 6)
                                   for v in price_model.forecast(series, horizon, phase0)],
            "reclaims_per_hour": [round(v, 6) for v in rate_model.forecast(exposure, reclaims, horizon, phase0)],
            "price_model": price_label, "rate_model": rate_label,
        }
    return out
