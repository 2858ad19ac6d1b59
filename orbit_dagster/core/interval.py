"""How often to take a durable checkpoint: Young/Daly, aware of the reclaim notice and of instance age.

Young (1974) and Daly (2006) choose the interval tau that minimises the expected loss per
unit of work when failures arrive at rate 1/M and a checkpoint costs delta:
tau ~ sqrt(2 delta M) - delta. Two things change that for spot instances:

- **The notice.** AWS announces a reclaim 120 s ahead (GCP 30 s). When an emergency
  checkpoint fits inside the notice, a reclaim costs almost nothing and periodic
  checkpoints only insure against the reclaims the notice does *not* cover (notice not
  delivered in time, save failed). Those arrive at rate ``uncovered_fraction / M``, so the
  interval is computed with ``M / uncovered_fraction``.
- **Age.** Spot lifetimes are heavy-tailed (Weibull shape < 1, fitted in
  ``catalog.reclaim_model``): a fresh instance is the likeliest to die. The age-aware
  interval uses the expected number of reclaims over the next interval given the
  instance's age instead of a constant rate, so young instances checkpoint more often.

``IntervalRule`` is the age-aware interval with its inputs fixed: what ``OrbitInterval``
(policy/checkpointing.py) answers between two of its observations. It lives in core, with
the formulas, because it travels in every bundle (core/bundle.py): the agent on a rented
host asks it again after each durable save, as the instance ages, with the numbers the
control plane gave it at launch; `orbit simulate` asks the same object through
``OrbitInterval.interval``. Stdlib only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from orbit_dagster.core.errors import OrbitError

#: An emergency checkpoint is started this fraction of its own duration before the
#: announced reclaim time, to absorb jitter in how long a save takes.
EMERGENCY_MARGIN = 0.5
#: Share of reclaims that an emergency checkpoint is assumed not to catch even when it fits
#: in the notice (AWS: the notice is best effort). An assumption about the real world, not
#: fitted: the public traces record no notices at all.
UNCOVERED_FRACTION = 0.05
DEFAULT_MIN_S = 60.0
DEFAULT_MAX_S = 4 * 3600.0


def _check(name: str, value: float, *, positive: bool) -> None:
    bad = not isinstance(value, (int, float)) or math.isnan(value) or value < 0 or (positive and value == 0)
    if bad:
        need = "> 0" if positive else ">= 0"
        raise OrbitError(f"{name} must be {need}", field=name, value=value, fix=f"pass a number of seconds {need}")


def daly_interval(mtbf_s: float, save_s: float) -> float:
    """Daly's (2006) higher-order optimum sqrt(2 d M)(1 + sqrt(d/2M)/3 + d/18M) - d.

    Increasing in ``mtbf_s`` (tests check it); ``inf`` when reclaims never happen.
    """
    _check("mtbf_s", mtbf_s, positive=True)
    _check("save_s", save_s, positive=False)
    if math.isinf(mtbf_s):
        return math.inf
    if save_s == 0:
        return 0.0
    if save_s >= 2.0 * mtbf_s:
        # Daly's own rule here is tau = M; 8/9 M is his formula's value at the boundary and
        # keeps tau continuous and increasing in M, which the control plane relies on.
        return 8.0 * mtbf_s / 9.0
    x = save_s / (2.0 * mtbf_s)
    tau = math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s
    return max(tau, 0.0)


def emergency_covered(notice_s: float, emergency_save_s: float) -> bool:
    """Does an emergency checkpoint (with its safety margin) fit inside the reclaim notice?"""
    return notice_s > 0 and emergency_save_s * (1.0 + EMERGENCY_MARGIN) <= notice_s


def checkpoint_interval(mtbf_s: float, save_s: float, *, notice_s: float = 0.0,
                        emergency_save_s: float | None = None, min_s: float = DEFAULT_MIN_S,
                        max_s: float = DEFAULT_MAX_S, uncovered_fraction: float = UNCOVERED_FRACTION) -> float:
    """Seconds of work between durable checkpoints; never negative, shrinks as ``mtbf_s`` shrinks.

    ``emergency_save_s`` defaults to ``save_s`` (the emergency checkpoint writes the same state).
    """
    _check("mtbf_s", mtbf_s, positive=True)
    _check("save_s", save_s, positive=False)
    _check("notice_s", notice_s, positive=False)
    _check("min_s", min_s, positive=False)
    if not (0 < uncovered_fraction <= 1):
        raise OrbitError("uncovered_fraction must be in (0, 1]", field="uncovered_fraction",
                         value=uncovered_fraction, fix="pass the share of reclaims a notice does not catch")
    if max_s < min_s:
        raise OrbitError("max_s must be >= min_s", field="max_s", value=max_s, fix=f"pass max_s >= {min_s}")
    esave = save_s if emergency_save_s is None else emergency_save_s
    _check("emergency_save_s", esave, positive=False)
    mtbf = mtbf_s / uncovered_fraction if emergency_covered(notice_s, esave) else mtbf_s
    return min(max(daly_interval(mtbf, save_s), min_s), max_s)


# ---------------------------------------------------------------- age-aware (Weibull lifetimes)

def weibull_scale(mtbf_s: float, shape: float) -> float:
    """Weibull scale lambda whose mean is ``mtbf_s``."""
    return mtbf_s / math.gamma(1.0 + 1.0 / shape)


def expected_reclaims(age_s: float, span_s: float, mtbf_s: float, shape: float) -> float:
    """Expected reclaims in ``[age, age + span)`` of an instance that is alive at ``age``
    (the Weibull cumulative hazard difference)."""
    lam = weibull_scale(mtbf_s, shape)
    return ((age_s + span_s) / lam) ** shape - (age_s / lam) ** shape


def age_aware_interval(age_s: float, mtbf_s: float, save_s: float, *, shape: float,
                       min_s: float = DEFAULT_MIN_S, max_s: float = DEFAULT_MAX_S, uncovered: float = 1.0) -> float:
    """Young's rule with the local reclaim rate of an instance of age ``age_s``.

    Solves tau * uncovered * N(age, tau) = 2 * save, where N is the expected number of
    reclaims in the next tau seconds (Weibull cumulative hazard) and ``uncovered`` the share
    of them that a periodic checkpoint must insure against (1 without a usable notice).
    With shape == 1 and uncovered == 1 this is exactly Young's interval sqrt(2 save M).
    The left side grows with tau, so the root is unique; it is found by bisection in log tau.
    """
    _check("age_s", age_s, positive=False)
    _check("mtbf_s", mtbf_s, positive=True)
    _check("save_s", save_s, positive=False)
    if not shape > 0:
        raise OrbitError("shape must be > 0", field="shape", value=shape, fix="pass the fitted Weibull shape")
    if not 0 <= uncovered <= 1:
        raise OrbitError("uncovered must be in [0, 1]", field="uncovered", value=uncovered,
                         fix="pass the share of reclaims no notice covers")
    if math.isinf(mtbf_s) or uncovered == 0:
        return max_s

    def excess(tau: float) -> float:
        return tau * uncovered * expected_reclaims(age_s, tau, mtbf_s, shape) - 2.0 * save_s

    lo = max(min_s, 1e-3)
    hi = max_s if math.isfinite(max_s) else 1e10
    if excess(lo) >= 0:
        return min_s if min_s <= lo else lo
    if excess(hi) <= 0:
        return max_s
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if excess(mid) < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 0.5:
            break
    return min(max(0.5 * (lo + hi), min_s), max_s)


@dataclass(frozen=True)
class IntervalRule:
    """The age-aware interval for fixed inputs (all in market seconds).

    ``uncovered``: the share of reclaims a periodic checkpoint insures against (1 when no
    emergency save fits the notice). ``interval`` is the policy's answer for an instance of
    ``age_s`` with ``work_left_s`` to do: when the work left is shorter, run to the end.
    """

    mtbf_s: float
    save_s: float
    shape: float
    uncovered: float
    min_s: float = DEFAULT_MIN_S
    max_s: float = math.inf

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        tau = age_aware_interval(age_s, self.mtbf_s, self.save_s, shape=self.shape,
                                 min_s=min(self.min_s, self.max_s), max_s=self.max_s, uncovered=self.uncovered)
        return work_left_s if work_left_s <= tau else tau

    def as_record(self) -> dict:
        """JSON-safe (an infinite bound is written as null)."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_record(cls, record: dict) -> "IntervalRule":
        """The rule ``as_record`` wrote; a missing or wrong field is an OrbitError naming it."""
        if not isinstance(record, dict):
            raise OrbitError("an interval rule must be a mapping", field="rule", value=record,
                             fix="pass IntervalRule.as_record()")
        values = {}
        for name, default in (("mtbf_s", None), ("save_s", None), ("shape", None), ("uncovered", None),
                              ("min_s", DEFAULT_MIN_S), ("max_s", math.inf)):
            v = record.get(name, default)
            if v is None and name == "max_s":
                v = math.inf
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise OrbitError(f"interval rule field {name} must be a number", field=name, value=v,
                                 fix="pass IntervalRule.as_record()")
            values[name] = float(v)
        _check("mtbf_s", values["mtbf_s"], positive=True)
        _check("save_s", values["save_s"], positive=False)
        return cls(**values)
