"""Price feed: ticks into the ledger; running jobs whose offer crosses their max price flagged."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ..core.bundle import JobBundle
from ..ledger import records as R
from .providers import provider_for
from .settings import Settings


@dataclass
class PriceReport:
    ticks: int = 0
    flagged: list[dict] = field(default_factory=list)


def ingest_prices(settings: Settings, since: datetime | None) -> PriceReport:
    """Ingest ticks for the offers of running instances, per provider; flag over-budget jobs."""
    ledger = settings.ledger()
    running = ledger.rows(
        """SELECT u.instance_id, u.provider, u.offer_id, u.job_id, u.gpu_count, r.attempt, b.path AS bundle
           FROM instance_usage u JOIN run_status r ON r.instance_id = u.instance_id
           JOIN bundles b ON b.job_id = u.job_id AND b.attempt <= r.attempt
           WHERE u.running AND u.purpose = 'train'
           QUALIFY row_number() OVER (PARTITION BY u.instance_id ORDER BY b.attempt DESC) = 1"""
    )
    report = PriceReport()
    by_backend: dict[str, set[str]] = {}
    for row in running:
        key = JobBundle.load(row["bundle"], verify=False).spec.execution_request.backend_key
        by_backend.setdefault(key, set()).add(row["offer_id"])
    rows = []
    for backend, offer_ids in by_backend.items():
        for tick in provider_for(settings, backend).price_feed(since, sorted(offer_ids)):
            rows.append({"offer_id": tick.offer_id, "ts": tick.ts, "usd_per_hour_spot": tick.usd_per_hour_spot,
                         "usd_per_hour_on_demand": tick.usd_per_hour_on_demand, "source": tick.source})
    if rows:
        ledger.commit({"price_ticks": rows})
    report.ticks = len(rows)
    flagged_before = {(r["job_id"], r["run_id"]) for r in ledger.rows(
        "SELECT job_id, run_id FROM events WHERE kind = 'price_above_max'")}
    flags = []
    for row in running:
        spec = JobBundle.load(row["bundle"], verify=False).spec
        cap = spec.execution_request.max_price_per_gpu_hour
        if cap is None:
            continue
        latest = ledger.rows("SELECT usd_per_hour_spot FROM price_ticks WHERE offer_id = ? ORDER BY ts DESC LIMIT 1",
                             [row["offer_id"]])
        if not latest or latest[0]["usd_per_hour_spot"] is None:
            continue
        per_gpu = latest[0]["usd_per_hour_spot"] / max(int(row["gpu_count"] or 1), 1)
        run_id = R.run_id_for(row["job_id"], int(row["attempt"]))
        if per_gpu > cap and (row["job_id"], run_id) not in flagged_before:
            flags.append(R.event("price_above_max", job_id=row["job_id"], run_id=run_id, instance_id=row["instance_id"],
                                 offer=row["offer_id"], usd_per_gpu_hour=per_gpu, max_price_per_gpu_hour=cap))
            report.flagged.append({"job_id": row["job_id"], "offer_id": row["offer_id"], "usd_per_gpu_hour": per_gpu,
                                   "max": cap})
    if flags:
        ledger.commit({"events": flags})
    return report
