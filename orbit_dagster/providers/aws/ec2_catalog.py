"""What EC2 rents in a region, joined with the catalog, and what it costs: offers and spot prices.

`describe_instance_types` (its `GpuInfo`) is the truth about a shape; the catalog adds the
advisor's interruption band and the GPU's specs. Prices come from spot price history
(`price_feed`) or rows an operator supplies; a placeholder price (moto's, or one dated
before EC2 spot existed) is labelled and never prices an offer.
"""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlparse

from ...catalog import as_utc, price
from ...catalog.aws import AWS_GPU_FAMILIES, SpotPrice, aws_offers, is_gpu_instance_type
from ...core.execution import Resources
from ...core.offers import Offer
from ..base import PriceTick
from ..common import offer_fits
from .ec2 import Ec2Api

SPOT_LAUNCHED = datetime(2009, 11, 30, tzinfo=timezone.utc)  # no real spot price predates EC2 spot
PRODUCTS = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]
TYPES_TTL_S = 3600.0


def is_aws_endpoint(url: str | None) -> bool:
    """True for AWS itself (no override, or an *.amazonaws.com / *.api.aws host); False for moto & co."""
    if not url:
        return True
    host = urlparse(url).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn", ".api.aws"))


class AwsCatalog:
    def __init__(self, api: Ec2Api, *, static_spot_prices: list[SpotPrice] | None = None,
                 prices_are_real: bool | None = None):
        self.api, self.region = api, api.region
        self.static_spot_prices = list(static_spot_prices or [])
        self.prices_are_real = is_aws_endpoint(api.endpoint_url) if prices_are_real is None else prices_are_real
        self._types: tuple[float, dict[str, tuple[int, float]]] | None = None
        self._live_prices: dict[tuple[str, str], SpotPrice] = {}

    def gpu_instance_types(self) -> dict[str, tuple[int, float]]:
        """GPU instance types EC2 reports in this region: type -> (GPUs, GiB per GPU), from GpuInfo."""
        if self._types is None or time.time() - self._types[0] > TYPES_TTL_S:
            found = {}
            patterns = sorted(f"{family}.*" for family in AWS_GPU_FAMILIES)
            for it in self.api.pages("describe_instance_types", "InstanceTypes",
                                     Filters=[{"Name": "instance-type", "Values": patterns}]):
                gpus = (it.get("GpuInfo") or {}).get("Gpus") or []
                if not gpus or not is_gpu_instance_type(it["InstanceType"]):
                    continue
                count = sum(int(g.get("Count", 0)) for g in gpus)
                gib = float((gpus[0].get("MemoryInfo") or {}).get("SizeInMiB", 0)) / 1024
                found[it["InstanceType"]] = (count, gib)
            self._types = (time.time(), found)
        return self._types[1]

    def list_offers(self, resources: Resources | None = None) -> list[Offer]:
        """Catalog offers (advisor bands, specs, prices) for the GPU types EC2 reports here.

        Prices: real spot price history ingested by `price_feed`, and `static_spot_prices`;
        moto's placeholder prices are never used. An unpriced offer costs 0 and ranks by id.
        """
        types = self.gpu_instance_types()
        out = []
        for offer in aws_offers(spot_prices=[*self._live_prices.values(), *self.static_spot_prices]):
            if offer.region != self.region or offer.instance_type not in types:
                continue
            offer = join_shape(offer, *types[offer.instance_type])
            if resources is None or offer_fits(offer, resources):
                out.append(offer)
        return out

    def price_feed(self, since: datetime | None = None, offer_ids: list[str] | None = None) -> list[PriceTick]:
        """Spot price history of this region's GPU types (or of `offer_ids`) since `since` (default: 3 h).

        Ticks from a non-AWS endpoint, or dated before EC2 spot existed, are labelled
        placeholders in `source` and are not used to price offers.
        """
        start = as_utc(since) if since else datetime.now(timezone.utc) - timedelta(hours=3)
        wanted = set(offer_ids) if offer_ids is not None else None
        types = sorted(t for t in self.gpu_instance_types()
                       if wanted is None or any(o.split(":")[1:2] == [t] for o in wanted))
        if not types:
            return []
        zone_ids = {name: zid for zid, name in self.api.zone_names().items()}
        ticks = []
        for row in self.api.pages("describe_spot_price_history", "SpotPriceHistory", InstanceTypes=types,
                                  ProductDescriptions=PRODUCTS, StartTime=start):
            zone_id = row.get("AvailabilityZoneId") or zone_ids.get(row.get("AvailabilityZone", ""))
            itype, ts = row["InstanceType"], as_utc(row["Timestamp"])
            usd = price(row.get("SpotPrice"), where=f"describe_spot_price_history {itype}", field="SpotPrice")
            offer_id = f"aws:{itype}:{zone_id}"
            if not zone_id or (wanted is not None and offer_id not in wanted
                               and f"aws:{itype}:{self.region}" not in wanted):
                continue
            real = self.prices_are_real and ts >= SPOT_LAUNCHED
            source = "aws:describe_spot_price_history" if real else (
                f"placeholder:describe_spot_price_history from {self.api.endpoint_url} (not a real price; not used)")
            ticks.append(PriceTick(offer_id=offer_id, ts=ts, usd_per_hour_spot=usd, source=source))
            key = (zone_id, itype)
            if real and (key not in self._live_prices or self._live_prices[key].timestamp <= ts):
                self._live_prices[key] = SpotPrice(zone_id, itype, "Linux/UNIX", usd, ts)
        return ticks


def join_shape(offer: Offer, gpus: int, gib_per_gpu: float) -> Offer:
    """EC2's GpuInfo is the truth about the shape; per-GPU prices follow a corrected count."""
    update: dict[str, Any] = {}
    if gib_per_gpu > 0:
        update["gpu_memory_gb"] = gib_per_gpu
    if gpus and gpus != offer.gpu_count:
        scale = offer.gpu_count / gpus
        update["gpu_count"] = gpus
        for f in ("usd_per_gpu_second_spot", "usd_per_gpu_second_on_demand"):
            if getattr(offer, f) is not None:
                update[f] = getattr(offer, f) * scale
    return offer.model_copy(update=update) if update else offer
