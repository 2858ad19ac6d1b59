"""Recorded availability: an offer's spot history in the ledger, as a trace `orbit simulate` replays.

The ledger knows, per offer, every billed spot instance: when it started and stopped, and
whether an attempt on it was lost to a reclaim. Laid end to end, in market time, those
lifetimes are the offer's recorded availability:

- each instance contributes its up-time as up ticks at its price per hour (on a compressed
  market, the embedded one at `ORBIT_SIM_SCALE`, per hour of market time: a replay's dollars
  are what the market's hours would cost at that price, the scale times its wall-second bill);
- an instance that ended in a reclaim is followed by down ticks: until the next instance of
  that offer started, at most `DOWN_CAP_S` (the fitted reclaim model's mean down-time: the
  ledger cannot tell how long the market stayed dry when nothing asked it), at least one tick;
- an instance that ended otherwise (its job finished, was cancelled or moved) is followed
  directly by the next one, so no reclaim is invented between them.

The trace's up-time and reclaims are then exactly the ledger's exposure and reclaims of the
offer (up to a tick's rounding of the total), which is what the online policies learn from
too (`control.observations.observed_reclaims`). It is a file in the skypilot format
(`catalog.traces`), written under `$ORBIT_HOME/advice/`, so that a person can replay it with
`orbit simulate --trace FILE` and get the figures `orbit advise` quotes.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..catalog.reclaim_model import load_reclaim_model
from ..ledger import Ledger

TICK_S = 60.0
# Provider -> the cloud a replay labels its trace with (its notice is always given explicitly):
# the embedded market's shapes are GCE's.
CLOUD_OF = {"aws": "aws", "gce": "gcp", "sim": "gcp"}


def down_cap_s() -> float:
    """The fitted model's mean down-time of a zone (market seconds)."""
    return load_reclaim_model().prior_down_mean_s


@dataclass(frozen=True)
class Session:
    start_s: float  # market seconds (wall seconds x the market's time scale)
    end_s: float
    reclaimed: bool
    usd_per_hour: float  # the instance's price per hour


@dataclass
class OfferRecord:
    """An offer's billed spot instances, oldest first."""

    offer_id: str
    provider: str
    instance_type: str
    gpu: str
    gpu_count: int
    zone: str
    scale: float
    sessions: list[Session] = field(default_factory=list)

    @property
    def exposure_h(self) -> float:
        return sum(s.end_s - s.start_s for s in self.sessions) / 3600.0

    @property
    def reclaims(self) -> int:
        return sum(s.reclaimed for s in self.sessions)

    @property
    def usd_per_hour(self) -> float:
        """The price it was last rented at, per hour."""
        return self.sessions[-1].usd_per_hour if self.sessions else 0.0


def offer_records(ledger: Ledger, scale_of) -> dict[str, OfferRecord]:
    """Every offer with billed spot instances; `scale_of(provider)` is its market's time scale."""
    rows = ledger.rows(
        """SELECT i.instance_id, i.provider, i.offer_id, i.instance_type, i.gpu, i.gpu_count, i.zone,
                  i.usd_per_second, i.started_at, i.stopped_at,
                  max(CASE WHEN r.state = 'LOST' AND coalesce(r.failure_class, '') = 'reclaim' THEN 1 ELSE 0 END)
                      AS reclaimed
           FROM instances i LEFT JOIN runs r ON r.instance_id = i.instance_id
           WHERE i.stopped_at IS NOT NULL AND i.spot = 1 AND i.offer_id IS NOT NULL
           GROUP BY i.instance_id, i.provider, i.offer_id, i.instance_type, i.gpu, i.gpu_count, i.zone,
                    i.usd_per_second, i.started_at, i.stopped_at
           ORDER BY i.started_at, i.instance_id""")
    out: dict[str, OfferRecord] = {}
    for r in rows:
        scale = scale_of(r["provider"])
        rec = out.get(r["offer_id"])
        if rec is None:
            rec = out[r["offer_id"]] = OfferRecord(r["offer_id"], r["provider"], r["instance_type"] or "",
                                                   r["gpu"] or "", int(r["gpu_count"] or 1), r["zone"] or "", scale)
        start, stop = float(r["started_at"]) * scale, float(r["stopped_at"]) * scale
        rec.sessions.append(Session(start, max(stop, start), bool(r["reclaimed"]),
                                    float(r["usd_per_second"] or 0.0) * 3600.0))
    return out


