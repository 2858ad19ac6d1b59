"""The offer listing: every provider's offers in one unit, filtered, with observations folded in.

A listing, not a ranking: offers come in offer-id order. The order offers are rented in is
dispatch's (`control.placement.rank_placement`, what `orbit offers` prints). The $ per
effective TFLOP-hour stays a figure of each row (`offers_json`): the offer's market price per
GPU-hour (spot where the offer is spot, else on-demand) over its effective TFLOPS (measured
by the probe when known, else the Epoch spec).
"""
from __future__ import annotations

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
    """Every offer of `providers` at `at`, filtered, in offer-id order.

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
    return sorted(out, key=lambda o: o.offer_id)


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


# ---- JSON rows (the CLI, the discovery snapshot) ---------------------------------------

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
