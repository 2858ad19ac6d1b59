"""Which offer to rent: the cheapest expected cost per unit of *useful* work.

    score = price / (effective TFLOPS x expected goodput)       [$ per useful PFLOP]

Goodput is the share of paid time that ends up as durable progress, given the offer's
reclaim rate (an online estimate, see ``reclaim_rate``), the checkpoint cost, the restart
cost and the reclaim notice: with the Young/Daly interval tau,

    overhead = save / tau + rate * (restore + loss per reclaim)

where a reclaim loses the emergency save when one fits the notice, else half an interval
plus a save. The decision is a plain dict for the ledger (``as_record``): the chosen offer,
the runner-up and every input, so "why this offer" has an answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.interval import checkpoint_interval, emergency_covered
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.reclaim_rate import RateBook, ReclaimRateEstimator

POLICY_VERSION = "offer-choice/1"
#: What dispatch assumes before the ledger has measured a durable save of a template, and the
#: restore time it ranks with (it measures none), in market seconds. The one copy: dispatch,
#: `orbit offers`, the deadline and migration decisions and the launch replay all read these.
SAVE_PRIOR_S = 1.0
RESTORE_PRIOR_S = 10.0
#: A dispatch provisions the first of this many best offers that has capacity now.
MAX_OFFERS_TRIED = 5
#: An offer on which this job was reclaimed this many times goes to the back of its ranking
#: (dispatch's order; `orbit simulate --trace A --trace B` replays it, policy/fleet.py).
AVOID_AFTER_RECLAIMS = 2


class NoOfferMatches(OrbitError):
    """Every offer was filtered out by one of the job's requirements."""


def expected_goodput(rate_per_hour: float, *, save_s: float, restore_s: float, notice_s: float,
                     emergency_save_s: float | None = None) -> tuple[float, float]:
    """(goodput in [0, 1], checkpoint interval in s) for an instance reclaimed at ``rate_per_hour``."""
    if rate_per_hour < 0:
        raise OrbitError("rate_per_hour must be >= 0", field="rate_per_hour", value=rate_per_hour,
                         fix="pass reclaims per hour of up-time")
    esave = save_s if emergency_save_s is None else emergency_save_s
    if rate_per_hour == 0:
        tau = checkpoint_interval(math.inf, save_s, notice_s=notice_s, emergency_save_s=esave)
        return max(0.0, 1.0 - save_s / tau) if tau > 0 else 0.0, tau
    mtbf = 3600.0 / rate_per_hour
    tau = checkpoint_interval(mtbf, save_s, notice_s=notice_s, emergency_save_s=esave)
    loss = esave if emergency_covered(notice_s, esave) else tau / 2.0 + save_s
    overhead = (save_s / tau if tau > 0 else 1.0) + (rate_per_hour / 3600.0) * (restore_s + loss)
    return max(0.0, 1.0 - overhead), tau


@dataclass(frozen=True)
class ScoredOffer:
    offer: Offer
    usd_per_useful_pflop: float
    goodput: float
    rate_per_hour: float
    rate_source: str
    interval_s: float
    usd_per_hour: float
    useful_tflops: float
    notice_s: float = 0.0
    reason: str = ""

    def as_record(self) -> dict:
        return {"offer_id": self.offer.offer_id, "usd_per_useful_pflop": _r(self.usd_per_useful_pflop),
                "goodput": _r(self.goodput), "reclaims_per_hour": _r(self.rate_per_hour),
                "rate_source": self.rate_source, "checkpoint_interval_s": _r(self.interval_s),
                "usd_per_hour": _r(self.usd_per_hour), "useful_tflops": _r(self.useful_tflops),
                "notice_s": self.notice_s, "spot": self.offer.spot, "zone": self.offer.zone, "reason": self.reason}


def _reason(pos: int, s: ScoredOffer, best: ScoredOffer) -> str:
    """Why an offer sits where it does: what it costs per useful PFLOP and which factor puts it behind #1."""
    risk = (f"goodput {s.goodput:.3f} at {s.rate_per_hour:.3g} reclaims/h ({s.rate_source})" if s.offer.spot
            else "on-demand, never reclaimed")
    if pos == 1:
        return (f"lowest expected $ per useful PFLOP: {s.usd_per_hour:.4g} $/h for {s.useful_tflops:.4g} TFLOPS, {risk}")
    price = (s.usd_per_hour / s.useful_tflops) / (best.usd_per_hour / best.useful_tflops) - 1.0
    good = best.goodput / s.goodput - 1.0 if s.goodput > 0 else math.inf
    pct = s.usd_per_useful_pflop / best.usd_per_useful_pflop - 1.0
    parts = []
    if abs(price) >= 0.005:
        parts.append(f"$ per TFLOP-hour {price:+.1%} vs #1")
    if abs(good) >= 0.005:
        parts.append(f"{risk} vs #1's {best.goodput:.3f}")
    return f"+{pct:.1%} $ per useful PFLOP vs #1: " + ("; ".join(parts) if parts else "a tie, broken by offer id")


