"""The offer catalog: every provider's offers in one unit, ranked by $ per effective TFLOP-hour.

Ranking price: the offer's market price per GPU-hour (spot where the offer is spot,
else on-demand) divided by its effective TFLOPS (measured by the probe when known, else
the Epoch spec). Offers without a price or a TFLOPS figure cannot be ranked and come
last, by offer id, so the order is total and deterministic.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime

from orbit_dagster.catalog import CatalogError
from orbit_dagster.catalog.aws import SpotPrice, aws_offers, reliability_from_rate
from orbit_dagster.catalog.gce import gce_offers
from orbit_dagster.catalog.gpus import gpu_family
from orbit_dagster.core.offers import Offer

PROVIDERS = ("gce", "aws")
# Below one hour of exposure the ledger says too little; the band or prior is kept instead.
MIN_EXPOSURE_HOURS = 1.0


def usd_per_gpu_hour(offer: Offer) -> float | None:
    """The offer's own market price per GPU-hour: spot for spot offers, else on-demand."""
    per_s = offer.usd_per_gpu_second_spot if offer.spot else offer.usd_per_gpu_second_on_demand
    return None if per_s is None else per_s * 3600


def usd_per_effective_tflop_hour(offer: Offer) -> float | None:
    price, tflops = usd_per_gpu_hour(offer), offer.effective_tflops
    return None if price is None or not tflops else price / tflops


def _rank_key(offer: Offer) -> tuple:
    v = usd_per_effective_tflop_hour(offer)
    return (v is None, v or 0.0, offer.offer_id)


def apply_observations(offer: Offer, observed: Mapping | None = None, measured: Mapping | None = None) -> Offer:
    """Offer with the ledger's reclaim rate and the probe's TFLOPS folded in.

    `observed[offer_id] = (reclaims, exposure_hours)` replaces the band/prior of a spot
    offer once exposure reaches MIN_EXPOSURE_HOURS (rate = reclaims / hours).
    `measured[offer_id or gpu] = TFLOPS per GPU`; an offer-specific figure wins over the model's.
    """
    update: dict = {}
    if measured:
        tflops = measured.get(offer.offer_id, measured.get(offer.gpu))
        if tflops is not None:
            if not isinstance(tflops, (int, float)) or not math.isfinite(tflops) or tflops <= 0:
                raise CatalogError(f"measured TFLOPS for {offer.offer_id} is {tflops!r}", field="measured",
                                   value=tflops, fix="a positive number of TFLOPS per GPU")
            update["measured_tflops"] = float(tflops)
    seen = (observed or {}).get(offer.offer_id)
    if seen is not None and offer.spot:
        reclaims, hours = _check_observed(offer.offer_id, seen)
        if hours >= MIN_EXPOSURE_HOURS:
            rate = reclaims / hours
            update.update(reclaims_per_hour=rate, reliability=reliability_from_rate(rate),
                          reliability_source=f"observed: {reclaims:g} reclaims in {hours:g} h (ledger)")
    return offer.model_copy(update=update) if update else offer


def _check_observed(offer_id: str, seen: object) -> tuple[float, float]:
    ok = isinstance(seen, (tuple, list)) and len(seen) == 2 and all(
        isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in seen)
    if not ok:
        raise CatalogError(f"observed[{offer_id!r}] is {seen!r}", field="observed", value=seen,
                           fix="(reclaims, exposure_hours), both non-negative numbers")
    return float(seen[0]), float(seen[1])


