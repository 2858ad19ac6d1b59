"""Choose an offer for an attempt and record why (inputs and runner-up) in the ledger.

The ranking is the policy's (`policy.offer_choice.rank_offers`: expected $ per useful
PFLOP given the offer's reclaim rate, checkpoint cost and the notice); what the ledger has
observed (reclaims and exposure per offer, measured save times, measured TFLOPS) is folded
in first, and where an offer's own price or reclaim-rate forecast beat the naive figure on
its held-back history (`trends.trend_choices`), the forecast. `rank_placement` is the one
place that does so: dispatch, evaluation, migration (through `rank_for`) and `orbit offers`
all rank with it, so the order `orbit offers` prints is the order dispatch tries (for a
job of the default forecast horizon).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from ..core.execution import ExecutionRequest
from ..core.offers import Offer
from ..ledger import Ledger
from ..ledger import records as R
from ..policy.forecast import TrendChoice
from ..policy.offer_choice import RESTORE_PRIOR_S, SAVE_PRIOR_S, OfferDecision, avoided_last, rank_offers
from ..policy.reclaim_rate import RateBook, ReclaimRateEstimator
from ..providers.base import Provider
from .market_clock import time_scale
from .observations import measured_tflops, observed_reclaims
from .trends import HORIZON, trend_choices, trends_record


def measured_save_seconds(ledger: Ledger, template: str | None = None, scale: float = 1.0) -> float:
    """Median durable save time seen for this template (a prior when none yet), in the market's
    seconds: a measurement (wall clock) times `scale` (`market_clock.time_scale`); the prior is
    a market figure already."""
    rows = ledger.rows(
        """SELECT c.save_seconds FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id
           WHERE c.save_seconds IS NOT NULL AND (? IS NULL OR j.template = ?) ORDER BY c.registered_at DESC LIMIT 50""",
        [template, template],
    )
    values = [r["save_seconds"] for r in rows if r["save_seconds"] is not None]
    return statistics.median(values) * scale if values else SAVE_PRIOR_S


def with_measured(offers: Sequence[Offer], measured: Mapping[str, float] | None) -> list[Offer]:
    """The offers with the probe's TFLOPS per GPU (by offer id) folded in."""
    measured = measured or {}
    return [o.model_copy(update={"measured_tflops": measured[o.offer_id]}) if o.offer_id in measured else o
            for o in offers]


def rank_placement(offers: Sequence[Offer], *, save_s: float, notice_s: float | Mapping[str, float],
                   observed: Mapping[str, tuple[float, float]] | None = None,
                   measured: Mapping[str, float] | None = None, restore_s: float = RESTORE_PRIOR_S,
                   scale: float = 1.0, gpu: str = "any", gpu_count: int = 1, gpu_memory_gb: float = 0,
                   max_price_per_gpu_hour: float | None = None,
                   trends: Mapping[str, Mapping[str, TrendChoice]] | None = None) -> OfferDecision:
    """Dispatch's ranking of `offers`, best first (raises NoOfferMatches naming what filtered all out).

    The policy thinks in market time, the ledger measures on the wall clock, so with `scale`
    market seconds per wall second (`market_clock.time_scale`; 1 for a real market):
    `observed` (offer id -> (reclaims, exposure hours on the wall clock)) becomes a
    reclaim-rate book over `hours x scale` market hours, and `notice_s` (wall seconds, one
    number or one per provider) is multiplied by `scale`. `save_s` and `restore_s` are market
    seconds already (`measured_save_seconds` scales its measurement). `measured`: offer id ->
    TFLOPS per GPU from the probe. `trends` (`trends.trend_choices`): where an offer's price or
    reclaim-rate forecast earned its use, the ranking scores it with the forecast's mean over
    the horizon instead of the listed price / the ledger's cumulative rate; a baseline choice
    changes nothing.
    """
    offers = with_measured(offers, measured)
    book = RateBook()
    by_id = {o.offer_id: o for o in offers}
    for offer_id, (reclaims, hours) in (observed or {}).items():
        if offer_id in by_id:
            book.for_offer(by_id[offer_id]).observe(int(reclaims), float(hours) * 3600.0 * scale)
    prices: dict[str, float] = {}
    for offer_id, choice in (trends or {}).items():
        if offer_id not in by_id:
            continue
        if choice["price"].used:
            prices[offer_id] = float(choice["price"].value)
        if choice["rate"].used:  # replaces the cumulative estimate: the forecast already read those reclaims
            book.estimators[offer_id] = ReclaimRateEstimator(float(choice["rate"].value),
                                                             source="forecast (beat the cumulative rate held back)")
    notice = ({k: float(v) * scale for k, v in notice_s.items()} if isinstance(notice_s, Mapping)
              else float(notice_s) * scale)
    return rank_offers(offers, gpu=gpu, gpu_count=gpu_count, gpu_memory_gb=gpu_memory_gb,
                       max_price_per_gpu_hour=max_price_per_gpu_hour, save_s=save_s, restore_s=restore_s,
                       notice_s=notice, rates=book, spot_usd_per_hour=prices or None)


def rank_for(ledger: Ledger, provider: Provider, request: ExecutionRequest, *, job_id: str, attempt: int,
             notice_s: float, template: str | None = None, avoid: frozenset[str] | set[str] = frozenset(),
             horizon_h: int = HORIZON) -> tuple[list[Offer], dict]:
    """Offers to try, best first (offers in `avoid` last), and the decision row for the ledger.

    `horizon_h`: the market hours the job is expected to run (`trends.horizon_hours`), the
    horizon each offer's forecast is judged and used over; the row's inputs say, per offer,
    whether the forecast or today's figure was used and both held-back errors."""
    offers = provider.list_offers(request.resources)
    if request.region:
        offers = [o for o in offers if o.region == request.region]
    scale = time_scale(provider)  # the policy thinks in market seconds; we measure wall ones
    trends = trend_choices(ledger, offers, scale=scale, horizon=horizon_h)
    decision = rank_placement(offers, save_s=measured_save_seconds(ledger, template, scale), notice_s=notice_s,
                              observed=observed_reclaims(ledger), measured=measured_tflops(ledger), scale=scale,
                              gpu=request.resources.gpu, gpu_count=max(request.resources.gpu_count, 1),
                              gpu_memory_gb=request.resources.gpu_memory_gb,
                              max_price_per_gpu_hour=request.max_price_per_gpu_hour, trends=trends)
    ranked = avoided_last([s.offer for s in decision.ranked], avoid)
    record = decision.as_record()
    record["avoided"] = sorted(avoid)
    record["inputs"]["trends"] = trends_record(trends, horizon_h)
    row = {
        "decision_id": R.event("decision")["event_id"], "job_id": job_id, "attempt": attempt, "kind": "offer",
        "chosen": ranked[0].offer_id, "runner_up": ranked[1].offer_id if len(ranked) > 1 else None,
        "inputs": R.dumps(record), "ts": R.utcnow(),
    }
    return ranked, row
