"""Price and reclaim-rate trends per offer: an exponentially weighted level with a seasonal term.

Both forecasts read a history on a regular grid of `step_s` seconds (`step_series` turns
price change points into one; `rate_bins` turns instance lifetimes and reclaims into
exposure and counts per step) and answer for the next `horizon` steps. The season is a
cycle of `period` steps aligned to the clock (`phase_of`: with hourly steps and a period of
24, the hour of the day, UTC), so a market that is dearer or reclaims more at some hours
shows it.

- **Price** (`SeasonalEW`): additive Holt-Winters without trend. Per observation y at phase
  p: the error e = y - (level + season[p]); level += alpha * (y - season[p] - level);
  season[p] += gamma * (y - level - season[p]). The forecast h steps on is level +
  season[p + h]. alpha = 1, gamma = 0 is the naive "last value"; small alpha is close to a
  moving mean.
- **Reclaim rate** (`SeasonalRate`): a Gamma-Poisson rate whose evidence decays: reclaims N
  and exposure E (hours) are discounted by (1 - alpha) per step, and the level is
  (N + a0) / (E + b0) with the prior (a0 pseudo-reclaims over b0 hours, e.g. the offer's
  band); each phase's factor is its own (undiscounted) rate over the overall one, shrunk
  to 1 by `shrink_h` pseudo-hours of exposure at the overall rate.

Their parameters are fitted (`fit_price_model`, `fit_rate_model`: a grid search that
minimises the forecast's mean absolute error on the training series), never set by hand;
`bench/price_forecast.py` fits them on one part of the recorded history and measures the
error on history held back, beside the naive baselines. `choose_price` and `choose_rate`
make the same check on one offer's own history, for a decision: the forecast is used only
where its held-back error is lower than the naive figure's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from orbit_dagster.core.errors import OrbitError

ALPHAS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
GAMMAS = (0.0, 0.05, 0.1, 0.2, 0.4)
RATE_ALPHAS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
SHRINKS_H = (1.0, 5.0, 20.0, 100.0, math.inf)


def phase_of(t_s: float, step_s: float, period: int) -> int:
    """Where in the season the step starting at `t_s` lies (clock-aligned: epoch 0 is phase 0)."""
    return int(math.floor(t_s / step_s + 1e-9)) % period


def _check(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OrbitError(f"{name} must be in [{low}, {high}]", field=name, value=value,
                         fix=f"pass a number between {low} and {high}")


def step_series(points: Iterable[tuple[float, float | None]], *, start_s: float, step_s: float,
                count: int) -> list[float | None]:
    """A step function of change points `(time, value)` (value None: not sold then) read at
    `start_s + k * step_s` for k < count: the last value at or before each time, None before
    the first point."""
    if step_s <= 0 or count < 0:
        raise OrbitError("a series needs step_s > 0 and count >= 0", field="step_s", value=step_s,
                         fix="pass the grid's step in seconds")
    pts = sorted(points, key=lambda p: p[0])
    out: list[float | None] = []
    i, current = 0, None
    for k in range(count):
        t = start_s + k * step_s
        while i < len(pts) and pts[i][0] <= t:
            current = pts[i][1]
            i += 1
        out.append(current)
    return out


@dataclass(frozen=True)
class SeasonalEW:
    """Additive exponentially weighted level + seasonal term (see the module's doc)."""

    alpha: float
    gamma: float = 0.0
    period: int = 24

    def __post_init__(self) -> None:
        _check("alpha", self.alpha, 1e-6, 1.0)
        _check("gamma", self.gamma, 0.0, 1.0)
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise OrbitError("period must be an integer >= 1", field="period", value=self.period,
                             fix="pass the season's length in steps, e.g. 24 for hourly steps")

    def run(self, series: Sequence[float | None], phase0: int = 0) -> "SeasonalState":
        """The state after reading `series` (None entries are skipped: no price then)."""
        state = SeasonalState(self, None, (0.0,) * self.period, phase0 - 1)
        for y in series:
            state = state.read(y)
        return state

    def forecast(self, series: Sequence[float | None], horizon: int, phase0: int = 0) -> list[float | None]:
        return self.run(series, phase0).forecast(horizon)

    def rolling_errors(self, series: Sequence[float | None], *, horizon: int, start: int, phase0: int = 0,
                       every: int = 1) -> list[float]:
        """Absolute errors of the `horizon`-step forecast made after every `every`-th step from
        `start` on, against the values that followed (one pass over the series)."""
        state = SeasonalState(self, None, (0.0,) * self.period, phase0 - 1)
        errors: list[float] = []
        for origin, y in enumerate(series):
            if origin >= max(start, 1) and origin + horizon <= len(series) and (origin - start) % every == 0:
                errors += _abs_errors(state.forecast(horizon), series[origin:origin + horizon])
            state = state.read(y)
        return errors


def _abs_errors(got: Sequence[float | None], want: Sequence[float | None]) -> list[float]:
    return [abs(g - w) for g, w in zip(got, want) if g is not None and w is not None]


@dataclass(frozen=True)
class SeasonalState:
    model: SeasonalEW
    level: float | None
    season: tuple[float, ...]
    last_phase: int  # the absolute phase of the last step read

    def read(self, y: float | None) -> "SeasonalState":
        """The state after one more step (value `y`, or None: nothing observed)."""
        m, p = self.model, self.last_phase + 1
        if y is None:
            return SeasonalState(m, self.level, self.season, p)
        if self.level is None:
            return SeasonalState(m, float(y), self.season, p)
        i = p % m.period
        level = self.level + m.alpha * (y - self.season[i] - self.level)
        if m.gamma == 0:
            return SeasonalState(m, level, self.season, p)
        season = list(self.season)
        season[i] += m.gamma * (y - level - season[i])
        return SeasonalState(m, level, tuple(season), p)

    def forecast(self, horizon: int) -> list[float | None]:
        """The next `horizon` steps (None when nothing was observed)."""
        if self.level is None:
            return [None] * horizon
        n = self.model.period
        return [self.level + self.season[(self.last_phase + h) % n] for h in range(1, horizon + 1)]


@dataclass(frozen=True)
class NaiveState:
    """The naive baselines a forecast must beat, read like `SeasonalState`: `last` (the last value
    seen) or `mean` (the mean of every value seen)."""

    kind: str  # last | mean
    total: float = 0.0
    count: int = 0
    last: float | None = None

    def read(self, y: float | None) -> "NaiveState":
        if y is None:
            return self
        return NaiveState(self.kind, self.total + y, self.count + 1, float(y))

    def forecast(self, horizon: int) -> list[float | None]:
        value = self.last if self.kind == "last" else (self.total / self.count if self.count else None)
        return [value] * horizon


def naive_errors(kind: str, series: Sequence[float | None], *, horizon: int, start: int,
                 every: int = 1) -> list[float]:
    """`SeasonalEW.rolling_errors` of a naive baseline (`last` or `mean`)."""
    state, errors = NaiveState(kind), []
    for origin, y in enumerate(series):
        if origin >= max(start, 1) and origin + horizon <= len(series) and (origin - start) % every == 0:
            errors += _abs_errors(state.forecast(horizon), series[origin:origin + horizon])
        state = state.read(y)
    return errors


def fit_price_model(series_list: Sequence[tuple[Sequence[float | None], int]], *, horizon: int, period: int,
                    start: int, every: int = 1, alphas: Sequence[float] = ALPHAS,
                    gammas: Sequence[float] = GAMMAS) -> tuple[SeasonalEW, float]:
    """The (alpha, gamma) of the grid with the least mean absolute `horizon`-step error over the
    training series `(series, phase0)`, and that error."""
    models = [SeasonalEW(alpha, gamma, period) for alpha in alphas for gamma in (gammas if period > 1 else (0.0,))]
    best = _least_error(models, lambda model: [
        e for series, phase0 in series_list
        for e in model.rolling_errors(series, horizon=horizon, start=start, phase0=phase0, every=every)])
    if best is None:
        raise OrbitError("no training series long enough to fit the price model", field="series",
                         value=len(series_list), fix=f"give series longer than {start + horizon} steps")
    return best


# ---------------------------------------------------------------- reclaim rates

def rate_bins(sessions: Iterable[tuple[float, float, bool]], *, start_s: float, step_s: float,
              count: int) -> tuple[list[float], list[int]]:
    """Exposure hours and reclaims per step from instance sessions `(begin_s, end_s, reclaimed)`:
    each session's up-time split over the steps it covers, its reclaim counted in the step of its end."""
    exposure, reclaims = [0.0] * count, [0] * count
    for begin, end, reclaimed in sessions:
        t = max(begin, start_s)
        while t < end:
            k = int((t - start_s) // step_s)
            if k >= count:
                break
            nxt = min(end, start_s + (k + 1) * step_s)
            exposure[k] += (nxt - t) / 3600.0
            t = nxt
        k = int((end - start_s) // step_s)
        if reclaimed and 0 <= k < count and end >= start_s:
            reclaims[k] += 1
    return exposure, reclaims


@dataclass(frozen=True)
class SeasonalRate:
    """Discounted Gamma-Poisson reclaim rate with a shrunk seasonal factor (see the module's doc)."""

    alpha: float
    shrink_h: float = math.inf
    period: int = 24
    prior_reclaims: float = 0.5
    prior_hours: float = 1.0

    def __post_init__(self) -> None:
        _check("alpha", self.alpha, 0.0, 1.0)
        if not (self.shrink_h > 0 and self.prior_reclaims >= 0 and self.prior_hours > 0):
            raise OrbitError("shrink_h and prior_hours must be > 0, prior_reclaims >= 0", field="SeasonalRate",
                             value=(self.shrink_h, self.prior_reclaims, self.prior_hours),
                             fix="pass the seasonal shrinkage and the prior's pseudo-counts")

    @classmethod
    def with_prior(cls, alpha: float, shrink_h: float, period: int, rate_per_hour: float,
                   strength: float) -> "SeasonalRate":
        """The prior: `strength` pseudo-reclaims at `rate_per_hour` (e.g. the band's rate and the
        fitted zone spread, `ReclaimModel.zone_rate_alpha`)."""
        return cls(alpha, shrink_h, period, strength, strength / rate_per_hour)

    def start(self, phase0: int = 0) -> "RateState":
        return RateState(self, 0.0, 0.0, (0.0,) * self.period, (0.0,) * self.period, phase0 - 1)

    def forecast(self, exposure_h: Sequence[float], reclaims: Sequence[int], horizon: int,
                 phase0: int = 0) -> list[float]:
        """Reclaims per hour of up-time for each of the next `horizon` steps."""
        state = self.start(phase0)
        for x, c in zip(exposure_h, reclaims):
            state = state.read(x, c)
        return state.forecast(horizon)

    def rolling_errors(self, exposure_h: Sequence[float], reclaims: Sequence[int], *, horizon: int, start: int,
                       phase0: int = 0, every: int = 1) -> list[float]:
        """Absolute errors in reclaims over the next `horizon` steps: the forecast rates made after
        every `every`-th step from `start` on, times the exposure those steps had, against the count."""
        return rate_errors(lambda: self.start(phase0), exposure_h, reclaims, horizon=horizon, start=start,
                           every=every)


@dataclass(frozen=True)
class RateState:
    model: SeasonalRate
    n: float  # discounted reclaims
    e: float  # discounted exposure hours
    per_n: tuple[float, ...]  # reclaims per phase
    per_e: tuple[float, ...]  # exposure hours per phase
    last_phase: int

    def read(self, exposure_h: float, reclaims: int) -> "RateState":
        m, p = self.model, self.last_phase + 1
        decay = 1.0 - m.alpha
        i = p % m.period
        per_n, per_e = list(self.per_n), list(self.per_e)
        per_n[i] += reclaims
        per_e[i] += exposure_h
        return RateState(m, self.n * decay + reclaims, self.e * decay + exposure_h, tuple(per_n), tuple(per_e), p)

    @property
    def level(self) -> float:
        return (self.n + self.model.prior_reclaims) / (self.e + self.model.prior_hours)

    def forecast(self, horizon: int) -> list[float]:
        m = self.model
        overall = (sum(self.per_n) + m.prior_reclaims) / (sum(self.per_e) + m.prior_hours)
        out = []
        for h in range(1, horizon + 1):
            i = (self.last_phase + h) % m.period
            if math.isinf(m.shrink_h) or overall <= 0:
                factor = 1.0
            else:
                factor = (self.per_n[i] + m.shrink_h * overall) / (self.per_e[i] + m.shrink_h) / overall
            out.append(self.level * factor)
        return out


def rate_errors(fresh, exposure_h: Sequence[float], reclaims: Sequence[int], *, horizon: int, start: int,
                every: int = 1) -> list[float]:
    """Absolute errors in reclaims over the next `horizon` steps of a rate forecaster: `fresh()`
    is its state before any step, with `read(x, c)` and `forecast(horizon)` (one pass)."""
    state = fresh()
    errors = []
    for origin, (x, c) in enumerate(zip(exposure_h, reclaims)):
        if origin >= max(start, 1) and origin + horizon <= len(exposure_h) and (origin - start) % every == 0:
            ahead = exposure_h[origin:origin + horizon]
            if sum(ahead) > 0:
                expected = sum(r * a for r, a in zip(state.forecast(horizon), ahead))
                errors.append(abs(expected - sum(reclaims[origin:origin + horizon])))
        state = state.read(x, c)
    return errors


@dataclass(frozen=True)
class TrailingRate:
    """The naive rate baselines, read like `RateState`: reclaims over exposure of the last `window`
    steps (`window` None: of everything seen, the cumulative mean), with the same prior."""

    window: int | None
    prior_reclaims: float = 0.5
    prior_hours: float = 1.0
    seen: tuple[tuple[float, int], ...] = ()
    n: float = 0.0
    e: float = 0.0

    def read(self, exposure_h: float, reclaims: int) -> "TrailingRate":
        if self.window is None:
            return TrailingRate(None, self.prior_reclaims, self.prior_hours, (), self.n + reclaims,
                                self.e + exposure_h)
        seen = (self.seen + ((exposure_h, reclaims),))[-self.window:]
        return TrailingRate(self.window, self.prior_reclaims, self.prior_hours, seen,
                            float(sum(c for _, c in seen)), sum(x for x, _ in seen))

    def forecast(self, horizon: int) -> list[float]:
        return [(self.n + self.prior_reclaims) / (self.e + self.prior_hours)] * horizon


def fit_rate_model(bins_list: Sequence[tuple[Sequence[float], Sequence[int], int]], *, horizon: int, period: int,
                   start: int, prior_rate_per_hour: float, prior_strength: float, every: int = 1,
                   alphas: Sequence[float] = RATE_ALPHAS,
                   shrinks: Sequence[float] = SHRINKS_H) -> tuple[SeasonalRate, float]:
    """The (alpha, shrink) of the grid with the least mean absolute error in reclaims over the next
    `horizon` steps, over the training `(exposure, reclaims, phase0)` series, and that error."""
    models = [SeasonalRate.with_prior(alpha, shrink, period, prior_rate_per_hour, prior_strength)
              for alpha in alphas for shrink in shrinks]
    best = _least_error(models, lambda model: [
        e for exposure, reclaims, phase0 in bins_list
        for e in model.rolling_errors(exposure, reclaims, horizon=horizon, start=start, phase0=phase0, every=every)])
    if best is None:
        raise OrbitError("no training history long enough to fit the rate model", field="bins",
                         value=len(bins_list), fix=f"give histories longer than {start + horizon} steps")
    return best


def _least_error(models: Sequence, errors_of) -> tuple | None:
    """(model, mean absolute error) of the grid's model with the least error, the first of
    equals in grid order; None when no model has an error to measure (series too short)."""
    best = None
    for model in models:
        errors = errors_of(model)
        if errors:
            mae = sum(errors) / len(errors)
            if best is None or mae < best[1] - 1e-15:
                best = (model, mae)
    return best


# ---------------------------------------------------------------- earned use

#: Steps of an offer's own history held back, on top of the fit's (`period` + horizon): the
#: forecast made after each of them is scored against what followed.
HOLDOUT = 24
#: The fit before the held-back part scores the grid at every FIT_EVERY-th origin only: a
#: decision fits again whenever an offer's history changed (control.trends keeps the answer
#: until then), and this keeps a fit on a month of history well under a second.
FIT_EVERY = 3
#: The fewest reclaims the held-back part and the part before it must each hold for a rate
#: forecast to be judged at all. With none held back, a forecast near 0 "beats" the cumulative
#: rate without having learnt anything (its error is the reclaims it did not expect: none);
#: with one or two, which model wins is decided by where those few fell. Five is where a
#: Poisson count's relative spread, 1/sqrt(5), falls under a half. Below it the decision
#: keeps the cumulative rate (and does not fit).
MIN_RECLAIMS = 5


@dataclass(frozen=True)
class TrendChoice:
    """Which figure a decision uses for one offer's price or reclaim rate over a horizon.

    `source` is "forecast" only when the model, fitted on the offer's history before the
    held-back part, had a lower mean absolute error there than the naive baseline
    (`forecast_error` < `baseline_error`); `value` is then the mean of its forecast over
    the horizon. Otherwise "baseline": the caller keeps today's input and `value` is None."""

    source: str  # forecast | baseline
    value: float | None
    forecast_error: float | None
    baseline_error: float | None
    why: str

    @property
    def used(self) -> bool:
        return self.source == "forecast"

    def as_record(self) -> dict:
        return {"source": self.source, "value": _r6(self.value), "forecast_error": _r6(self.forecast_error),
                "baseline_error": _r6(self.baseline_error), "why": self.why}


def _r6(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _baseline(why: str, fe: float | None = None, be: float | None = None) -> TrendChoice:
    return TrendChoice("baseline", None, fe, be, why)


def _mae(errors: list[float]) -> float | None:
    return sum(errors) / len(errors) if errors else None


def _cut(n: int, horizon: int, period: int, holdout: int) -> int | None:
    """Where the held-back part starts, or None when the history is too short to fit before it."""
    cut = n - max(holdout, horizon)
    return cut if cut >= period + horizon else None


def choose_price(series: Sequence[float | None], phase0: int = 0, *, horizon: int, period: int = 24,
                 holdout: int = HOLDOUT) -> TrendChoice:
    """The price forecast over the next `horizon` steps, if it earned it on this series: the
    model is fitted (`fit_price_model`) on the steps before the last `max(holdout, horizon)`
    and scored on those by a rolling origin (a forecast after each step, against the steps
    that followed), beside the last value. Deterministic: the same series, the same answer."""
    cut = _cut(len(series), horizon, period, holdout)
    if cut is None:
        return _baseline(f"too little history: {len(series)} steps, under {period + horizon} to fit and "
                         f"{max(holdout, horizon)} held back")
    try:
        model, _ = fit_price_model([(series[:cut], phase0)], horizon=horizon, period=period, start=period,
                                   every=FIT_EVERY)
    except OrbitError:
        return _baseline("no price in the history before the held-back part")
    fe = _mae(model.rolling_errors(series, horizon=horizon, start=cut, phase0=phase0))
    be = _mae(naive_errors("last", series, horizon=horizon, start=cut))
    if fe is None or be is None:
        return _baseline("no price in the held-back part", fe, be)
    if not fe < be:
        return _baseline(f"the forecast (alpha {model.alpha:g}, gamma {model.gamma:g}) did not beat the last "
                         "price on the held-back history", fe, be)
    ahead = [v for v in model.forecast(series, horizon, phase0) if v is not None]
    return TrendChoice("forecast", max(sum(ahead) / len(ahead), 0.0), fe, be,
                       f"seasonal EW (alpha {model.alpha:g}, gamma {model.gamma:g}) beat the last price on the "
                       "held-back history")


def choose_rate(exposure_h: Sequence[float], reclaims: Sequence[int], phase0: int = 0, *, horizon: int,
                prior_rate_per_hour: float, prior_strength: float, period: int = 24,
                holdout: int = HOLDOUT, min_reclaims: int = MIN_RECLAIMS) -> TrendChoice:
    """`choose_price` for the reclaim rate: the fitted `SeasonalRate` against the cumulative rate
    over the same prior (`TrailingRate(None)`, what dispatch's estimator is), errors in reclaims
    over the next `horizon` steps. Judged only when the held-back part and the part before it
    each hold at least `min_reclaims` reclaims (`MIN_RECLAIMS`); otherwise the baseline, unfitted."""
    cut = _cut(len(exposure_h), horizon, period, holdout)
    if cut is None:
        return _baseline(f"too little history: {len(exposure_h)} steps, under {period + horizon} to fit and "
                         f"{max(holdout, horizon)} held back")
    fit_n, held_n = sum(reclaims[:cut]), sum(reclaims[cut:])
    if fit_n < min_reclaims or held_n < min_reclaims:
        return _baseline(f"too few reclaims to judge a rate forecast: {held_n} in the {len(exposure_h) - cut} "
                         f"held-back steps and {fit_n} before them, under {min_reclaims} in each")
    prior = dict(prior_rate_per_hour=prior_rate_per_hour, prior_strength=prior_strength)
    try:
        model, _ = fit_rate_model([(exposure_h[:cut], reclaims[:cut], phase0)], horizon=horizon, period=period,
                                  start=period, every=FIT_EVERY, **prior)
    except OrbitError:
        return _baseline("no up-time in the history before the held-back part")
    fe = _mae(model.rolling_errors(exposure_h, reclaims, horizon=horizon, start=cut, phase0=phase0))
    be = _mae(rate_errors(lambda: TrailingRate(None, model.prior_reclaims, model.prior_hours), exposure_h, reclaims,
                          horizon=horizon, start=cut))
    if fe is None or be is None:
        return _baseline("no up-time in the held-back part", fe, be)
    if not fe < be:
        return _baseline(f"the forecast (alpha {model.alpha:g}, shrink {model.shrink_h:g} h) did not beat the "
                         "cumulative rate on the held-back history", fe, be)
    ahead = model.forecast(exposure_h, reclaims, horizon, phase0)
    return TrendChoice("forecast", sum(ahead) / len(ahead), fe, be,
                       f"seasonal EW rate (alpha {model.alpha:g}, shrink {model.shrink_h:g} h) beat the cumulative "
                       "rate on the held-back history")
