"""Choose an offer for an attempt and record why (inputs and runner-up) in the ledger."""
from __future__ import annotations

from ..core.errors import NoCapacity
from ..core.execution import ExecutionRequest
from ..core.offers import Offer
from ..ledger import records as R
from ..providers.base import Provider


def choose_offer(provider: Provider, request: ExecutionRequest, *, job_id: str, attempt: int,
                 avoid: set[str] = frozenset()) -> tuple[Offer, dict]:
    """The cheapest offer per effective TFLOP that fits; `avoid` holds offers that keep reclaiming."""
    offers = provider.list_offers(request.resources)
    cap = request.max_price_per_gpu_hour
    fitting = [o for o in offers if cap is None or (o.usd_per_second / max(o.gpu_count, 1)) * 3600 <= cap]
    if request.region:
        fitting = [o for o in fitting if o.region == request.region]
    preferred = [o for o in fitting if o.offer_id not in avoid] or fitting
    if not preferred:
        raise NoCapacity(
            f"no {provider.name} offer fits gpu={request.resources.gpu} x{request.resources.gpu_count}"
            + (f", max ${cap}/GPU-hour" if cap else "") + (f", region {request.region}" if request.region else ""),
            provider=provider.name,
            field="resources",
            fix="relax resources.gpu, max_price_per_gpu_hour or region",
        )

    def cost_per_work(o: Offer) -> tuple[float, str]:
        tflops = o.effective_tflops or 1.0
        return (o.usd_per_second / max(o.gpu_count, 1) / tflops, o.offer_id)

    ranked = sorted(preferred, key=cost_per_work)
    chosen = ranked[0]
    runner_up = ranked[1] if len(ranked) > 1 else None
    record = R.event(
        "offer_chosen",
        job_id=job_id,
        chosen=chosen.offer_id,
        runner_up=runner_up.offer_id if runner_up else None,
        candidates=len(ranked),
        avoided=sorted(avoid),
    )
    decision = {
        "decision_id": record["event_id"],
        "job_id": job_id,
        "attempt": attempt,
        "kind": "offer",
        "chosen": chosen.offer_id,
        "runner_up": runner_up.offer_id if runner_up else None,
        "inputs": R.dumps({
            "rule": "min usd per GPU-second per effective TFLOP",
            "chosen": {"usd_per_second": chosen.usd_per_second, "tflops": chosen.effective_tflops},
            "runner_up": {"usd_per_second": runner_up.usd_per_second, "tflops": runner_up.effective_tflops} if runner_up else None,
            "candidates": len(ranked),
            "avoided": sorted(avoid),
            "max_price_per_gpu_hour": cap,
        }),
        "ts": record["ts"],
    }
    return chosen, decision
