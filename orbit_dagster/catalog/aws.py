"""AWS tables: GPU instance types, the Spot Instance Advisor bands, spot price history rows.

The advisor publishes, per region and instance type, a savings % vs on-demand and a
monthly interruption band ("<5%" ... ">20%": the share of spot instances AWS reclaimed in
the trailing month). The catalog turns a band into an hourly reclaim rate (see
`Band.reclaims_per_hour`). Spot *prices* are not shipped (the only real history we have may
not be redistributed): a provider passes live `describe-spot-price-history` rows, parsed by
`parse_spot_price_history` or built as `SpotPrice`, to `aws_offers`.
"""
from __future__ import annotations

import csv
import functools
import json
import math
import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from orbit_dagster.catalog import CatalogError, as_utc, shipped_file
from orbit_dagster.catalog import price as parse_price
from orbit_dagster.catalog.gpus import offer_spec_fields
from orbit_dagster.core.bounded import memory_cap, read_bounded, size_text
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer

ADVISOR_FILE = "aws_spot_advisor_gpu.json"
MAX_PRICE_FILE_BYTES = 256 << 20
HOURS_PER_MONTH = 365.25 * 24 / 12  # 730.5: the advisor's "month" as a constant-hazard window

_ONE_GPU = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")
_G_SIZES = {**{s: 1 for s in _ONE_GPU}, "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}

# family -> (canonical GPU, {size: GPUs per instance}), from AWS's accelerated-computing
# instance pages. Families outside this table (inf, trn, dl: not CUDA GPUs) are skipped.
AWS_GPU_FAMILIES: dict[str, tuple[str, dict[str, int]]] = {
    "p2": ("K80", {"xlarge": 1, "8xlarge": 8, "16xlarge": 16}),
    "p3": ("V100", {"2xlarge": 1, "8xlarge": 4, "16xlarge": 8}),
    "p3dn": ("V100-32G", {"24xlarge": 8}),
    "p4d": ("A100-40G", {"24xlarge": 8}),
    "p4de": ("A100-80G", {"24xlarge": 8}),
    "p5": ("H100", {"4xlarge": 1, "48xlarge": 8}),
    "p5e": ("H200", {"48xlarge": 8}),
    "p5en": ("H200", {"48xlarge": 8}),
    "g3": ("M60", {"4xlarge": 1, "8xlarge": 2, "16xlarge": 4}),
    "g3s": ("M60", {"xlarge": 1}),
    "g4dn": ("T4", {**{s: 1 for s in _ONE_GPU}, "12xlarge": 4, "metal": 8}),
    "g4ad": ("V520", {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 2, "16xlarge": 4}),
    "g5": ("A10G", _G_SIZES),
    "g5g": ("T4G", {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 2, "metal": 2}),
    "g6": ("L4", _G_SIZES),
    "gr6": ("L4", {"4xlarge": 1, "8xlarge": 1}),
    "g6e": ("L40S", _G_SIZES),
}


def instance_gpus(instance_type: str) -> tuple[str, int]:
    """(canonical GPU, GPUs per instance) of an AWS GPU instance type, e.g. p4d.24xlarge -> (A100-40G, 8)."""
    family, _, size = instance_type.partition(".")
    entry = AWS_GPU_FAMILIES.get(family)
    if entry is None or size not in entry[1]:
        raise CatalogError(f"{instance_type!r} is not a known AWS GPU instance type", field="instance_type",
                           value=instance_type, fix=f"use a size of the families {', '.join(sorted(AWS_GPU_FAMILIES))}")
    return entry[0], entry[1][size]


def is_gpu_instance_type(instance_type: str) -> bool:
    family, _, size = instance_type.partition(".")
    return size in AWS_GPU_FAMILIES.get(family, ("", {}))[1]


# ---- spot advisor ----------------------------------------------------------------------

@dataclass(frozen=True)
class Band:
    """One advisor interruption band: monthly reclaim share between low_pct and high_pct."""

    index: int
    label: str
    low_pct: float
    high_pct: float

    @property
    def midpoint_pct(self) -> float:
        return (self.low_pct + self.high_pct) / 2

    @property
    def naive_reclaims_per_hour(self) -> float:
        """The rate if `midpoint_pct`% of instances were reclaimed within a month at constant
        hazard: -ln(1 - p) / HOURS_PER_MONTH. Kept for comparison only: the public spot
        traces show reclaims per hour of up-time hundreds of times higher than this reading
        of the band (p3.2xlarge, band >20%: 0.49/h measured vs 0.0013/h), so it is not used."""
        return -math.log(1 - self.midpoint_pct / 100) / HOURS_PER_MONTH

    @property
    def reclaims_per_hour(self) -> float:
        """Reclaims per hour of up-time for this band, from the reclaim model fitted to the
        public traces (band >20% measured there; the others scaled by their midpoints)."""
        # lazy: reclaim_model imports numpy (0.2-0.4 s); `orbit submit` imports this module (control/providers.py)
        # and never asks a band's rate
        from .reclaim_model import load_reclaim_model

        return load_reclaim_model().band_rate(self.index)


@dataclass(frozen=True, order=True)
class AdvisorRow:
    snapshot: str  # ISO date of the advisor snapshot
    region: str
    os: str
    instance_type: str
    savings_pct: int
    band: int


def bands_from_ranges(ranges: list[dict]) -> list[Band]:
    """Bands from the feed's `ranges` list: each band runs from the previous band's max to its own."""
    ordered = sorted(ranges, key=lambda r: r["index"])
    bands, low = [], 0.0
    for r in ordered:
        bands.append(Band(int(r["index"]), str(r["label"]), low, float(r["max"])))
        low = float(r["max"])
    return bands


def _snapshot_from_name(path: Path) -> str:
    m = re.search(r"(\d{4}-\d{2}-\d{2})", path.name)
    if not m:
        raise CatalogError(f"cannot tell the snapshot date of {path.name}", field="snapshot", value=path.name,
                           fix="pass snapshot='YYYY-MM-DD'")
    return m.group(1)


def read_spot_advisor_json(path: Path, snapshot: str | None = None) -> tuple[list[Band], list[AdvisorRow]]:
    """Parse AWS's spot-advisor-data.json feed (`spot_advisor[region][os][type] = {s, r}`)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for key in ("ranges", "spot_advisor"):
        if key not in data:
            raise CatalogError(f"{Path(path).name} lacks the {key!r} key", field=key, value=None,
                               fix="pass the spot-advisor-data.json feed")
    snap = snapshot or _snapshot_from_name(Path(path))
    rows = [AdvisorRow(snap, region, os_name, itype, int(v["s"]), int(v["r"]))
            for region, by_os in data["spot_advisor"].items()
            for os_name, by_type in by_os.items() for itype, v in by_type.items()]
    return bands_from_ranges(data["ranges"]), sorted(rows, key=_row_key)


def read_spot_advisor_csv(path: Path) -> list[AdvisorRow]:
    """Parse the flattened accelerator CSV (snapshot, region, os, instance_type, s, r, ...)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [AdvisorRow(r["snapshot"], r["region"], r["os"], r["instance_type"],
                           int(r["savings_pct_s"]), int(r["interruption_index_r"])) for r in csv.DictReader(f)]
    return sorted(rows, key=_row_key)


def _row_key(r: AdvisorRow) -> tuple:
    return (r.snapshot, r.region, r.os, r.instance_type)


@functools.lru_cache(maxsize=1)
def load_advisor() -> tuple[tuple[Band, ...], tuple[AdvisorRow, ...]]:
    """The shipped advisor subset: Linux rows of GPU instance types, every snapshot."""
    data = json.loads(shipped_file(ADVISOR_FILE).read_text(encoding="utf-8"))
    fields = data["columns"]
    rows = tuple(AdvisorRow(**dict(zip(fields, r))) for r in data["rows"])
    return tuple(bands_from_ranges(data["ranges"])), rows


def band(index: int) -> Band:
    for b in load_advisor()[0]:
        if b.index == index:
            return b
    raise CatalogError(f"no advisor band {index}", field="band", value=index, fix="use 0..4")


def advisor_snapshot(at: datetime | None = None) -> str:
    """Latest advisor snapshot on or before `at` (the earliest when `at` precedes them all)."""
    snaps = sorted({r.snapshot for r in load_advisor()[1]})
    if at is None:
        return snaps[-1]
    day = as_utc(at).date().isoformat()
    usable = [s for s in snaps if s <= day]
    return usable[-1] if usable else snaps[0]


def advisor_rows(at: datetime | None = None) -> list[AdvisorRow]:
    return list(_rows_of(advisor_snapshot(at)))


@functools.lru_cache(maxsize=16)
def _rows_of(snapshot: str) -> tuple[AdvisorRow, ...]:
    return tuple(r for r in load_advisor()[1] if r.snapshot == snapshot)


def reliability_prior(gpu: str, at: datetime | None = None) -> tuple[Band, str]:
    """Prior band for a GPU with no advisor row (GCE, or an AWS type the advisor omits).

    The median band (lower median, so it is a real band) of the advisor's rows for the same
    GPU model, else of all GPU rows: the best the data says about how often such capacity
    is reclaimed. Returns the band and a label saying it is a prior.
    """
    return _prior(gpu, advisor_snapshot(at))


@functools.lru_cache(maxsize=256)
def _prior(gpu: str, snapshot: str) -> tuple[Band, str]:
    rows = _rows_of(snapshot)
    same = [r.band for r in rows if instance_gpus(r.instance_type)[0] == gpu]
    pool, what = (same, f"{gpu} rows") if same else ([r.band for r in rows], "GPU rows of all models")
    b = band(statistics.median_low(pool))
    return b, f"prior: median AWS spot-advisor band {b.label!r} of {len(pool)} {what} ({snapshot})"


# ---- spot price history ----------------------------------------------------------------

_DIRECTIONS = {"e": "east", "w": "west", "n": "north", "s": "south", "c": "central",
               "ne": "northeast", "nw": "northwest", "se": "southeast", "sw": "southwest"}


def az_id_to_region(az_id: str) -> str:
    """AZ id -> region: `use1-az2` -> us-east-1, `apne1-az4` -> ap-northeast-1, `cac1-az1` -> ca-central-1.

    AZ ids (unlike zone names) are the same for every account; their prefix encodes the region.
    """
    m = re.fullmatch(r"([a-z]{2})([a-z]{1,2})(\d+)(?:-az\d+)?", az_id)
    if not m or m.group(2) not in _DIRECTIONS:
        raise CatalogError(f"cannot read a region from AZ id {az_id!r}", field="az_id", value=az_id,
                           fix="use an AWS AZ id such as use1-az2")
    return f"{m.group(1)}-{_DIRECTIONS[m.group(2)]}-{m.group(3)}"


@dataclass(frozen=True)
class SpotPrice:
    """One `describe-spot-price-history` row."""

    az_id: str
    instance_type: str
    product: str
    usd_per_hour: float
    timestamp: datetime

    @property
    def region(self) -> str:
        return az_id_to_region(self.az_id)


def parse_spot_price_history(path: Path) -> list[SpotPrice]:
    """Parse tab-separated rows `az_id, instance_type, product, usd_per_hour, timestamp` (no header)."""
    out = []
    cap = memory_cap(MAX_PRICE_FILE_BYTES, 1 / 16)  # its rows are held as objects: several times its size
    try:
        raw = read_bounded(Path(path), cap, what=f"spot price file {Path(path).name}", field="prices",
                           fix=f"keep the price file under {size_text(cap)} (only the recent rows are used)")
    except OrbitError as exc:
        raise CatalogError(str(exc).split("; fix: ")[0], field="prices", value=str(path), fix=exc.fix) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        n = raw.count(b"\n", 0, e.start) + 1
        raise CatalogError(f"{Path(path).name} line {n} is not UTF-8 text ({e.reason})", field="line",
                           value=n, fix="write the rows as UTF-8 text") from None
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        if not line.strip():
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 5:
            raise CatalogError(f"{Path(path).name} line {n}: {len(parts)} fields, expected 5", field="line",
                               value=line.strip(), fix="az_id, instance_type, product, usd_per_hour, timestamp")
        az, itype, product, price, ts = parts
        try:
            when = datetime.fromisoformat(ts.replace("Z", "+00:00")).astimezone(timezone.utc)
        except ValueError as e:
            raise CatalogError(f"{Path(path).name} line {n}: {e}", field="timestamp",
                               value=line.strip()[:200], fix="an ISO-8601 timestamp") from None
        usd = parse_price(price, where=f"{Path(path).name} line {n}", field="usd_per_hour")
        try:
            az_id_to_region(az)  # validate early, naming the line and its value
        except CatalogError as e:
            raise CatalogError(f"{Path(path).name} line {n}: {e}", field="az_id", value=az[:40],
                               fix="an AWS AZ id such as use1-az2") from None
        out.append(SpotPrice(az, itype, product, usd, when))
    return out


def latest_spot_prices(rows: list[SpotPrice], at: datetime | None = None) -> dict[tuple[str, str], SpotPrice]:
    """Price in force per (az_id, instance_type) at `at` (Linux/UNIX rows; the last change wins)."""
    latest: dict[tuple[str, str], SpotPrice] = {}
    at = as_utc(at)
    for r in sorted(rows, key=lambda r: (r.timestamp, r.az_id, r.instance_type)):
        if r.product.startswith("Linux") and (at is None or r.timestamp <= at):
            latest[(r.az_id, r.instance_type)] = r
    return latest


# ---- offers ----------------------------------------------------------------------------

def reliability_from_rate(reclaims_per_hour: float) -> float:
    """Probability of one hour without a reclaim under a constant hazard."""
    return math.exp(-reclaims_per_hour)


def _spot_fields(gpu: str, row: AdvisorRow | None, at: datetime | None) -> dict:
    if row is not None:
        b = band(row.band)
        source = f"AWS spot-advisor band {b.label!r} ({row.snapshot}, midpoint {b.midpoint_pct:g}%/month)"
    else:
        b, source = reliability_prior(gpu, at)
    return {"interruption_band": b.label if row is not None else None, "reclaims_per_hour": b.reclaims_per_hour,
            "reliability": reliability_from_rate(b.reclaims_per_hour), "reliability_source": source}


def aws_offers(at: datetime | None = None, spot_prices: list[SpotPrice] | None = None,
               on_demand_usd_per_hour: dict[tuple[str, str], float] | None = None) -> list[Offer]:
    """AWS spot offers: one per (region, GPU instance type) in the advisor snapshot for `at`.

    With `spot_prices` (live `describe-spot-price-history` rows) a priced (region, type)
    becomes one offer per AZ (zone = AZ id, price in force at `at`); without, the offer is
    regional and unpriced (ranked last). `on_demand_usd_per_hour[(region, type)]` adds the
    on-demand price when a provider knows it; nothing shipped does.
    """
    on_demand = on_demand_usd_per_hour or {}
    advised = {(r.region, r.instance_type): r for r in advisor_rows(at) if r.os == "Linux"
               and is_gpu_instance_type(r.instance_type)}
    by_region: dict[tuple[str, str], list[SpotPrice]] = {}
    for p in latest_spot_prices(spot_prices or [], at).values():
        if is_gpu_instance_type(p.instance_type):
            by_region.setdefault((p.region, p.instance_type), []).append(p)
    offers = []
    for region, itype in sorted(set(advised) | set(by_region)):
        gpu, count = instance_gpus(itype)
        common = {"provider": "aws", "instance_type": itype, "gpu": gpu, "gpu_count": count, "region": region,
                  **offer_spec_fields(gpu), **_spot_fields(gpu, advised.get((region, itype)), at)}
        od = on_demand.get((region, itype))
        od_fields = {"usd_per_gpu_second_on_demand": None if od is None else od / count / 3600}
        prices = by_region.get((region, itype))
        if not prices:
            offers.append(Offer(offer_id=f"aws:{itype}:{region}", **common, **od_fields, spot=True))
            continue
        for p in sorted(prices, key=lambda p: p.az_id):
            offers.append(Offer(offer_id=f"aws:{itype}:{p.az_id}", zone=p.az_id, **common, **od_fields,
                                usd_per_gpu_second_spot=p.usd_per_hour / count / 3600,
                                price_as_of=p.timestamp, spot=True))
    return offers
