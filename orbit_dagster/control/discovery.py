"""Offer discovery: ask each source for its shapes, diff against the stored catalog, record the change set.

Sources (`Settings.discovery`, ORBIT_DISCOVERY_PROVIDERS): `catalog` (the shipped GCE and AWS
price and advisor data, at `at`), and the providers themselves, each through its own
`list_offers`: `sim` (the embedded market's catalog), `ssh` (the inventory's hosts), `aws`
(EC2's `describe_instance_types` in the region, joined with the catalog, and its spot prices).

The stored catalog is `$ORBIT_HOME/catalog/offers.json` (written whole, by rename): every
source's offers (each row names its `source`) and how each source answered. A refresh diffs
each source's new offers against its previous ones (`catalog.listing.diff_catalogs`:
type_added/removed, offer_added/removed, price_changed) and records the change set in the
ledger (`catalog_refreshes`, `catalog_changes`, one transaction). A source that fails (an API
error, a network down) keeps its previous offers and is recorded as failed, so an outage is
never reported as every shape removed.

Nothing needs a restart to see a change: dispatch asks the providers for their offers at
every placement (`control.placement.rank_for`), so a shape gone from EC2 is not rented after
it is gone, and the stored catalog is re-read by whoever reads it (the `offer_catalog`
asset's check, `orbit advise`). `offers_in_use` names what the jobs not yet finished rely on:
the check fails when one of those offers is no longer listed.
"""
from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

from ..catalog.listing import diff_catalogs, list_offers, offers_json
from ..core.offers import ON_DEMAND_SUFFIX, Offer
from ..ledger import Ledger
from ..settings import Settings
from .observations import measured_tflops, observed_reclaims
from .providers import provider_for

BACKENDS = {"sim": "sim_host_process", "ssh": "ssh_rental_host_process", "aws": "aws_spot_host_process"}
FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")


def catalog_path(settings: Settings) -> Path:
    return settings.home / "catalog" / "offers.json"


def read_catalog(settings: Settings) -> dict | None:
    """The stored catalog (None before the first refresh)."""
    path = catalog_path(settings)
    return json.loads(path.read_text()) if path.exists() else None


def shapes(settings: Settings, source: str, at: datetime | None = None) -> list[Offer]:
    """What one source offers now (raises what its provider raises)."""
    if source == "catalog":
        ledger = settings.ledger()
        return list_offers(at=at, observed=observed_reclaims(ledger), measured=measured_tflops(ledger))
    return provider_for(settings, BACKENDS[source]).list_offers()


def refresh_catalog(settings: Settings, *, at: datetime | None = None, sources: tuple[str, ...] | None = None) -> dict:
    """Ask every source, diff, record, store; a report of what changed and what the jobs rely on."""
    ledger = settings.ledger()
    previous = read_catalog(settings)
    old_rows = (previous or {}).get("offers", [])
    old_sources = (previous or {}).get("sources", {})
    refresh_id, now = uuid.uuid4().hex, datetime.now(timezone.utc).timestamp()
    rows, answered, changes = [], {}, []
    for source in sources or settings.discovery:
        before = [r for r in old_rows if _source_of(r) == source]
        try:
            found = [{**r, "source": source} for r in offers_json(shapes(settings, source, at))]
        except Exception as exc:  # noqa: BLE001 - any failure of a source keeps its previous offers
            answered[source] = {"status": "failed", "offers": len(before), "error": f"{type(exc).__name__}: {exc}"[:500]}
            rows += before
            continue
        answered[source] = {"status": "ok", "offers": len(found), "error": None}
        rows += found
        if source in old_sources or before:  # a source's first answer is its baseline, not a change
            changes += [{**c, "source": source} for c in diff_catalogs(before, found)]
    for source, old in old_sources.items():  # a source no longer asked keeps its offers, as they were
        if source not in answered:
            rows += [r for r in old_rows if _source_of(r) == source]
            answered[source] = {**old, "status": "not asked"}
    _record(ledger, refresh_id, now, answered, changes)
    _store(settings, rows, answered, at)
    kinds: dict[str, int] = {}
    for c in changes:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    in_use = offers_in_use(ledger)
    return {"refresh_id": refresh_id, "offers": len(rows), "first_refresh": previous is None, "changes": kinds,
            "change_set": changes, "sources": answered, "cheapest": rows[0]["offer_id"] if rows else None,
            "in_use": in_use, "missing_in_use": missing_offers(in_use, rows)}


def _source_of(row: dict) -> str:
    """A stored row's source (a catalog stored before sources were recorded: the shipped catalog)."""
    return row.get("source") or "catalog"


def _record(ledger: Ledger, refresh_id: str, now: float, answered: dict, changes: list[dict]) -> None:
    keep = ("kind", "provider", "offer_id", "instance_type", "gpu", "region", "zone", "market", "old_usd_per_gpu_hour",
            "new_usd_per_gpu_hour", "change_pct", "source")
    ledger.commit({
        "catalog_refreshes": [{"refresh_id": refresh_id, "source": s, "ts": now, "status": a["status"],
                               "offers": a["offers"], "error": a.get("error")} for s, a in answered.items()],
        "catalog_changes": [{"change_id": f"{refresh_id}:{i}", "refresh_id": refresh_id, "ts": now,
                             **{k: c.get(k) for k in keep}} for i, c in enumerate(changes)],
    })


def _store(settings: Settings, rows: list[dict], answered: dict, at: datetime | None) -> None:
    path = catalog_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"refreshed_at": (at or datetime.now(timezone.utc)).isoformat(), "sources": answered,
                               "offers": rows}, default=str))
    tmp.replace(path)


def offers_in_use(ledger: Ledger) -> list[dict]:
    """(job, offer) pairs the work not yet finished relies on: the current attempt's offer of every
    unfinished job, and the offer of every instance still running (an evaluation's too)."""
    marks = ", ".join("?" for _ in FINISHED)
    rows = ledger.rows(
        f"""SELECT j.job_id, r.offer_id FROM jobs j JOIN runs r ON r.job_id = j.job_id AND r.attempt = j.attempt
            WHERE j.state NOT IN ({marks}) AND r.offer_id IS NOT NULL
            UNION
            SELECT job_id, offer_id FROM instances WHERE stopped_at IS NULL AND offer_id IS NOT NULL""", list(FINISHED))
    pairs = sorted({(r["offer_id"], r["job_id"] or "") for r in rows})
    return [{"job_id": job or None, "offer_id": offer} for offer, job in pairs]


def missing_offers(in_use: list[dict], rows: list[dict]) -> list[dict]:
    """The pairs of `in_use` whose offer the catalog `rows` no longer lists; an offer of a provider
    the catalog holds nothing of is not judged (nothing was asked about it)."""
    listed = {r["offer_id"] for r in rows}
    providers = {r["provider"] for r in rows}
    out = []
    for pair in in_use:
        base = pair["offer_id"].removesuffix(ON_DEMAND_SUFFIX)  # the same shape rented on demand
        if base.split(":", 1)[0] in providers and base not in listed:
            out.append(pair)
    return out
