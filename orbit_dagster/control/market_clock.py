"""The simulated market of these settings: its clock, and whether it reclaims."""
from __future__ import annotations

from ..providers.sim.market import MarketConfig, TraceReclaims, ensure_market
from ..providers.sim.provider import NoReclaims, ReclaimSchedule
from ..settings import Settings


def schedule_for(settings: Settings) -> tuple[ReclaimSchedule, MarketConfig]:
    """The reclaim schedule and the market clock (prices replay on it either way)."""
    sim = settings.sim  # checked by the settings (SimSettings), whether from the environment or a resource
    market = ensure_market(settings.sim_dir, trace_dir=sim.traces, scale=sim.scale, notice_s=sim.notice_seconds)
    if sim.reclaims == "trace":
        return TraceReclaims(market), market
    return NoReclaims(), market


def time_scale(provider) -> float:
    """Market seconds per wall second of a provider's market: the sim market replays its
    traces `scale` times faster than real time; every other market runs in real time (1).

    The policies think in market time (their priors are reclaims per market hour, their
    floors and decision ticks market seconds), while the control plane measures save, step
    and instance times on the wall clock: every call into a policy converts with this
    factor, so a compressed market makes the decisions the real one would."""
    market = getattr(provider, "market", None)
    scale = getattr(market, "scale", None) if isinstance(market, MarketConfig) else None
    return float(scale) if isinstance(scale, (int, float)) and scale > 0 else 1.0
