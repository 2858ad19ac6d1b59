"""GCE GPU prices: weekly change points replayed as a step function.

The source (Cyclenerd's pricing.yml, all weekly revisions) lists, per machine type and
region, the on-demand (`hour`) and spot (`hour_spot`) $/h of the whole machine each time
either changed (`event` = first / change / removed). A price holds from its change point
until the next one; `removed` ends it. GCE publishes no interruption data, so spot
reliability is a prior from the AWS advisor (`aws.reliability_prior`).
"""
from __future__ import annotations

import bisect
import csv
import functools
import gzip
import io
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from orbit_dagster.catalog import CatalogError, as_utc, shipped_file
from orbit_dagster.catalog import price as parse_price
from orbit_dagster.catalog.aws import reliability_from_rate, reliability_prior
from orbit_dagster.catalog.gpus import normalise_gpu_name, offer_spec_fields
from orbit_dagster.core.offers import Offer

PRICES_FILE = "gce_gpu_prices.csv.gz"
SNAPSHOTS_FILE = "gce_gpu_price_snapshots.csv"
TIME_COLUMN = "snapshot_commit_time_utc"
PRICE_COLUMNS = (TIME_COLUMN, "instance_type", "gpu_model", "gpu_count", "vcpus", "ram_gb", "region",
                 "hour", "hour_spot", "event")

# Machine family -> GPU. The family is authoritative: a few 2022 rows label a2-ultragpu
# (always 80 GB) with the 40 GB key `a100`, and `removed` rows carry no gpu_model at all.
GCE_FAMILIES = {
    "a2-highgpu": "A100-40G", "a2-megagpu": "A100-40G", "a2-ultragpu": "A100-80G",
    "a3-highgpu": "H100", "a3-megagpu": "H100", "a3-edgegpu": "H100", "a3-ultragpu": "H200",
    "g2-standard": "L4", "g4-standard": "RTX-PRO-6000",
}


@dataclass(frozen=True)
class PriceChange:
    """One change point: the machine's $/h from `time` until the next change of its (type, region)."""

    time: datetime
    instance_type: str
    gpu: str
    gpu_count: float | None  # GCE sells fractions of an RTX PRO 6000 (0.125 ...)
    vcpus: float | None
    ram_gb: float | None
    region: str
    usd_per_hour: float | None
    usd_per_hour_spot: float | None
    event: str


def gce_gpu(instance_type: str, gpu_model: str = "") -> str:
    """Canonical GPU of a GCE machine type (family first, then the row's accelerator key)."""
    family = instance_type.rsplit("-", 1)[0]
    if family in GCE_FAMILIES:
        return GCE_FAMILIES[family]
    if gpu_model:
        return normalise_gpu_name(gpu_model)
    raise CatalogError(f"GCE machine type {instance_type!r} has no known GPU", field="instance_type",
                       value=instance_type, fix=f"add its family to GCE_FAMILIES ({', '.join(GCE_FAMILIES)})")