def list_offers(*, gpu: str | None = None, max_price_per_gpu_hour: float | None = None,
                providers: Iterable[str] = PROVIDERS, at: datetime | None = None,
                observed: Mapping | None = None, measured: Mapping | None = None,
                aws_spot_prices: list[SpotPrice] | None = None,
                aws_on_demand_usd_per_hour: dict[tuple[str, str], float] | None = None) -> list[Offer]:
    """Every offer of `providers` at `at`, filtered, sorted by $ per effective TFLOP-hour.

    gpu: a model or family (`H100`, `A100` = both sizes, `a100-80gb`); unknown names raise
    UnknownGpu listing the known ones. max_price_per_gpu_hour: keeps offers whose market
    price per GPU-hour is known and at most this. aws_*: live AWS prices from a provider.
    """
    providers = tuple(providers)
    bad = [p for p in providers if p not in PROVIDERS]
    if bad or not providers:
        raise CatalogError(f"unknown providers {bad or providers!r}", field="providers", value=providers,
                           fix=f"choose from {', '.join(PROVIDERS)}")
    if max_price_per_gpu_hour is not None and not (
            isinstance(max_price_per_gpu_hour, (int, float)) and max_price_per_gpu_hour > 0):
        raise CatalogError(f"max price {max_price_per_gpu_hour!r} is not a positive $/GPU-hour",
                           field="max_price_per_gpu_hour", value=max_price_per_gpu_hour, fix="e.g. --max-price 2.5")
    wanted = set(gpu_family(gpu)) if gpu is not None else None
    offers: list[Offer] = []
    if "gce" in providers:
        offers += gce_offers(at)
    if "aws" in providers:
        offers += aws_offers(at, aws_spot_prices, aws_on_demand_usd_per_hour)
    out = []
    for o in offers:
        if wanted is not None and o.gpu not in wanted:
            continue
        o = apply_observations(o, observed, measured)
        price = usd_per_gpu_hour(o)
        if max_price_per_gpu_hour is not None and (price is None or price > max_price_per_gpu_hour):
            continue
        out.append(o)
    return sorted(out, key=_rank_key)


# ---- discovery diffs -------------------------------------------------------------------

def _as_row(o: Offer | Mapping) -> dict:
    """Offer or an `offers_json` row -> the fields a diff compares."""
    d = offers_json([o])[0] if isinstance(o, Offer) else dict(o)
    missing = [k for k in ("offer_id", "provider", "instance_type") if k not in d]
    if missing:
        raise CatalogError(f"catalog row lacks {missing}", field="offer", value=d.get("offer_id"),
                           fix="pass Offer objects or rows from offers_json")
    return d


def diff_catalogs(old: Iterable[Offer | Mapping], new: Iterable[Offer | Mapping], *,
                  min_change_pct: float = 0.0) -> list[dict]:
    """Events between two catalogs, for the discovery schedule to record.

    kinds: type_added / type_removed (a provider's instance type appears or vanishes
    everywhere), offer_added / offer_removed (one offer id), price_changed (per market,
    on_demand or spot, when the $/GPU-hour moves by more than `min_change_pct` percent, or
    appears/disappears). Sorted by kind, then offer id / type, then market.
    """
    a = {r["offer_id"]: r for r in map(_as_row, old)}
    b = {r["offer_id"]: r for r in map(_as_row, new)}
    types_a = {(r["provider"], r["instance_type"]) for r in a.values()}
    types_b = {(r["provider"], r["instance_type"]) for r in b.values()}
    events = [{"kind": k, "provider": p, "instance_type": t}
              for k, ts in (("type_added", types_b - types_a), ("type_removed", types_a - types_b)) for p, t in ts]
    ident = ("offer_id", "provider", "instance_type", "gpu", "region", "zone")
    events += [{"kind": "offer_added", **{k: b[i].get(k) for k in ident}} for i in b.keys() - a.keys()]
    events += [{"kind": "offer_removed", **{k: a[i].get(k) for k in ident}} for i in a.keys() - b.keys()]
    for i in sorted(a.keys() & b.keys()):
        for market in ("on_demand", "spot"):
            key = f"usd_per_gpu_hour_{market}"
            before, after = a[i].get(key), b[i].get(key)
            if before == after:
                continue
            pct = None if before in (None, 0) or after is None else 100 * (after - before) / before
            if pct is not None and abs(pct) <= min_change_pct:
                continue
            events.append({"kind": "price_changed", "offer_id": i, "provider": b[i]["provider"],
                           "instance_type": b[i]["instance_type"], "market": market,
                           "old_usd_per_gpu_hour": before, "new_usd_per_gpu_hour": after,
                           "change_pct": None if pct is None else round(pct, 3)})
    return sorted(events, key=lambda e: (e["kind"], e.get("offer_id") or "", e["provider"], e["instance_type"],
                                         e.get("market", "")))


# ---- output ----------------------------------------------------------------------------

