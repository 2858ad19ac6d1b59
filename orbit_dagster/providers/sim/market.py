"""The simulated spot market's clock, reclaims and prices.

Every instance lives on a replay of a spot trace: a real preemption trace when one is
given (`$ORBIT_SIM_TRACES`), else a trace generated from the reclaim model fitted to the
public traces (seeded, so a replay is repeatable). Market time runs `scale` times faster
than the wall clock, and so does the notice window (AWS: 120 s of market time). One
`market.json` under the sim directory fixes the clock for every process that rents from
the market, so they all agree on when a zone reclaims.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from ...catalog.gce import price_history
from ...catalog.reclaim_model import generate_trace, load_reclaim_model
from ...catalog.traces import Trace, cyclic_time, load_trace, next_available, reclaim_offsets
from ...core.errors import NoCapacity, OrbitError
from ...core.offers import Offer

MARKET_FILE = "market.json"
GENERATED_DAYS = 14


@dataclass(frozen=True)
class MarketConfig:
    epoch_wall: float  # wall time at which market time == trace_offset_s
    trace_offset_s: float  # where in the trace(s) the market clock starts
    scale: float  # market seconds per wall second
    notice_s: float  # notice window in market seconds
    traces: tuple[str, ...]  # trace files, or ("generated:<seed>",)
    price_days_per_wall_s: float = 1.0  # how fast the price history replays
    # A scenario may place some zones' replays (offer id -> trace seconds at market time 0);
    # every other zone starts at a stable hash of its offer id.
    zone_offsets: dict = field(default_factory=dict)

    def market_time(self, wall: float) -> float:
        return self.trace_offset_s + (wall - self.epoch_wall) * self.scale

    def wall_time(self, market_t: float) -> float:
        return self.epoch_wall + (market_t - self.trace_offset_s) / self.scale

    @property
    def notice_wall_s(self) -> float:
        return self.notice_s / self.scale


@lru_cache(maxsize=8)
def load_traces_for(names: tuple[str, ...]) -> list[Trace]:
    out = []
    for name in names:
        if name.startswith("generated:"):
            seed = int(name.split(":", 1)[1])
            out.append(generate_trace(load_reclaim_model(), seed, GENERATED_DAYS * 86400.0, 32.0))
        else:
            out.append(load_trace(name))
    return out


def preemption_traces(trace_dir: str | None) -> tuple[str, ...]:
    """The preemption traces under a directory (any depth), or generated ones when absent."""
    if trace_dir and Path(trace_dir).is_dir():
        files = sorted(str(p.resolve()) for p in Path(trace_dir).rglob("*.json") if "preemption" in str(p))
        if files:
            return tuple(files)
    return ("generated:1", "generated:2")


def offer_shift(offer_id: str, duration_s: float) -> float:
    """Where in the trace an offer's zone starts: a stable function of its id, so that
    different zones do not reclaim in lock-step."""
    h = int.from_bytes(hashlib.sha256(offer_id.encode()).digest()[:8], "big")
    return (h % 10_000) / 10_000 * duration_s


class TraceReclaims:
    """A ReclaimSchedule (see providers.sim) that replays traces on the market clock."""

    def __init__(self, config: MarketConfig):
        self.config = config
        self.traces = load_traces_for(config.traces)

    def _zone(self, offer: Offer) -> tuple[Trace, float]:
        trace = self.traces[int(hashlib.sha256(offer.offer_id.encode()).hexdigest(), 16) % len(self.traces)]
        if offer.offer_id in self.config.zone_offsets:
            return trace, float(self.config.zone_offsets[offer.offer_id]) - self.config.trace_offset_s
        return trace, offer_shift(offer.offer_id, trace.duration_s)

    def reclaim_at(self, offer: Offer, start_wall: float) -> float | None:
        if not offer.spot:
            return None  # on-demand capacity: always there, never reclaimed
        trace, shift = self._zone(offer)
        # the market replays its traces cyclically, as orbit simulate does (catalog.traces._Cycle)
        p = self.config.market_time(start_wall) + shift
        t = cyclic_time(trace, p if p >= 0 else p % trace.duration_s)
        avail = next_available(trace, t, cyclic=True)
        if avail is None or avail > t:
            wait = None if avail is None else (avail - t) / self.config.scale
            raise NoCapacity(
                f"sim market: no spot capacity for {offer.offer_id} now"
                + (f" (the zone returns in ~{wait:.0f} s)" if wait is not None else ""),
                provider="sim",
                fix="another offer, or wait",
            )
        offsets = reclaim_offsets(trace, t, trace.duration_s, cyclic=True)
        return start_wall + offsets[0] / self.config.scale if offsets else None

    def notice_seconds(self) -> float:
        return self.config.notice_wall_s


def market_path(sim_dir: Path) -> Path:
    return Path(sim_dir) / MARKET_FILE


def write_market(sim_dir: Path, config: MarketConfig) -> MarketConfig:
    path = market_path(sim_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(config), sort_keys=True, indent=1))
    tmp.replace(path)
    return config


def read_market(sim_dir: Path) -> MarketConfig | None:
    try:
        d = json.loads(market_path(sim_dir).read_text())
    except FileNotFoundError:
        return None
    d["traces"] = tuple(d["traces"])
    d.setdefault("zone_offsets", {})
    return MarketConfig(**d)


def ensure_market(sim_dir: Path, *, trace_dir: str | None, scale: float, notice_s: float) -> MarketConfig:
    """The market of this sim directory; created (real time, trace start) on first use."""
    existing = read_market(sim_dir)
    if existing is not None:
        return existing
    if scale <= 0:
        raise OrbitError("sim market scale must be > 0", field="ORBIT_SIM_SCALE", value=scale, fix="e.g. 1 or 60")
    return write_market(sim_dir, MarketConfig(epoch_wall=time.time(), trace_offset_s=0.0, scale=scale,
                                              notice_s=notice_s, traces=preemption_traces(trace_dir)))


def price_feed(config: MarketConfig, offers: list[Offer], since_wall: float | None, now_wall: float) -> list[dict]:
    """Price ticks of the offers between two wall times: the real GCE price history,
    replayed at `price_days_per_wall_s` days per wall second from the market's epoch."""
    start_hist = datetime(2024, 1, 1, tzinfo=timezone.utc).timestamp()

    def hist_time(wall: float) -> float:
        return start_hist + (wall - config.epoch_wall) * config.price_days_per_wall_s * 86400.0

    lo, hi = hist_time(since_wall if since_wall is not None else config.epoch_wall), hist_time(now_wall)
    ticks = []
    for offer in offers:
        _, itype, region = offer.offer_id.split(":", 2)
        history = price_history(itype, region)
        if since_wall is None:  # the price in force when the replay starts, then its changes
            before = [h for h in history if h[0].timestamp() <= lo]
            history = before[-1:] + [h for h in history if h[0].timestamp() > lo]
        for when, on_demand, spot in history:
            ts = when.timestamp()
            if ts <= lo and since_wall is not None or ts > hi:
                continue
            wall = config.epoch_wall + (max(ts, start_hist) - start_hist) / (config.price_days_per_wall_s * 86400.0)
            ticks.append({"offer_id": offer.offer_id, "wall": max(wall, since_wall or config.epoch_wall),
                          "usd_per_hour_spot": spot, "usd_per_hour_on_demand": on_demand,
                          "history_time": when.isoformat()})
    return ticks
