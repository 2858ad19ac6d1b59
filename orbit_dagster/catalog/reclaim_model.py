"""ReclaimModel: how long spot instances live and how long the market stays dry, fitted from traces.

What is fitted, and why this shape:

- Up-times (instance lifetimes) and down-times are heavy-tailed in the real traces (median
  up-time 0.4 h against a mean of 1.4-3 h), so each is a Weibull whose *shape* is shared
  by all zones (MLE on the durations of every trace, each divided by its own zone's mean
  so that zones with different rates do not fake a heavy tail) while the *mean* varies by
  zone.
- Zone-to-zone variation of the reclaim rate (reclaims per hour of up-time) is a Gamma
  fitted by the method of moments over the traces: it is the conjugate prior of the
  online estimator in ``policy.reclaim_rate`` and the generator draws a zone from it.
- Zone mean down-times are log-normal across zones.
- Spot-advisor bands are relative risk figures; the band of the traced instance type is
  calibrated to the traces' mean rate and the other bands scaled by their nominal
  monthly frequency (an assumption, written into docs/policies.md).

Nothing here is tuned by hand to a particular file: ``fit_reclaim_model`` is the only
source of the numbers in the shipped ``orbit_dagster/data/reclaim_model.json``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from orbit_dagster.catalog.traces import Trace
from orbit_dagster.core.errors import OrbitError

#: Nominal monthly interruption frequency per spot-advisor band: the band midpoints, and
#: 25% for the open-ended ">20%" band. Only their ratios are used (see module docstring).
BAND_NOMINAL_MONTHLY = {0: 0.025, 1: 0.075, 2: 0.125, 3: 0.175, 4: 0.25}
BAND_LABELS = {0: "<5%", 1: "5-10%", 2: "10-15%", 3: "15-20%", 4: ">20%"}
MODEL_FILE = "reclaim_model.json"


@dataclass(frozen=True)
class ReclaimModel:
    """Fitted parameters; every field is a derived figure, never trace data."""

    up_shape: float
    down_shape: float
    zone_rate_alpha: float
    zone_rate_beta_h: float
    zone_down_log_mu: float
    zone_down_log_sigma: float
    band_rates_per_hour: dict[str, float]
    calibrated_bands: tuple[int, ...]
    spot_usd_per_hour: float
    on_demand_usd_per_hour: float
    fitted_from: tuple[str, ...] = ()
    per_trace: tuple[dict[str, Any], ...] = ()
    notes: dict[str, str] = field(default_factory=dict)
    version: int = 1

    @property
    def mean_rate_per_hour(self) -> float:
        """Mean zone reclaim rate per hour of up-time (the Gamma mean)."""
        return self.zone_rate_alpha / self.zone_rate_beta_h

    @property
    def prior_up_mean_s(self) -> float:
        return 3600.0 / self.mean_rate_per_hour

    @property
    def prior_down_mean_s(self) -> float:
        return math.exp(self.zone_down_log_mu + self.zone_down_log_sigma ** 2 / 2)

    def band_rate(self, band: int | str) -> float:
        """Reclaims per hour of up-time for a spot-advisor band code (0..4) or label ('<5%')."""
        code = band_code(band)
        return self.band_rates_per_hour[str(code)]

    def to_json(self) -> str:
        d = asdict(self)
        d["calibrated_bands"] = list(self.calibrated_bands)
        d["fitted_from"] = list(self.fitted_from)
        d["per_trace"] = list(self.per_trace)
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ReclaimModel":
        kw = dict(d)
        kw["calibrated_bands"] = tuple(kw.get("calibrated_bands", ()))
        kw["fitted_from"] = tuple(kw.get("fitted_from", ()))
        kw["per_trace"] = tuple(kw.get("per_trace", ()))
        return cls(**kw)


def band_code(band: int | str) -> int:
    """A band code from 0..4 or its spot-advisor label; a clear error otherwise."""
    if isinstance(band, int) and band in BAND_LABELS:
        return band
    if isinstance(band, str):
        s = band.strip()
        if s.isdigit() and int(s) in BAND_LABELS:
            return int(s)
        for code, label in BAND_LABELS.items():
            if s == label:
                return code
    raise OrbitError(f"unknown spot-advisor interruption band {band!r}", field="interruption_band", value=band,
                     fix="use a code 0..4 or a label: " + ", ".join(BAND_LABELS.values()))


# ---------------------------------------------------------------- fitting

def runs_of(trace: Trace, nodes: int = 1) -> list[tuple[bool, int]]:
    """(available, length in ticks) for each maximal run of equal availability."""
    out: list[tuple[bool, int]] = []
    for v in trace.available(nodes):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def trace_stats(trace: Trace) -> dict[str, Any]:
    """Per-trace figures: availability, reclaims, up-hours, rate, mean up/down (censored runs dropped)."""
    runs = runs_of(trace)
    gap = trace.gap_seconds
    avail = trace.available()
    reclaims = sum(1 for a, b in zip(avail, avail[1:]) if a and not b)
    up_s = sum(avail) * gap
    inner = runs[1:-1]  # the first and last runs are censored by the trace's ends
    ups = [n * gap for v, n in inner if v]
    downs = [n * gap for v, n in inner if not v]
    return {
        "name": trace.name,
        "gap_seconds": gap,
        "ticks": len(trace.data),
        "availability": round(sum(avail) / len(avail), 6),
        "reclaims": reclaims,
        "up_hours": round(up_s / 3600, 4),
        "rate_per_hour": round(reclaims / (up_s / 3600), 6) if up_s > 0 else 0.0,
        "mean_up_s": round(float(np.mean(ups)), 3) if ups else None,
        "mean_down_s": round(float(np.mean(downs)), 3) if downs else None,
        "_ups": ups,
        "_downs": downs,
    }


def weibull_shape_mle(x: Sequence[float]) -> float:
    """MLE of the Weibull shape k (scale profiled out), by bisection on the score equation."""
    arr = np.asarray([v for v in x if v > 0], dtype=float)
    if arr.size < 3 or np.ptp(arr) == 0:
        return 1.0
    arr = arr / arr.mean()
    logs = np.log(arr)

    def score(k: float) -> float:
        w = arr ** k
        return float((w * logs).sum() / w.sum() - 1.0 / k - logs.mean())

    lo, hi = 0.05, 20.0
    if score(lo) > 0:
        return lo
    if score(hi) < 0:
        return hi
    for _ in range(80):
        mid = (lo + hi) / 2
        if score(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _gamma_moments(rates: Sequence[float]) -> tuple[float, float]:
    """Gamma(alpha, beta) by the method of moments; a weak prior when there is one zone or no spread."""
    r = np.asarray(rates, dtype=float)
    m = float(r.mean())
    v = float(r.var(ddof=1)) if r.size > 1 else 0.0
    if v <= 0:
        alpha = 1.0  # no information about spread: a prior worth about one reclaim
    else:
        alpha = m * m / v
    return alpha, alpha / m


def fit_reclaim_model(traces: Iterable[Trace], *, bands: Mapping[str, int] | None = None,
                      on_demand_usd_per_hour: float, default_spot_usd_per_hour: float | None = None,
                      notes: Mapping[str, str] | None = None) -> ReclaimModel:
    """Fit a ReclaimModel from traces. ``bands`` maps trace name -> spot-advisor band of its instance type.

    Without a spot price (no priced trace, no advisor savings) spot is priced like on-demand:
    pessimistic on purpose, so that no saving is ever claimed from a missing figure.
    """
    stats = [trace_stats(t) for t in traces]
    stats = [s for s in stats if s["reclaims"] > 0 and s["up_hours"] > 0]
    if not stats:
        raise OrbitError("no trace with at least one reclaim to fit from", field="traces", value=0,
                         fix="pass spot traces (preemption or availability) that contain 1->0 edges")
    norm_up = [u / s["mean_up_s"] for s in stats if s["mean_up_s"] for u in s["_ups"]]
    norm_down = [d / s["mean_down_s"] for s in stats if s["mean_down_s"] for d in s["_downs"]]
    alpha, beta = _gamma_moments([s["rate_per_hour"] for s in stats])
    log_down = np.log([s["mean_down_s"] for s in stats if s["mean_down_s"]])
    band_rates: dict[int, list[float]] = {}
    for s in stats:
        b = (bands or {}).get(s["name"])
        if b is not None:
            band_rates.setdefault(band_code(b), []).append(s["rate_per_hour"])
    if not band_rates:  # unknown instance types: treat the traces as the riskiest band
        band_rates = {4: [s["rate_per_hour"] for s in stats]}
    # per-band calibration, each band's rate per unit of nominal frequency, averaged
    per_unit = float(np.mean([np.mean(v) / BAND_NOMINAL_MONTHLY[b] for b, v in band_rates.items()]))
    band_out = {str(b): (float(np.mean(band_rates[b])) if b in band_rates else per_unit * BAND_NOMINAL_MONTHLY[b])
                for b in BAND_LABELS}
    spot = default_spot_usd_per_hour
    public = tuple({k: v for k, v in s.items() if not k.startswith("_")} for s in stats)
    return ReclaimModel(
        up_shape=round(weibull_shape_mle(norm_up), 6),
        down_shape=round(weibull_shape_mle(norm_down), 6),
        zone_rate_alpha=round(alpha, 6),
        zone_rate_beta_h=round(beta, 6),
        zone_down_log_mu=round(float(log_down.mean()), 6),
        zone_down_log_sigma=round(float(log_down.std(ddof=1)) if log_down.size > 1 else 0.5, 6),
        band_rates_per_hour={k: round(v, 6) for k, v in band_out.items()},
        calibrated_bands=tuple(sorted(band_rates)),
        spot_usd_per_hour=round(float(spot if spot is not None else on_demand_usd_per_hour), 6),
        on_demand_usd_per_hour=on_demand_usd_per_hour,
        fitted_from=tuple(s["name"] for s in stats),
        per_trace=public,
        notes=dict(notes or {}),
    )


def mean_trace_price(traces: Iterable[Trace]) -> float | None:
    """Tick-weighted mean spot $/h over the traces that carry prices."""
    prices = [p for t in traces if t.prices for p in t.prices]
    return float(np.mean(prices)) if prices else None


# ---------------------------------------------------------------- generation

def _weibull_scale(mean: float, shape: float) -> float:
    return mean / math.gamma(1.0 + 1.0 / shape)


def generate_trace(model: ReclaimModel, seed: int, duration_s: float, gap_seconds: float) -> Trace:
    """A synthetic trace in the preemption format: one zone drawn from the model, then
    alternating Weibull up/down spans, sampled at tick starts. Deterministic per seed."""
    if duration_s <= 0 or gap_seconds <= 0:
        raise OrbitError("duration_s and gap_seconds must be > 0", field="duration_s/gap_seconds",
                         value=(duration_s, gap_seconds), fix="pass positive seconds")
    rng = np.random.default_rng(seed)
    rate = float(rng.gamma(model.zone_rate_alpha, 1.0 / model.zone_rate_beta_h))
    rate = min(max(rate, 0.02), 5.0)  # keep zones within what a market can look like
    up_mean = 3600.0 / rate
    down_mean = float(math.exp(rng.normal(model.zone_down_log_mu, model.zone_down_log_sigma)))
    down_mean = min(max(down_mean, gap_seconds), 48 * 3600.0)
    up_scale = _weibull_scale(up_mean, model.up_shape)
    down_scale = _weibull_scale(down_mean, model.down_shape)
    n = int(math.ceil(duration_s / gap_seconds))
    state = bool(rng.random() < up_mean / (up_mean + down_mean))
    data: list[int] = []
    t_next = 0.0
    k = 0
    while k < n:
        span = (up_scale if state else down_scale) * float(rng.weibull(model.up_shape if state else model.down_shape))
        t_end = t_next + span
        while k < n and k * gap_seconds < t_end:
            data.append(1 if state else 0)
            k += 1
        t_next = t_end
        state = not state
    prices = tuple([model.spot_usd_per_hour] * n)
    return Trace(name=f"synthetic-seed{seed}", gap_seconds=float(gap_seconds), data=tuple(data),
                 prices=prices, kind="preemption")


@lru_cache(maxsize=1)
def load_reclaim_model() -> ReclaimModel:
    """The fitted model shipped in ``orbit_dagster/data/reclaim_model.json`` (read once per process)."""
    path = Path(__file__).resolve().parents[1] / "data" / MODEL_FILE
    try:
        text = path.read_text()
    except FileNotFoundError as err:
        raise OrbitError("the fitted reclaim model is missing", field=MODEL_FILE, value=None,
                         fix="run: python -m orbit_dagster.catalog.fit_reclaims <shared data dir>") from err
    return ReclaimModel.from_dict(json.loads(text))
