"""The simulated market of these settings: its clock, and whether it reclaims."""
from __future__ import annotations

from ..core.errors import OrbitError
from ..providers.sim import NoReclaims, ReclaimSchedule
from ..providers.sim_market import MarketConfig, TraceMarket, ensure_market
from .settings import Settings


def schedule_for(settings: Settings) -> tuple[ReclaimSchedule, MarketConfig]:
    """The reclaim schedule and the market clock (prices replay on it either way)."""
    if settings.sim_reclaims not in ("", "none", "trace"):
        raise OrbitError(f"unknown sim reclaim mode {settings.sim_reclaims!r}", field="ORBIT_SIM_RECLAIMS",
                         value=settings.sim_reclaims, fix="use `trace` (replay spot traces) or `none`")
    market = ensure_market(settings.sim_dir, trace_dir=settings.sim_traces, scale=settings.sim_scale,
                           notice_s=settings.sim_notice_seconds)
    if settings.sim_reclaims == "trace":
        return TraceMarket(market), market
    return NoReclaims(), market
