"""Offer: one rentable shape, normalised to dollars per GPU-second."""
from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class Offer(BaseModel):
    """A rentable shape from one provider, in one currency: $ per GPU-second."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    offer_id: str = Field(description="stable id: provider:instance_type:zone")
    provider: str
    instance_type: str
    gpu: str = Field(description="normalised GPU model name, e.g. H100, A100-80G, V100, L4")
    gpu_count: int = Field(ge=0)
    gpu_memory_gb: float = 0.0
    region: str = ""
    zone: str = ""
    usd_per_gpu_second_on_demand: float | None = Field(None, ge=0)
    usd_per_gpu_second_spot: float | None = Field(None, ge=0)
    spec_tflops_bf16: float | None = Field(None, ge=0, description="per GPU, dense")
    measured_tflops: float | None = Field(None, ge=0, description="per GPU, from the probe")
    memory_bandwidth_gbps: float | None = None
    interruption_band: str | None = Field(None, description="AWS spot-advisor band, e.g. '<5%'")
    reclaims_per_hour: float | None = Field(None, ge=0, description="observed or prior reclaim rate")
    reliability: float | None = Field(None, ge=0, le=1, description="probability of an hour without reclaim")
    spot: bool = True
    reliability_source: str | None = Field(None, description="where `reliability` came from: observed, advisor band or a labelled prior")
    price_as_of: datetime | None = Field(None, description="when the price data was last sampled (UTC)")

    @property
    def usd_per_second(self) -> float:
        """What the whole instance costs per second in its market (spot or on-demand)."""
        per_gpu = self.usd_per_gpu_second_spot if self.spot else self.usd_per_gpu_second_on_demand
        if per_gpu is None:
            per_gpu = self.usd_per_gpu_second_on_demand or 0.0
        return per_gpu * max(self.gpu_count, 1)

    @property
    def effective_tflops(self) -> float | None:
        """Measured TFLOPS once a probe ran on this shape, else the spec figure."""
        return self.measured_tflops if self.measured_tflops is not None else self.spec_tflops_bf16


ON_DEMAND_SUFFIX = ":on-demand"


def on_demand(offer: Offer) -> Offer | None:
    """The same shape rented on demand (never reclaimed), or None when it has no on-demand price."""
    if not offer.spot:
        return offer
    if offer.usd_per_gpu_second_on_demand is None:
        return None
    return offer.model_copy(update={"spot": False, "offer_id": offer.offer_id + ON_DEMAND_SUFFIX,
                                    "reclaims_per_hour": 0.0, "reliability": 1.0,
                                    "reliability_source": "on-demand: not reclaimed"})