@functools.lru_cache(maxsize=4096)  # ~300 distinct snapshot times repeat over 17k rows
def parse_time(text: str) -> datetime:
    """ISO-8601 with any offset -> aware UTC (the source mixes +00:00 and +02:00)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)


def _num(text: str | None, *, where: str = "", field: str = "number") -> float | None:
    return parse_price(text, where=where, field=field) if text not in (None, "") else None


def _open_text(path: Path) -> io.TextIOBase:
    if Path(path).suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, newline="", encoding="utf-8")


def read_price_changes(path: Path) -> list[PriceChange]:
    """Parse the change-point CSV (the raw file or the shipped gzip'd subset), sorted by time."""
    out = []
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in PRICE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise CatalogError(f"{Path(path).name} lacks columns {missing}", field="columns", value=missing,
                               fix="pass gce_gpu_price_changes.csv")
        for n, r in enumerate(reader, 2):
            if r["event"] not in ("first", "change", "removed"):
                raise CatalogError(f"{Path(path).name} line {n}: unknown event {r['event']!r}", field="event",
                                   value=r["event"], fix="first, change or removed")
            where = f"{Path(path).name} line {n}"
            try:
                when = parse_time(r[TIME_COLUMN] or "")
            except ValueError:
                raise CatalogError(f"{where}: {TIME_COLUMN} {str(r[TIME_COLUMN])[:40]!r} is not an ISO-8601 time",
                                   field=TIME_COLUMN, value=str(r[TIME_COLUMN])[:40],
                                   fix="e.g. 2024-05-01T00:00:00+00:00") from None
            nums = {k: _num(r[k], where=where, field=k) for k in ("gpu_count", "vcpus", "ram_gb", "hour", "hour_spot")}
            out.append(PriceChange(when, r["instance_type"], gce_gpu(r["instance_type"], r["gpu_model"]),
                                   nums["gpu_count"], nums["vcpus"], nums["ram_gb"], r["region"], nums["hour"],
                                   nums["hour_spot"], r["event"]))
    return sorted(out, key=lambda c: (c.time, c.instance_type, c.region))


def read_snapshots(path: Path) -> list[datetime]:
    """Times the source was sampled (one per pricing.yml revision), sorted, UTC."""
    with _open_text(path) as f:
        return sorted(parse_time(r[TIME_COLUMN]) for r in csv.DictReader(f))


@functools.lru_cache(maxsize=1)
def _changes() -> tuple[PriceChange, ...]:
    return tuple(read_price_changes(shipped_file(PRICES_FILE)))


@functools.lru_cache(maxsize=1)
def _snapshots() -> tuple[datetime, ...]:
    return tuple(read_snapshots(shipped_file(SNAPSHOTS_FILE)))


def price_history(instance_type: str, region: str) -> list[tuple[datetime, float | None, float | None]]:
    """Step function of one machine's (time, on-demand $/h, spot $/h); (t, None, None) = removed."""
    rows = [c for c in _changes() if c.instance_type == instance_type and c.region == region]
    if not rows:
        types = sorted({c.instance_type for c in _changes()})
        if instance_type not in types:
            raise CatalogError(f"no GCE price history for machine type {instance_type!r}", field="instance_type",
                               value=instance_type, fix=f"use one of {', '.join(types)}")
        regions = sorted({c.region for c in _changes() if c.instance_type == instance_type})
        raise CatalogError(f"{instance_type} has no prices in region {region!r}", field="region", value=region,
                           fix=f"use one of {', '.join(regions)}")
    return [(c.time, c.usd_per_hour, c.usd_per_hour_spot) for c in rows]


def price_at(instance_type: str, region: str, at: datetime) -> tuple[float | None, float | None]:
    """(on-demand $/h, spot $/h) of one machine at `at`: the step function evaluated; (None, None) if not sold."""
    at = as_utc(at)
    hist = price_history(instance_type, region)
    i = bisect.bisect_right([t for t, _, _ in hist], at)
    return (None, None) if i == 0 else hist[i - 1][1:]


def gce_offers(at: datetime | None = None) -> list[Offer]:
    """Offers in force at `at` (default: the latest snapshot), one per (machine type, region).

    Skipped: removed machines, and fractional-GPU shapes (g4 slices of one RTX PRO 6000)
    because an Offer counts whole GPUs. Spot offers carry the GPU's reliability prior;
    machines without a spot price are on-demand offers with reliability 1.
    """
    at = as_utc(at)
    if at is not None and at < _changes()[0].time:
        raise CatalogError(f"at={at.isoformat()} precedes the GCE price data", field="at", value=at,
                           fix=f"pass a time on or after {_changes()[0].time.isoformat()}")
    state: dict[tuple[str, str], PriceChange] = {}
    for c in _changes():
        if at is None or c.time <= at:
            state[(c.instance_type, c.region)] = c
    as_of = max(t for t in _snapshots() if at is None or t <= at)
    offers = []
    for (itype, region), c in sorted(state.items()):
        if c.event == "removed" or c.gpu_count is None or c.gpu_count < 1 or c.gpu_count != int(c.gpu_count):
            continue
        count = int(c.gpu_count)
        per_gpu_s = {"usd_per_gpu_second_on_demand": _per_gpu_second(c.usd_per_hour, count),
                     "usd_per_gpu_second_spot": _per_gpu_second(c.usd_per_hour_spot, count)}
        offers.append(Offer(offer_id=f"gce:{itype}:{region}", provider="gce", instance_type=itype, gpu=c.gpu,
                            gpu_count=count, region=region, price_as_of=as_of, **per_gpu_s,
                            **offer_spec_fields(c.gpu), **_reliability(c, at)))
    return offers


def _per_gpu_second(usd_per_hour: float | None, gpu_count: int) -> float | None:
    return None if usd_per_hour is None else usd_per_hour / gpu_count / 3600


def _reliability(c: PriceChange, at: datetime | None) -> dict:
    if c.usd_per_hour_spot is None:
        return {"spot": False, "reliability": 1.0, "reclaims_per_hour": 0.0,
                "reliability_source": "on-demand (no spot price): not reclaimed"}
    band, label = reliability_prior(c.gpu, at)
    return {"spot": True, "reclaims_per_hour": band.reclaims_per_hour,
            "reliability": reliability_from_rate(band.reclaims_per_hour), "reliability_source": label}