def _r(x: float) -> float | None:
    return None if x is None or math.isinf(x) else round(x, 6)


@dataclass(frozen=True)
class OfferDecision:
    chosen: Offer
    runner_up: Offer | None
    ranked: tuple[ScoredOffer, ...]
    requirements: dict
    filters: tuple[dict, ...]
    inputs: dict = field(default_factory=dict)

    def as_record(self) -> dict:
        """A plain, JSON-ready dict for the ledger: what was chosen, over what, and why."""
        best = self.ranked[0]
        second = self.ranked[1] if len(self.ranked) > 1 else None
        margin = (second.usd_per_useful_pflop / best.usd_per_useful_pflop - 1.0
                  if second and best.usd_per_useful_pflop > 0 else None)
        return {
            "decision": "offer_choice",
            "policy_version": POLICY_VERSION,
            "chosen": self.chosen.offer_id,
            "runner_up": self.runner_up.offer_id if self.runner_up else None,
            "score_unit": "usd_per_useful_pflop",
            "margin_over_runner_up": _r(margin) if margin is not None else None,
            "requirements": dict(self.requirements),
            "inputs": dict(self.inputs),
            "filters": [dict(f) for f in self.filters],
            "candidates": [s.as_record() for s in self.ranked[:10]],
        }


def _price_per_gpu_hour(o: Offer) -> float | None:
    per_s = o.usd_per_gpu_second_spot if o.spot else o.usd_per_gpu_second_on_demand
    return None if per_s is None else per_s * 3600.0


def _filter(offers: list[Offer], gpu: str, gpu_count: int, gpu_memory_gb: float,
            max_price: float | None) -> tuple[list[Offer], list[dict]]:
    stages = [
        ("gpu", gpu, lambda o: gpu.lower() == "any" or o.gpu.lower() == gpu.lower(),
         "ask for gpu='any' or one of the offered GPU models"),
        ("gpu_count", gpu_count, lambda o: o.gpu_count >= gpu_count, "lower gpu_count or add a provider with bigger shapes"),
        ("gpu_memory_gb", gpu_memory_gb, lambda o: o.gpu_memory_gb >= gpu_memory_gb,
         "lower gpu_memory_gb or allow a larger GPU model"),
        ("price", "known", lambda o: _price_per_gpu_hour(o) is not None, "refresh the offer catalog's prices"),
        ("max_price_per_gpu_hour", max_price,
         lambda o: max_price is None or (_price_per_gpu_hour(o) or math.inf) <= max_price,
         "raise max_price_per_gpu_hour"),
        ("tflops", "known", lambda o: (o.effective_tflops or 0) > 0,
         "join GPU specs into the catalog or run the TFLOPS probe"),
    ]
    log = []
    for name, value, keep, fix in stages:
        before = len(offers)
        offers = [o for o in offers if keep(o)]
        log.append({"requirement": name, "value": value, "before": before, "after": len(offers)})
        if not offers:
            raise NoOfferMatches(f"no offer meets requirement {name}={value!r} ({before} offers before it)",
                                 field=name, value=value, fix=fix)
    return offers, log


def tie_key(score: float) -> float:
    """A score to 10 significant digits: scores within float rounding of each other (the same
    price written two ways, 0.1 and 0.10000000000000002) are a tie, broken by offer id, so
    the ranking never depends on the last bit of a division. Monotone: a score more than
    ~1e-9 (relative) lower still ranks first."""
    return score if not math.isfinite(score) else float(f"{score:.9e}")