def recorded_trace(record: OfferRecord, *, tick_s: float = TICK_S, cap_s: float | None = None) -> dict:
    """The trace document of an offer's recorded availability (see the module's doc)."""
    cap = down_cap_s() if cap_s is None else cap_s
    data: list[int] = []
    prices: list[float] = []
    clock = 0.0  # the trace's own time: up-time and down-time laid end to end

    def emit(seconds: float, value: int, price: float) -> None:
        nonlocal clock
        clock += seconds
        n = max(int(round(clock / tick_s)) - len(data), 1 if value == 0 else 0)
        data.extend([value] * n)
        prices.extend([round(price, 6)] * n)
        clock = max(clock, len(data) * tick_s) if value == 0 else clock

    sessions = sorted(record.sessions, key=lambda s: s.start_s)
    for i, s in enumerate(sessions):
        emit(s.end_s - s.start_s, 1, s.usd_per_hour)
        if s.reclaimed:
            gap = sessions[i + 1].start_s - s.end_s if i + 1 < len(sessions) else cap
            emit(min(max(gap, 0.0), cap), 0, s.usd_per_hour)
    if not data or 1 not in data:
        data, prices = [0], [record.usd_per_hour]
    return {
        "metadata": {
            "gap_seconds": tick_s, "cloud": CLOUD_OF.get(record.provider, "aws"), "instance_type": record.instance_type,
            "zone": record.zone or None, "nodes": 1,
            "recorded": {"offer_id": record.offer_id, "from": "the orbit ledger's billed spot instances",
                         "instances": len(sessions), "exposure_hours": round(record.exposure_h, 6),
                         "reclaims": record.reclaims, "time_scale": record.scale, "down_cap_s": round(cap, 3)},
        },
        "data": data,
        "prices": prices,
    }


def trace_path(home: Path, offer_id: str) -> Path:
    """Where an offer's recorded trace is written: one file per offer, a readable name."""
    return Path(home) / "advice" / (re.sub(r"[^A-Za-z0-9._-]+", "_", offer_id).strip("_") + ".json")


def write_trace(home: Path, record: OfferRecord, **kw) -> Path:
    """Write the offer's recorded trace (whole, by rename) and return its path."""
    path = trace_path(home, record.offer_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(recorded_trace(record, **kw), sort_keys=True))
    tmp.replace(path)
    return path


def gamma_interval(reclaims: int, hours: float, level: float = 0.9) -> tuple[float, float]:
    """The exact (Garwood) `level` interval of a Poisson rate per hour: `reclaims` in `hours`."""
    if hours <= 0:
        return 0.0, math.inf
    tail = (1 - level) / 2
    low = 0.0 if reclaims == 0 else _gamma_quantile(tail, reclaims) / hours
    return low, _gamma_quantile(1 - tail, reclaims + 1) / hours


def _gamma_quantile(p: float, shape: float) -> float:
    """The p-quantile of Gamma(shape, 1), by bisection on its regularised lower incomplete gamma."""
    lo, hi = 0.0, max(10.0, shape * 10 + 10)
    for _ in range(200):
        mid = (lo + hi) / 2
        if _lower_gamma(shape, mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _lower_gamma(a: float, x: float) -> float:
    """P(a, x), the regularised lower incomplete gamma function (series; continued fraction past a + 1)."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return total * math.exp(log_front)
    # Lentz's continued fraction for Q(a, x)
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return 1.0 - math.exp(log_front) * h
