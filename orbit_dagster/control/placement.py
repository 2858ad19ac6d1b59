"""Choose an offer for an attempt and record why (inputs and runner-up) in the ledger.

The ranking is the policy's (`policy.offer_choice.rank_offers`: expected $ per useful
PFLOP given the offer's reclaim rate, checkpoint cost and the notice); what the ledger has
observed (reclaims and exposure per offer, measured save times, measured TFLOPS) is folded
in first.
"""
from __future__ import annotations

import statistics

from ..core.execution import ExecutionRequest
from ..core.offers import Offer
from ..ledger import Ledger
from ..ledger import records as R
from ..policy.offer_choice import rank_offers
from ..policy.reclaim_rate import RateBook
from ..providers.base import Provider
from .observations import measured_tflops, observed_reclaims

DEFAULT_SAVE_S = 1.0
DEFAULT_RESTORE_S = 10.0


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
    return statistics.median(values) * scale if values else DEFAULT_SAVE_S


def rank_for(ledger: Ledger, provider: Provider, request: ExecutionRequest, *, job_id: str, attempt: int,
             notice_s: float, template: str | None = None, avoid: frozenset[str] | set[str] = frozenset()
             ) -> tuple[list[Offer], dict]:
    """Offers to try, best first (offers in `avoid` last), and the decision row for the ledger."""
    offers = provider.list_offers(request.resources)
    if request.region:
        offers = [o for o in offers if o.region == request.region]
    measured = measured_tflops(ledger)
    if measured:
        offers = [o.model_copy(update={"measured_tflops": measured[o.offer_id]}) if o.offer_id in measured else o
                  for o in offers]
    from .market_clock import time_scale

    scale = time_scale(provider)  # the policy thinks in market seconds; we measure wall ones
    book = RateBook()
    for offer_id, (reclaims, hours) in observed_reclaims(ledger).items():
        match = next((o for o in offers if o.offer_id == offer_id), None)
        if match is not None:
            book.for_offer(match).observe(reclaims, hours * 3600.0 * scale)
    save_s = measured_save_seconds(ledger, template, scale)
    decision = rank_offers(offers, gpu=request.resources.gpu, gpu_count=max(request.resources.gpu_count, 1),
                           gpu_memory_gb=request.resources.gpu_memory_gb,
                           max_price_per_gpu_hour=request.max_price_per_gpu_hour, save_s=save_s,
                           restore_s=DEFAULT_RESTORE_S, notice_s=notice_s * scale, rates=book)
    ranked = [s.offer for s in decision.ranked]
    ranked = [o for o in ranked if o.offer_id not in avoid] + [o for o in ranked if o.offer_id in avoid]
    record = decision.as_record()
    record["avoided"] = sorted(avoid)
    row = {
        "decision_id": R.event("decision")["event_id"], "job_id": job_id, "attempt": attempt, "kind": "offer",
        "chosen": ranked[0].offer_id, "runner_up": ranked[1].offer_id if len(ranked) > 1 else None,
        "inputs": R.dumps(record), "ts": R.utcnow(),
    }
    return ranked, row