def _sig(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def offers_json(offers: Iterable[Offer]) -> list[dict]:
    """JSON-ready rows (plain types, $ per GPU-hour rounded to 6 significant digits)."""
    rows = []
    for o in offers:
        od, sp = o.usd_per_gpu_second_on_demand, o.usd_per_gpu_second_spot
        rows.append({
            "offer_id": o.offer_id, "provider": o.provider, "instance_type": o.instance_type, "gpu": o.gpu,
            "gpu_count": o.gpu_count, "gpu_memory_gb": o.gpu_memory_gb, "region": o.region, "zone": o.zone,
            "market": "spot" if o.spot else "on_demand",
            "usd_per_gpu_hour_on_demand": _sig(None if od is None else od * 3600),
            "usd_per_gpu_hour_spot": _sig(None if sp is None else sp * 3600),
            "usd_per_gpu_second_on_demand": od, "usd_per_gpu_second_spot": sp,
            "spec_tflops": o.spec_tflops_bf16, "measured_tflops": o.measured_tflops,
            "effective_tflops": o.effective_tflops,
            "usd_per_effective_tflop_hour": _sig(usd_per_effective_tflop_hour(o)),
            "memory_bandwidth_gbps": o.memory_bandwidth_gbps, "interruption_band": o.interruption_band,
            "reclaims_per_hour": _sig(o.reclaims_per_hour), "reliability": _sig(o.reliability),
            "reliability_source": o.reliability_source,
            "price_as_of": o.price_as_of.isoformat() if o.price_as_of else None,
        })
    return rows


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def offers_table(offers: Iterable[Offer]) -> str:
    """Fixed-width table for people, with a legend; the row order is the given order."""
    head = ("#", "offer", "gpu", "n", "$/gpu-h od", "$/gpu-h spot", "tflops", "$/tflop-h", "band", "reliability")
    rows = []
    for n, r in enumerate(offers_json(offers), 1):
        tflops = "-" if r["effective_tflops"] is None else (
            f"{r['effective_tflops']:.1f}" + ("m" if r["measured_tflops"] is not None else "s"))
        src = r["reliability_source"] or ""
        rel = "-" if r["reliability"] is None else f"{r['reliability']:.5f}" + (
            " prior" if src.startswith("prior") else " obs" if src.startswith("observed") else "")
        rows.append((str(n), r["offer_id"], r["gpu"], str(r["gpu_count"]), _money(r["usd_per_gpu_hour_on_demand"]),
                     _money(r["usd_per_gpu_hour_spot"]), tflops, _money(r["usd_per_effective_tflop_hour"]),
                     r["interruption_band"] or "-", rel))
    if not rows:
        return "no offers match"
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *rows)]
    legend = ("sorted by $ per effective TFLOP-hour (market price: spot where offered, else on-demand); "
              "tflops per GPU: s = spec (Epoch, dense BF16), m = measured; "
              "reliability = P(no reclaim in 1 h): prior = from the AWS advisor median, obs = from the ledger")
    return "\n".join([*lines, "", f"{len(rows)} offers; {legend}"])


#: Reclaim notice per provider: AWS's instance-action warning, GCE's preemption notice.
PROVIDER_NOTICE_S = {"aws": 120.0, "gce": 30.0}
#: What dispatch assumes before the ledger has measured a save (control/placement.py) and the
#: restore time it ranks with; `orbit offers` uses the same unless told otherwise.
DISPATCH_SAVE_S = 1.0
DISPATCH_RESTORE_S = 10.0
RANKED_BY = "usd_per_useful_pflop"


def ranked_offers(offers: list[Offer], *, observed: Mapping | None = None, save_s: float = DISPATCH_SAVE_S,
                  restore_s: float = DISPATCH_RESTORE_S, notice_s: float | Mapping[str, float] | None = None,
                  gpu_count: int = 1) -> tuple[list[dict], list[dict], dict]:
    """(ranked rows, rows that cannot be ranked, inputs): the ranking dispatch makes, with a reason per position.

    Ranks with ``policy.offer_choice.rank_offers`` given what dispatch gives it: a reclaim-rate
    book updated with the ledger's observed reclaims and exposure per offer, the save and
    restore seconds, and each provider's notice.
    """
    from orbit_dagster.policy.offer_choice import NoOfferMatches, rank_offers
    from orbit_dagster.policy.reclaim_rate import RateBook

    book = RateBook()
    by_id = {o.offer_id: o for o in offers}
    for offer_id, seen in (observed or {}).items():
        if offer_id in by_id and by_id[offer_id].spot:
            reclaims, hours = _check_observed(offer_id, seen)
            book.for_offer(by_id[offer_id]).observe(int(round(reclaims)), hours * 3600.0)
    notice = PROVIDER_NOTICE_S if notice_s is None else notice_s
    try:
        decision = rank_offers(offers, gpu="any", gpu_count=gpu_count, save_s=save_s, restore_s=restore_s,
                               notice_s=notice, rates=book)
        scored, inputs = list(decision.ranked), decision.inputs
    except NoOfferMatches as err:
        scored, inputs = [], {"save_s": save_s, "restore_s": restore_s,
                              "notice_s": dict(notice) if isinstance(notice, Mapping) else notice, "note": str(err)}
    ranked_ids = {x.offer.offer_id for x in scored}
    rows = []
    for pos, (x, row) in enumerate(zip(scored, offers_json([x.offer for x in scored])), 1):
        rec = x.as_record()
        rows.append({"rank": pos, **row, "usd_per_hour": rec["usd_per_hour"], "useful_tflops": rec["useful_tflops"],
                     "goodput": rec["goodput"], "expected_reclaims_per_hour": rec["reclaims_per_hour"],
                     "rate_source": rec["rate_source"], "notice_s": rec["notice_s"],
                     "checkpoint_interval_s": rec["checkpoint_interval_s"], RANKED_BY: rec[RANKED_BY],
                     "reason": rec["reason"]})
    rest = [o for o in offers if o.offer_id not in ranked_ids]
    unranked = [{**row, "reason": _why_unranked(o, gpu_count)} for o, row in zip(rest, offers_json(rest))]
    return rows, unranked, {**inputs, "gpu_count": gpu_count}


