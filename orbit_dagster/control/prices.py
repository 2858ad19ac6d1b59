"""Price feed: ticks into the ledger; running jobs whose offer crosses their max price flagged."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ..ledger import records as R
from ..settings import Settings
from .context import bundle_at
from .providers import provider_for


@dataclass
class PriceReport:
    ticks: int = 0
    flagged: list[dict] = field(default_factory=list)


def running_train_instances(ledger) -> list[dict]:
    """Metered training instances with their attempt's bundle (one row per instance)."""
    # Each instance's bundle: the newest of its job up to its attempt (as R.bundle_for), in
    # the same query rather than one query per instance.
    return ledger.rows(
        """SELECT i.instance_id, i.provider, i.offer_id, i.job_id, i.gpu_count, r.attempt, r.run_id,
                  b.path AS bundle, b.bundle_hash
           FROM instances i JOIN runs r ON r.instance_id = i.instance_id
           JOIN bundles b ON b.job_id = r.job_id AND b.attempt = (
               SELECT max(x.attempt) FROM bundles x WHERE x.job_id = r.job_id AND x.attempt <= r.attempt)
           WHERE i.stopped_at IS NULL AND i.purpose = 'train'""")


def ingest_prices(settings: Settings, since: datetime | None) -> PriceReport:
    """Ingest ticks for the offers of running instances, per provider; flag over-budget jobs."""
    ledger = settings.ledger()
    running = running_train_instances(ledger)
    report = PriceReport()
    specs = {row["bundle"]: bundle_at(row["bundle"], row["bundle_hash"]).spec for row in running}
    by_backend: dict[str, set[str]] = {}
    for row in running:
        by_backend.setdefault(specs[row["bundle"]].execution_request.backend_key, set()).add(row["offer_id"])
    rows = []
    for backend, offer_ids in by_backend.items():
        for tick in provider_for(settings, backend).price_feed(since, sorted(offer_ids)):
            rows.append({"offer_id": tick.offer_id, "ts": tick.ts, "usd_per_hour_spot": tick.usd_per_hour_spot,
                         "usd_per_hour_on_demand": tick.usd_per_hour_on_demand, "source": tick.source})
    if rows:
        ledger.commit({"price_ticks": rows})
    report.ticks = len(rows)
    flags = []
    for row in running:
        cap = specs[row["bundle"]].execution_request.max_price_per_gpu_hour
        if cap is None:
            continue
        latest = ledger.one("SELECT usd_per_hour_spot FROM price_ticks WHERE offer_id = ? ORDER BY ts DESC LIMIT 1",
                            [row["offer_id"]])
        if not latest or latest["usd_per_hour_spot"] is None:
            continue
        per_gpu = latest["usd_per_hour_spot"] / max(int(row["gpu_count"] or 1), 1)
        if per_gpu > cap and not ledger.scalar(
                "SELECT count(*) FROM events WHERE run_id = ? AND kind = 'price_above_max'", [row["run_id"]]):
            flags.append(R.event("price_above_max", job_id=row["job_id"], run_id=row["run_id"],
                                 instance_id=row["instance_id"], offer=row["offer_id"], usd_per_gpu_hour=per_gpu,
                                 max_price_per_gpu_hour=cap))
            report.flagged.append({"job_id": row["job_id"], "offer_id": row["offer_id"], "usd_per_gpu_hour": per_gpu,
                                   "max": cap})
    if flags:
        ledger.commit({"events": flags})
    return report