def rank_offers(offers: Sequence[Offer], *, gpu: str = "any", gpu_count: int = 1, gpu_memory_gb: float = 0,
                max_price_per_gpu_hour: float | None = None, save_s: float = 60.0, restore_s: float = 300.0,
                notice_s: float | Mapping[str, float] = 120.0, emergency_save_s: float | None = None,
                rates: RateBook | Mapping[str, ReclaimRateEstimator] | None = None,
                model: ReclaimModel | None = None,
                spot_usd_per_hour: Mapping[str, float] | None = None) -> OfferDecision:
    """Rank the offers that meet the requirements by expected $ per useful PFLOP, cheapest first
    (scores within float rounding of each other are a tie, broken by offer id: `tie_key`).

    ``rates`` holds the online reclaim-rate estimates by offer id; offers without one get
    their prior (own rate, band, reliability; the riskiest band when nothing is known).
    ``notice_s``: the reclaim notice in seconds, or one per provider (``{"aws": 120, "gce": 30}``;
    a provider missing from it is taken to give none). ``spot_usd_per_hour``: offer id -> the
    instance's $/h to score a spot offer at instead of its listed price (a price forecast
    that earned its use, `control.trends.trend_choices`); the requirements' filters still
    read the listed price, so a job's price cap is about what it would pay now. Each ranked offer carries a one-line
    ``reason`` for its position. Raises NoOfferMatches naming the requirement that filtered
    everything out.
    """
    if not offers:
        raise NoOfferMatches("no offers to choose from", field="offers", value=0,
                             fix="discover offers first (offer catalog) or add a provider")
    if not isinstance(gpu_count, int) or gpu_count < 1:
        raise OrbitError("gpu_count must be an integer >= 1", field="gpu_count", value=gpu_count, fix="ask for 1 or more GPUs")
    m = model or load_reclaim_model()
    kept, log = _filter(list(offers), gpu, gpu_count, gpu_memory_gb, max_price_per_gpu_hour)
    scored = []
    for o in kept:
        est = _estimator(o, rates, m)
        rate = est.rate_per_hour if o.spot else 0.0
        notice = float(notice_s.get(o.provider, 0.0)) if isinstance(notice_s, Mapping) else float(notice_s)
        goodput, tau = expected_goodput(rate, save_s=save_s, restore_s=restore_s, notice_s=notice,
                                        emergency_save_s=emergency_save_s)
        useful = (o.effective_tflops or 0.0) * gpu_count
        usd_h = o.usd_per_second * 3600.0
        if o.spot and spot_usd_per_hour and o.offer_id in spot_usd_per_hour:
            usd_h = float(spot_usd_per_hour[o.offer_id])
        denom = useful * goodput * 1e12 * 3600.0  # useful FLOP per paid hour
        score = usd_h / denom * 1e15 if denom > 0 else math.inf
        scored.append(ScoredOffer(o, score, goodput, rate, est.source if o.spot else "on-demand", tau, usd_h, useful,
                                  notice))
    scored.sort(key=lambda s: (tie_key(s.usd_per_useful_pflop), s.offer.offer_id))
    if math.isinf(scored[0].usd_per_useful_pflop):
        raise NoOfferMatches("every remaining offer is reclaimed too often to make progress", field="goodput",
                             value=0.0, fix="allow on-demand offers or a zone with a lower interruption band")
    scored = [replace(x, reason=_reason(i, x, scored[0])) for i, x in enumerate(scored, 1)]
    requirements = {"gpu": gpu, "gpu_count": gpu_count, "gpu_memory_gb": gpu_memory_gb,
                    "max_price_per_gpu_hour": max_price_per_gpu_hour}
    inputs = {"save_s": save_s, "restore_s": restore_s,
              "notice_s": dict(notice_s) if isinstance(notice_s, Mapping) else notice_s,
              "emergency_save_s": save_s if emergency_save_s is None else emergency_save_s}
    return OfferDecision(chosen=scored[0].offer, runner_up=scored[1].offer if len(scored) > 1 else None,
                         ranked=tuple(scored), requirements=requirements, filters=tuple(log), inputs=inputs)


def _estimator(o: Offer, rates, model: ReclaimModel) -> ReclaimRateEstimator:
    if isinstance(rates, RateBook):
        return rates.for_offer(o)
    if rates is not None and o.offer_id in rates:
        return rates[o.offer_id]
    return ReclaimRateEstimator.for_offer(o, model)


def offers_to_avoid(reclaims_by_offer: Mapping[str, int]) -> set[str]:
    """The offers on which this job was reclaimed at least ``AVOID_AFTER_RECLAIMS`` times.

    The ranking already prices every reclaim an offer had (its rate estimate, all jobs'); this
    rule is about the job: a zone that keeps taking *this* job's instances goes last for it,
    whatever its estimate says, so that a run of bad luck in one zone is not retried there
    first. Both drivers apply it: dispatch (`control.recovery`) and the offers replay."""
    return {offer_id for offer_id, n in reclaims_by_offer.items() if n >= AVOID_AFTER_RECLAIMS}


def avoided_last(ranked: Sequence[Offer], avoid: set[str] | frozenset[str]) -> list[Offer]:
    """The ranking with the offers to avoid moved to its end (their order kept): still tried
    when nothing better has capacity."""
    return [o for o in ranked if o.offer_id not in avoid] + [o for o in ranked if o.offer_id in avoid]
