"""Per offer: the next hours' price and reclaim rate, forecast from what the ledger recorded.

The models are `policy.forecast`'s (an exponentially weighted level with a daily seasonal
term), fitted here on the ledger's own history of every offer pooled (its price feed ticks;
its instances' up-time and reclaims), hour by hour of market time. With less history than
a fit needs (a day and the horizon), the price is the last one seen and the rate the
cumulative one over the fitted reclaim model's prior, and the answer says so.

`offer_trends` (pooled) is shown by `orbit advise` and the `advice` asset. Offer choice and
the deadline planner use `trend_choices` instead: per offer, fitted on that offer's own
history only and used only where it beat the naive figure (the last price; the cumulative
rate over the offer's prior) on the offer's most recent held-back hours
(`policy.forecast.choose_price`, `choose_rate`; a rate forecast is judged only on at least
`MIN_RECLAIMS` reclaims held back and as many before); elsewhere they keep today's inputs. On
the evaluation traces the pooled fit did not beat the naive figures (docs/cost.md), which
is why the use is gated offer by offer rather than switched on. The per-offer answer is kept
in this process per distinct history (`_cached_choice`), so decisions between two changes of
an offer's record do not refit it.
"""
from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict

from ..catalog.reclaim_model import load_reclaim_model
from ..core.errors import OrbitError
from ..core.offers import Offer
from ..ledger import Ledger
from ..policy.forecast import (
    HOLDOUT,
    SeasonalEW,
    SeasonalRate,
    TrendChoice,
    choose_price,
    choose_rate,
    fit_price_model,
    fit_rate_model,
    phase_of,
    rate_bins,
    step_series,
)
from ..policy.reclaim_rate import ReclaimRateEstimator
from .recorded import OfferRecord, offer_records

STEP_S, PERIOD, HORIZON = 3600.0, 24, 6
#: The longest horizon a decision asks for (market hours), and the most recent history
#: `trend_choices` fits on (28 days): enough for the daily season, and a fit per offer at
#: every dispatch stays quick.
MAX_HORIZON, HISTORY_STEPS = 24, 28 * 24
#: How many offers' choices this process keeps (`_cached_choice`): a fit per offer costs
#: about 0.1-0.2 s on a month of history (docs/cost.md) and dispatch asks at every launch, migration and deadline
#: tick, while an offer's recorded history changes only with a new price tick or a stopped
#: instance. Keyed by what the answer depends on, so a kept answer is never stale; bounded,
#: the least recently used dropped first.
CACHE_SIZE = 256
_cache: OrderedDict[tuple, dict[str, TrendChoice]] = OrderedDict()
_cache_lock = threading.Lock()


def _price_points(ledger: Ledger, record: OfferRecord) -> list[tuple[float, float]]:
    """(market seconds, $/h of one instance): the price feed's ticks, else what its instances were billed at."""
    ticks = ledger.rows("SELECT ts, usd_per_hour_spot FROM price_ticks WHERE offer_id = ? AND usd_per_hour_spot IS NOT "
                        "NULL ORDER BY ts", [record.offer_id])
    if ticks:
        return [(float(t["ts"]) * record.scale, float(t["usd_per_hour_spot"])) for t in ticks]
    return [(s.start_s, s.usd_per_hour) for s in record.sessions]


