"""What a spot trace was measured on: cloud, zone, instance type, nodes per job, prices, notice.

A replay is only faithful to a trace if it replays the market the trace was taken in:

- **nodes**: an N-node trace (availability counts 0..N) is a gang of N instances; a job on it
  needs all N at once and loses its session when any of them is reclaimed;
- **prices**: each trace is priced at its own instance type's prices: the trace's own
  ``prices`` field when it has one, else the cloud's published figures for that type
  (AWS: on-demand list price x (1 - the spot advisor's savings % for the region, snapshot
  nearest the trace's date); GCP: the published spot price);
- **notice**: each cloud's own reclaim notice (AWS 120 s, GCP 30 s).

Trace names follow the shared data set (``SOURCES.md``): ``<cloud>-<YYYY-MM-DD>_<zone>_<tag>``
with tags such as ``v100_1`` (1x V100 per instance), ``v100_8``, ``k80_1``, ``intel_64``
(r5.16xlarge), ``c3-88`` (c3-highcpu-88) and ``v100_16node`` (16 instances of 1x V100).
The name is read only where loading recorded that the shared data set's convention applies
(``metadata.convention``, see ``catalog.traces``); an arbitrary file's name tells nothing.
``metadata`` fields ``cloud``, ``date``, ``instance_type``, ``nodes`` and ``zone`` override the name.

The cloud is never assumed: a trace whose cloud neither its metadata nor the caller
(``orbit simulate --cloud``) gives is refused, since its notice and prices depend on it.
Other figures a trace does not tell (a synthetic one's instance type) are replayed with the
caller's defaults, and every figure that was assumed rather than known is labelled so in
``sources``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import date

from orbit_dagster.catalog import PROVIDER_NOTICE_S
from orbit_dagster.catalog.aws import load_advisor
from orbit_dagster.catalog.gpus import normalise_gpu_name, offer_spec_fields
from orbit_dagster.catalog.reclaim_model import BAND_LABELS
from orbit_dagster.catalog.traces import CLOUDS, SHARED_NAME, Trace
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer

#: Reclaim notice per cloud: AWS's instance-action warning and GCP's preemption notice.
CLOUD_NOTICE_S = {"aws": PROVIDER_NOTICE_S["aws"], "gcp": PROVIDER_NOTICE_S["gce"]}

#: (accelerator tag, count) in a trace name -> instance type (skypilot-org/spot-traces README).
TAG_INSTANCE = {("v100", 1): "p3.2xlarge", ("v100", 4): "p3.8xlarge", ("v100", 8): "p3.16xlarge",
                ("k80", 1): "p2.xlarge", ("k80", 8): "p2.8xlarge", ("k80", 16): "p2.16xlarge",
                ("intel", 64): "r5.16xlarge", ("c3", 88): "c3-highcpu-88"}

#: Instance type -> (GPUs per instance, on-demand $/h, source). AWS: Linux list prices of
#: us-east-1/us-east-2/us-west-2 (aws.amazon.com/ec2/pricing/on-demand, unchanged for these
#: types since their launch). GCP: Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml
#: of 2023-05-08 (Apache-2.0), us-central1 = us-east1. CPU types count as one "GPU" per
#: instance, so that their GPU-hours read as instance-hours.
ON_DEMAND = {
    "p3.2xlarge": (1, 3.06, "AWS list price"), "p3.8xlarge": (4, 12.24, "AWS list price"),
    "p3.16xlarge": (8, 24.48, "AWS list price"), "p2.xlarge": (1, 0.90, "AWS list price"),
    "p2.8xlarge": (8, 7.20, "AWS list price"), "p2.16xlarge": (16, 14.40, "AWS list price"),
    "r5.16xlarge": (0, 4.032, "AWS list price"),
    "c3-highcpu-88": (0, 3.792096, "GCE price list 2023-05-08 (Cyclenerd pricing.yml)"),
}
#: GCP spot $/h per type, same source (GCP publishes spot prices; there is no advisor).
GCP_SPOT = {"c3-highcpu-88": 0.344256}
#: AWS spot-advisor savings % for types outside the shipped GPU advisor subset
#: (AWS Spot Instance Advisor 2025-06-28 via alexei-led/spotinfo, Apache-2.0): (savings %, band).
AWS_ADVISOR_EXTRA = {("r5.16xlarge", "us-east-1"): (76, 4), ("r5.16xlarge", "us-east-2"): (65, 2),
                     ("r5.16xlarge", "us-west-2"): (63, 4)}

_NAME = SHARED_NAME
_TAG = re.compile(r"^(?P<acc>[a-z0-9]+?)[_-](?P<n>\d+)(?P<node>node)?$")


@dataclass(frozen=True)
class TraceMarket:
    """The market a trace replays: per-node prices, gang size, the cloud's notice.

    Prices are per instance (node); a job holds ``nodes`` instances, so it pays ``nodes``
    times them and its GPU-hours are ``nodes * gpus_per_node`` per hour held.
    """

    trace: str
    cloud: str | None
    zone: str | None
    region: str | None
    day: date | None
    instance_type: str | None
    nodes: int
    gpus_per_node: int
    on_demand_usd_per_hour: float
    spot_usd_per_hour: float  # used where the trace has no prices of its own
    spot_from_trace: bool
    notice_s: float
    band: int | None  # AWS spot-advisor interruption band of (type, region), if known
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        """GPUs (or instances, for CPU types) the whole gang holds."""
        return self.nodes * max(self.gpus_per_node, 1)

    def spot_price(self, trace: Trace, tick: int) -> float:
        """Spot $/h of one instance at ``tick`` (the trace's own price when it has one)."""
        return trace.price_at(tick, self.spot_usd_per_hour)

    def as_dict(self) -> dict:
        return {"cloud": self.cloud, "zone": self.zone, "instance_type": self.instance_type, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "on_demand_usd_per_hour_per_node": self.on_demand_usd_per_hour,
                "spot_usd_per_hour_per_node": "trace prices" if self.spot_from_trace else self.spot_usd_per_hour,
                "notice_seconds": self.notice_s, "interruption_band": self.band, "sources": dict(self.sources)}


def parse_trace_name(name: str) -> dict | None:
    """Cloud, date, zone, region, instance type and nodes from a shared-data trace name; None if unknown."""
    m = _NAME.match(name)
    if not m:
        return None
    zone = m["zone"]
    region = zone[:-1] if m["cloud"] == "aws" else zone.rsplit("-", 1)[0]
    out = {"cloud": m["cloud"], "day": date.fromisoformat(m["date"]), "zone": zone, "region": region,
           "instance_type": None, "nodes": None}
    t = _TAG.match(m["tag"])
    if t:
        acc, n = t["acc"], int(t["n"])
        if t["node"]:  # a gang of n single-accelerator instances
            out["nodes"], out["instance_type"] = n, TAG_INSTANCE.get((acc, 1))
        else:
            out["instance_type"] = TAG_INSTANCE.get((acc, n))
    return out


def _aws_spot(itype: str, region: str | None, day: date | None) -> tuple[float, int, str] | None:
    """(savings %, band, source) from the spot advisor: the shipped GPU subset, else the extra table."""
    rows = [r for r in load_advisor()[1] if r.instance_type == itype and r.region == region and r.os == "Linux"]
    if rows:
        when = day or date.today()
        r = min(rows, key=lambda r: (abs((date.fromisoformat(r.snapshot) - when).days), r.snapshot))
        return r.savings_pct, r.band, f"AWS spot advisor {r.snapshot} ({region}): {r.savings_pct}% savings"
    extra = AWS_ADVISOR_EXTRA.get((itype, region or ""))
    if extra:
        return extra[0], extra[1], f"AWS spot advisor 2025-06-28 ({region}): {extra[0]}% savings"
    return None


def trace_cloud(trace: Trace, cloud: str | None = None) -> str:
    """The cloud ``trace`` replays: ``cloud`` (the caller's ``--cloud``) if given, else its
    ``metadata.cloud``; refused when neither says, never guessed."""
    if cloud is not None:
        if cloud not in CLOUDS:
            raise OrbitError(f"cloud {cloud!r} is not one of {', '.join(CLOUDS)}", field="cloud", value=cloud,
                             fix="pass --cloud aws or --cloud gcp")
        return cloud
    known = (trace.metadata or {}).get("cloud")
    if known is None:
        raise OrbitError(f"trace {trace.name}: its cloud is unknown (the file has no metadata.cloud), so neither its "
                         "reclaim notice nor its prices are", field="cloud", value=None,
                         fix="pass --cloud aws|gcp, or add \"cloud\": \"aws\" or \"gcp\" to the trace's metadata")
    return known


def trace_market(trace: Trace, *, default_spot_usd_per_hour: float, default_on_demand_usd_per_hour: float,
                 cloud: str | None = None) -> TraceMarket:
    """The market of ``trace``; the defaults apply only to what neither its metadata nor the shared
    data set's recorded naming convention tells. ``cloud`` overrides the trace's ``metadata.cloud``."""
    meta = trace.metadata or {}
    info = (parse_trace_name(trace.name) or {}) if meta.get("convention") else {}
    given_cloud = cloud is not None
    cloud = trace_cloud(trace, cloud)
    day = date.fromisoformat(meta["date"]) if isinstance(meta.get("date"), str) else info.get("day")
    itype = meta.get("instance_type", info.get("instance_type"))
    zone = meta.get("zone", info.get("zone"))
    region = info.get("region") if zone == info.get("zone") else (zone[:-1] if cloud == "aws" and zone else zone)
    nodes = meta.get("nodes", info.get("nodes"))
    if nodes is None:
        nodes = max(trace.data) if trace.kind == "multinode" else 1
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise OrbitError(f"trace {trace.name}: nodes = {nodes!r} is invalid", field="metadata.nodes", value=nodes,
                         fix="set metadata.nodes to the instances a job holds at once (an integer >= 1)")
    sources: dict[str, str] = {}
    if itype in ON_DEMAND:
        gpus, od, src = ON_DEMAND[itype]
        sources["on_demand"] = f"{src} of {itype}"
    else:
        gpus, od = 1, default_on_demand_usd_per_hour
        sources["on_demand"] = f"assumed {od:g} $/h (instance type unknown)"
    band = None
    spot = default_spot_usd_per_hour
    spot_src = f"assumed {spot:g} $/h (no prices in the trace, no published figure for its type)"
    if cloud == "aws" and itype:
        adv = _aws_spot(itype, region, day)
        if adv:
            spot, band, spot_src = od * (1 - adv[0] / 100.0), adv[1], adv[2] + f" x {od:g} $/h on-demand"
    elif cloud == "gcp" and itype in GCP_SPOT:
        spot, spot_src = GCP_SPOT[itype], f"GCE spot price list 2023-05-08 of {itype}"
    sources["spot"] = "the trace's own prices field" if trace.prices is not None else spot_src
    notice, sources["notice"] = CLOUD_NOTICE_S[cloud], f"{cloud.upper()}'s reclaim notice"
    sources["cloud"] = "given" if given_cloud else (f"recorded at load from the {meta['cloud_from']}"
                                                    if meta.get("cloud_from") else "the trace's metadata.cloud")
    return TraceMarket(trace=trace.name, cloud=cloud, zone=zone, region=region, day=day,
                       instance_type=itype, nodes=nodes, gpus_per_node=gpus, on_demand_usd_per_hour=od,
                       spot_usd_per_hour=round(spot, 6), spot_from_trace=trace.prices is not None, notice_s=notice,
                       band=band, sources=sources)


def trace_offer(trace: Trace, market: TraceMarket, *, at_s: float = 0.0, provider: str | None = None,
                offer_id: str | None = None) -> Offer:
    """The offer a trace was measured on, as a market rents it: one instance of its type in its
    zone, its interruption band and on-demand price, spot at the trace's own price at trace
    second ``at_s`` (else the type's published figure). ``provider``: who rents it (default the
    trace's cloud, whose notice `rank_offers` looks up by provider); ``offer_id`` default
    ``trace:<name>``. A type whose GPU is not in the name table is taken to be a V100 (the
    shared data set's GPU)."""
    itype = market.instance_type or "unknown"
    gpu = normalise_gpu_name(next((acc for (acc, n), t in TAG_INSTANCE.items() if t == itype), "v100"))
    gpus = max(ON_DEMAND.get(itype, (1,))[0], 1)
    spot = trace.price_at(int(at_s // trace.gap_seconds), market.spot_usd_per_hour)
    zone = market.zone or "zone"
    return Offer(offer_id=offer_id or f"trace:{trace.name}", provider=provider or market.cloud or "sim",
                 instance_type=itype, gpu=gpu, gpu_count=gpus, region=market.region or zone, zone=zone,
                 usd_per_gpu_second_on_demand=market.on_demand_usd_per_hour / 3600.0 / gpus,
                 usd_per_gpu_second_spot=spot / 3600.0 / gpus, **offer_spec_fields(gpu),
                 interruption_band=BAND_LABELS[market.band] if market.band is not None else None)
