"""Deadline-aware renting: spot or on-demand, decided by the policy `orbit simulate` replays.

A template with `deadline_hours` must finish within that many hours of submission. At each
dispatch, and at every price-feed tick while it runs on spot, the control plane asks
`policy.deadline_plan.spot_or_on_demand` with what it knows (work left from the measured
step time, time left, both prices, the offer's reclaim rate and the availability estimate
updated with the same record, save/restore times, notice; the spot price and the reclaim
rate are the offer's forecasts over the work left where they earned it, `trends.trend_choices`);
`on_demand` rents the same shape on demand (never reclaimed), and a running attempt moves
there make-before-break, like a migration. Every answer is a decision row with its inputs.
"""
from __future__ import annotations

import time

from ..catalog.reclaim_model import load_reclaim_model
from ..core.offers import Offer, on_demand
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..policy.deadline import MIN_DECISION_TICK_S
from ..policy.deadline_plan import MarkovAvailability, spot_or_on_demand
from ..policy.offer_choice import RESTORE_PRIOR_S
from ..policy.reclaim_rate import RateBook
from .observations import measured_step_seconds, observed_reclaims
from .placement import measured_save_seconds
from .trends import horizon_hours, trend_choices, trends_record


def choose(ledger: Ledger, job: dict, template, offer: Offer, *, notice_s: float, done_steps: int,
           holding: str = "none", scale: float = 1.0, now: float | None = None) -> tuple[str, dict | None]:
    """("spot" | "on_demand", the decision row); ("spot", None) for a job without a deadline.

    `notice_s` is on the wall clock; `scale` the market's seconds per wall second
    (`market_clock.time_scale`): the policy is asked in market time, and `deadline_hours`
    are market hours. `now`: the caller's clock reading (default: the wall clock now)."""
    if template.deadline_hours is None or not offer.spot:
        return "spot", None
    od = on_demand(offer)
    if od is None:
        return "spot", None
    step_s = measured_step_seconds(ledger, template.name, scale)
    work_left_s = max(int(template.config.get("steps", 0)) - done_steps, 0) * step_s
    now = time.time() if now is None else now
    time_left_s = max(template.deadline_hours * 3600.0 - (now - float(job["created_at"])) * scale, 0.0)
    book = RateBook()
    seen = observed_reclaims(ledger).get(offer.offer_id)
    est = book.for_offer(offer)
    if seen:
        est.observe(seen[0], seen[1] * 3600.0 * scale)
    # The availability the planner works on: its prior, updated with the same reclaims and
    # up-time as the offer's rate (what `orbit simulate`'s planner learns from its feed).
    availability = MarkovAvailability.from_exposure(load_reclaim_model(), MIN_DECISION_TICK_S,
                                                    reclaims=est.reclaims, exposure_s=est.exposure_s)
    # The offer's own forecasts over the work left, where they beat today's figures on its
    # held-back history (control.trends.trend_choices); else the listed price and the estimate.
    horizon = horizon_hours(work_left_s)
    trends = trend_choices(ledger, [offer], scale=scale, horizon=horizon)
    price, rate = trends[offer.offer_id]["price"], trends[offer.offer_id]["rate"]
    spot_usd_h = price.value if price.used else offer.usd_per_second * 3600.0
    mtbf_s = 3600.0 / rate.value if rate.used else est.mtbf_s
    d = spot_or_on_demand(work_left_s=work_left_s, time_left_s=time_left_s, spot_available=True, holding=holding,
                          spot_usd_per_hour=spot_usd_h,
                          on_demand_usd_per_hour=od.usd_per_second * 3600.0, restore_s=RESTORE_PRIOR_S,
                          save_s=measured_save_seconds(ledger, template.name, scale), notice_s=notice_s * scale,
                          mtbf_s=mtbf_s, availability=availability)
    action = "on_demand" if d.action == "on_demand" else "spot"
    row = {"decision_id": R.event("decision")["event_id"], "job_id": job["job_id"], "attempt": int(job["attempt"]),
           "kind": "spot_or_on_demand", "chosen": action, "runner_up": "spot" if action == "on_demand" else "on_demand",
           "inputs": R.dumps({"reason": d.reason, "policy_action": d.action, **d.inputs, "offer": offer.offer_id,
                              "step_s": step_s, "done_steps": done_steps, "time_scale": scale,
                              "trends": trends_record(trends, horizon)}),
           "ts": utcnow()}
    return action, row


def on_demand_offers(ranked: list[Offer]) -> list[Offer]:
    """The ranked shapes, rented on demand (those that have an on-demand price)."""
    return [od for od in (on_demand(o) for o in ranked) if od is not None]
