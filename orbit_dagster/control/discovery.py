"""Offer discovery: refresh the catalog, record what changed since the last refresh.

The catalog snapshot lives in `$ORBIT_HOME/catalog/offers.json` (written by rename); each
change (new or removed instance types and offers, price moves) becomes a `catalog_change`
event in the ledger, so "when did H100 spot in us-central1 get cheaper" is a SQL query.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

from ..catalog.listing import diff_catalogs, list_offers, offers_json
from ..ledger import records as R
from ..settings import Settings
from .observations import measured_tflops, observed_reclaims


def refresh_catalog(settings: Settings, *, at: datetime | None = None) -> dict:
    ledger = settings.ledger()
    offers = list_offers(at=at, observed=observed_reclaims(ledger), measured=measured_tflops(ledger))
    rows = offers_json(offers)
    path = settings.home / "catalog" / "offers.json"
    previous = json.loads(path.read_text())["offers"] if path.exists() else None
    changes = diff_catalogs(previous, rows) if previous is not None else []
    if changes:
        ledger.commit({"events": [R.event("catalog_change", **{("change" if k == "kind" else k): v for k, v in c.items()})
                                  for c in changes]})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"refreshed_at": (at or datetime.now()).isoformat(), "offers": rows}, default=str))
    tmp.replace(path)
    kinds: dict[str, int] = {}
    for c in changes:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    return {"offers": len(rows), "first_refresh": previous is None, "changes": kinds,
            "cheapest": rows[0]["offer_id"] if rows else None}