def _series(ledger: Ledger, rec: OfferRecord) -> tuple[list[float | None], list[float], list[int], int]:
    """An offer's recorded history hour by hour of market time: (price, exposure hours, reclaims, phase0)."""
    points = _price_points(ledger, rec)
    start = min([p[0] for p in points] + [s.start_s for s in rec.sessions])
    end = max([p[0] for p in points] + [s.end_s for s in rec.sessions])
    count = int((end - start) // STEP_S) + 1
    phase0 = phase_of(start, STEP_S, PERIOD)
    sessions = [(s.start_s, s.end_s, s.reclaimed) for s in rec.sessions]
    return (step_series(points, start_s=start, step_s=STEP_S, count=count),
            *rate_bins(sessions, start_s=start, step_s=STEP_S, count=count), phase0)


def offer_trends(ledger: Ledger, records: dict[str, OfferRecord], *, horizon: int = HORIZON) -> dict[str, dict]:
    """offer id -> its forecast: `price_usd_per_hour` and `reclaims_per_hour` for each of the next
    `horizon` market hours, and which model made each."""
    prices, rates = {}, {}
    for offer_id, rec in records.items():
        series, exposure, reclaims, phase0 = _series(ledger, rec)
        prices[offer_id] = (series, phase0)
        rates[offer_id] = (exposure, reclaims, phase0)
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


def horizon_hours(work_left_s: float) -> int:
    """The horizon a decision asks the forecast about: the job's expected remaining market
    hours, rounded up, between 1 and `MAX_HORIZON`."""
    return min(max(math.ceil(max(work_left_s, 0.0) / STEP_S), 1), MAX_HORIZON)


def trend_choices(ledger: Ledger, offers: list[Offer], *, scale: float = 1.0,
                  horizon: int = HORIZON) -> dict[str, dict[str, TrendChoice]]:
    """Spot offer id -> {"price": TrendChoice, "rate": TrendChoice} from its own recorded history
    (the last `HISTORY_STEPS` hours of it), over the next `horizon` market hours. `scale`: the
    market's seconds per wall second. An offer with no recorded instance gets baselines."""
    records = offer_records(ledger, lambda _provider: scale)
    out: dict[str, dict[str, TrendChoice]] = {}
    for o in offers:
        if not o.spot or o.offer_id in out:
            continue
        prior = ReclaimRateEstimator.for_offer(o)  # the prior dispatch's own estimate starts from
        rec = records.get(o.offer_id)
        if rec is None or not rec.sessions:
            none = TrendChoice("baseline", None, None, None, "no recorded instance of this offer")
            out[o.offer_id] = {"price": none, "rate": none}
            continue
        series, exposure, reclaims, phase0 = _series(ledger, rec)
        drop = max(len(series) - HISTORY_STEPS, 0)
        out[o.offer_id] = _cached_choice(o.offer_id, series[drop:], exposure[drop:], reclaims[drop:],
                                         (phase0 + drop) % PERIOD, horizon=horizon,
                                         prior_rate_per_hour=prior.prior_rate_per_hour,
                                         prior_strength=prior.prior_strength)
    return out


def _cached_choice(offer_id: str, series: list[float | None], exposure: list[float], reclaims: list[int],
                   phase0: int, *, horizon: int, prior_rate_per_hour: float,
                   prior_strength: float) -> dict[str, TrendChoice]:
    """{"price", "rate"} for one offer's history, fitted once per distinct history and question.

    The key holds everything the answer is a function of (the choices are deterministic): the
    hourly history itself (a digest of it), its phase, the horizon and the prior. Only stopped
    instances and price ticks make the history, so the same ledger gives the same key; a new
    tick or a newly stopped instance changes it and the next call fits."""
    digest = hashlib.blake2b(repr((series, exposure, reclaims)).encode(), digest_size=16).hexdigest()
    key = (offer_id, digest, phase0, horizon, prior_rate_per_hour, prior_strength)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return dict(_cache[key])  # a copy: a caller's change must not reach the next decision
    price = choose_price(series, phase0, horizon=horizon, period=PERIOD)
    rate = choose_rate(exposure, reclaims, phase0, horizon=horizon, period=PERIOD,
                       prior_rate_per_hour=prior_rate_per_hour, prior_strength=prior_strength)
    if rate.used and not (rate.value or 0) > 0:  # an estimator needs a positive rate
        rate = TrendChoice("baseline", None, rate.forecast_error, rate.baseline_error, "forecast rate not > 0")
    choice = {"price": price, "rate": rate}
    with _cache_lock:
        _cache[key] = dict(choice)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return choice


def trends_record(choices: dict[str, dict[str, TrendChoice]], horizon: int) -> dict:
    """What a decision row's inputs say about the forecasts: per offer, the source of each figure
    (forecast or baseline) and both held-back errors."""
    return {"horizon_hours": horizon, "holdout_hours": HOLDOUT,
            "offers": {k: {name: c.as_record() for name, c in v.items()} for k, v in sorted(choices.items())}}
