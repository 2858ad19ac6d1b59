"""`orbit offers`: the catalog's offers in the order dispatch would rent them, each with its reason.

The catalog lists (`catalog.listing.list_offers`), dispatch ranks (`control.placement.
rank_placement`, with the ledger's observations); this module only turns the decision into
rows and a table. The first offer shown is the one dispatch would rent for a job of
`gpu_count` GPUs with the same save, restore and notice times.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime

from ..catalog import PROVIDER_NOTICE_S
from ..catalog.listing import list_offers, offers_json, usd_per_gpu_hour
from ..control.placement import rank_placement, with_measured
from ..core.errors import OrbitError
from ..core.offers import Offer
from ..policy.offer_choice import RESTORE_PRIOR_S, NoOfferMatches

RANKED_BY = "usd_per_useful_pflop"


def _check_inputs(save_s: float, restore_s: float | None, notice_s: float | None, gpu_count: int) -> None:
    for name, v in (("save_s", save_s), ("restore_s", restore_s), ("notice_s", notice_s)):
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and math.isfinite(v) and v >= 0):
            raise OrbitError(f"{name} = {v!r} is not a number of seconds >= 0", field=name, value=v,
                             fix=f"e.g. --{name.replace('_s', '').replace('_', '-')}-seconds 60")
    if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or gpu_count < 1:
        raise OrbitError(f"gpu count {gpu_count!r} is not an integer >= 1", field="gpu_count", value=gpu_count,
                         fix="e.g. --gpu-count 8")


def offers_document(*, save_s: float, gpu: str | None = None, max_price: float | None = None, gpu_count: int = 1,
                    restore_s: float | None = None, notice_s: float | None = None,
                    observed: Mapping | None = None, measured: Mapping | None = None,
                    at: datetime | None = None, trends=None) -> dict:
    """What `orbit offers --json` prints: ``{"ranked_by", "inputs", "offers": [...], "not_ranked": [...]}``.

    ``save_s``: the durable save time (the CLI passes the ledger's median, as dispatch does);
    ``restore_s`` None: dispatch's prior; ``notice_s`` None: each provider's own notice.
    ``observed``/``measured``: the ledger's reclaims and probe TFLOPS per offer id.
    ``trends``: offers -> their trend choices (`control.trends.trend_choices` on the ledger),
    so the ranking uses a forecast where dispatch would (for a job of its default horizon).
    """
    _check_inputs(save_s, restore_s, notice_s, gpu_count)
    offers = list_offers(gpu=gpu, max_price_per_gpu_hour=max_price, at=at)
    restore = RESTORE_PRIOR_S if restore_s is None else restore_s
    notice = PROVIDER_NOTICE_S if notice_s is None else notice_s
    try:
        decision = rank_placement(offers, save_s=save_s, restore_s=restore, notice_s=notice, observed=observed,
                                  measured=measured, gpu_count=gpu_count,
                                  trends=trends(offers) if trends is not None else None)
        scored, inputs = list(decision.ranked), decision.inputs
    except NoOfferMatches as err:
        scored, inputs = [], {"save_s": save_s, "restore_s": restore,
                              "notice_s": dict(notice) if isinstance(notice, Mapping) else notice, "note": str(err)}
    rows = [_ranked_row(pos, x, row) for pos, (x, row) in
            enumerate(zip(scored, offers_json([x.offer for x in scored])), 1)]
    ranked_ids = {x.offer.offer_id for x in scored}
    rest = [o for o in with_measured(offers, measured) if o.offer_id not in ranked_ids]
    unranked = [{**row, "reason": _why_unranked(o, gpu_count)} for o, row in zip(rest, offers_json(rest))]
    return {"ranked_by": RANKED_BY, "inputs": {**inputs, "gpu_count": gpu_count}, "offers": rows,
            "not_ranked": unranked}


def _ranked_row(pos: int, scored, row: dict) -> dict:
    rec = scored.as_record()
    return {"rank": pos, **row, "usd_per_hour": rec["usd_per_hour"], "useful_tflops": rec["useful_tflops"],
            "goodput": rec["goodput"], "expected_reclaims_per_hour": rec["reclaims_per_hour"],
            "rate_source": rec["rate_source"], "notice_s": rec["notice_s"],
            "checkpoint_interval_s": rec["checkpoint_interval_s"], RANKED_BY: rec[RANKED_BY], "reason": rec["reason"]}


def _why_unranked(o: Offer, gpu_count: int) -> str:
    if usd_per_gpu_hour(o) is None:
        return "not ranked: no price for its market"
    if not o.effective_tflops:
        return "not ranked: no TFLOPS figure (spec or probe)"
    if o.gpu_count < gpu_count:
        return f"not ranked: {o.gpu_count} GPUs < {gpu_count} asked"
    return "not ranked: reclaimed too often to make progress"


def offers_table(doc: dict) -> str:
    """What `orbit offers` prints: a fixed-width table of the ranking, best first, each position with its reason."""
    rows, unranked, inputs = doc["offers"], doc["not_ranked"], doc["inputs"]
    if not rows and not unranked:
        return "no offers match"
    head = ("#", "offer", "gpu", "n", "market", "$/h", "tflops", "goodput", "reclaims/h", "$/useful-PFLOP", "reason")
    lines = [(str(r["rank"]), r["offer_id"], r["gpu"], str(r["gpu_count"]), r["market"], f"{r['usd_per_hour']:.4g}",
              f"{r['useful_tflops']:.4g}", f"{r['goodput']:.3f}", f"{r['expected_reclaims_per_hour']:.3g}",
              f"{r[RANKED_BY]:.4g}", r["reason"]) for r in rows]
    lines += [("-", r["offer_id"], r["gpu"], str(r["gpu_count"]), r["market"], "-", "-", "-", "-", "-", r["reason"])
              for r in unranked]
    widths = [max(len(x[i]) for x in (head, *lines)) for i in range(len(head) - 1)]
    out = ["  ".join(c.ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1] for line in (head, *lines)]
    legend = (f"ranked as dispatch ranks (control.placement.rank_placement): expected $ per useful PFLOP = $/h / "
              f"(TFLOPS x {inputs.get('gpu_count', 1)} GPU(s) used x goodput); goodput from the offer's reclaim rate "
              f"(ledger observations over the band prior), save {inputs.get('save_s')} s, restore "
              f"{inputs.get('restore_s')} s, notice {inputs.get('notice_s')}")
    return "\n".join([*out, "", f"{len(rows)} ranked, {len(unranked)} not ranked; {legend}"])