def _why_unranked(o: Offer, gpu_count: int) -> str:
    if usd_per_gpu_hour(o) is None:
        return "not ranked: no price for its market"
    if not o.effective_tflops:
        return "not ranked: no TFLOPS figure (spec or probe)"
    if o.gpu_count < gpu_count:
        return f"not ranked: {o.gpu_count} GPUs < {gpu_count} asked"
    return "not ranked: reclaimed too often to make progress"


def ranked_table(rows: list[dict], unranked: list[dict], inputs: dict) -> str:
    """Fixed-width table of the ranking, best first, each position with its reason."""
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
    notice = inputs.get("notice_s")
    legend = (f"ranked as dispatch ranks (policy.offer_choice.rank_offers): expected $ per useful PFLOP = $/h / "
              f"(TFLOPS x {inputs.get('gpu_count', 1)} GPU(s) used x goodput); goodput from the offer's reclaim rate "
              f"(ledger observations over the band prior), save {inputs.get('save_s')} s, restore "
              f"{inputs.get('restore_s')} s, notice {notice}")
    return "\n".join([*out, "", f"{len(rows)} ranked, {len(unranked)} not ranked; {legend}"])


def offers_command(gpu: str | None = None, max_price: float | None = None, as_json: bool = False, *,
                   observed: Mapping | None = None, measured: Mapping | None = None,
                   at: datetime | None = None, save_s: float | None = None, restore_s: float | None = None,
                   notice_s: float | None = None, gpu_count: int = 1) -> str:
    """Exactly what `orbit offers [--gpu NAME] [--max-price USD] [--gpu-count N] [--json]` prints.

    The order is dispatch's (``ranked_offers``); the first offer shown is the one dispatch would
    rent for a job of ``gpu_count`` GPUs. ``notice_s`` None: each provider's own notice.
    JSON form: ``{"ranked_by": "usd_per_useful_pflop", "inputs": {...}, "offers": [...],
    "not_ranked": [...]}``, each offer with its ``rank`` and ``reason``.
    """
    for name, v in (("save_s", save_s), ("restore_s", restore_s), ("notice_s", notice_s)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise CatalogError(f"{name} = {v!r} is not a number of seconds >= 0", field=name, value=v,
                               fix=f"e.g. --{name.replace('_s', '').replace('_', '-')}-seconds 60")
    if isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or gpu_count < 1:
        raise CatalogError(f"gpu count {gpu_count!r} is not an integer >= 1", field="gpu_count", value=gpu_count,
                           fix="e.g. --gpu-count 8")
    offers = list_offers(gpu=gpu, max_price_per_gpu_hour=max_price, at=at, measured=measured)
    rows, unranked, inputs = ranked_offers(
        offers, observed=observed, save_s=DISPATCH_SAVE_S if save_s is None else save_s,
        restore_s=DISPATCH_RESTORE_S if restore_s is None else restore_s, notice_s=notice_s, gpu_count=gpu_count)
    if as_json:
        return json.dumps({"ranked_by": RANKED_BY, "inputs": inputs, "offers": rows, "not_ranked": unranked}, indent=2)
    return ranked_table(rows, unranked, inputs)
