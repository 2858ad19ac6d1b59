"""Checkpoint-interval policies: a small registry, one class each, shared by the control plane and the replay.

Every policy answers, each time work resumes or a save completes, ``interval(age_s,
work_left_s)``: seconds of work before the next durable checkpoint, given the instance's
age and the work the job still needs. ``uses_notice`` says whether it takes an emergency
checkpoint when a reclaim notice arrives (every policy but ``none`` does: the benchmark
gives all of them the same notice handling, so that a comparison measures the interval
policy). Policies learn through ``end_session(exposure_s, reclaimed, noticed)``, called
when an instance is gone; the replay engine decides nothing.

How the control plane calls orbit's policy (docs/policies.md, "How the control plane calls this")::

    policy = OrbitInterval.for_offer(offer, save_s=measured_save, notice_s=provider.notice_seconds,
                                     rates=book, notices=notice_record, nodes=nodes)
    decision = policy.decide(age_s=0.0, work_left_s=remaining)   # at dispatch: interval + reason
    rule = policy.rule()   # to the host: the agent asks rule.interval(age, work_left) after each save
    ...
    policy.end_session(exposure_s, reclaimed=True, noticed=saw_notice_event)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.interval import DEFAULT_MIN_S, IntervalRule, daly_interval, emergency_covered
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.reclaim_rate import NoticeReliability, RateBook, ReclaimRateEstimator


class CheckpointStrategy(Protocol):
    name: str
    uses_notice: bool

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float: ...

    def end_session(self, exposure_s: float, reclaimed: bool, noticed: bool | None = None) -> None: ...


class _Static:
    """A policy that learns nothing."""

    def end_session(self, exposure_s: float, reclaimed: bool, noticed: bool | None = None) -> None:
        return None


@dataclass
class NoCheckpoint(_Static):
    """No periodic checkpoint. With ``uses_notice`` it is the do-nothing-until-notice policy
    (``notice-only``): an emergency checkpoint on each notice, nothing else."""

    name: str = "none"
    uses_notice: bool = False

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        return math.inf


@dataclass
class FixedInterval(_Static):
    """A constant interval (``fixed-30m`` is the common default; ``hindsight`` searches these)."""

    seconds: float
    uses_notice: bool = False
    name: str = "fixed"

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        return self.seconds


@dataclass
class StaticYoungDaly(_Static):
    """Daly's interval for a fixed MTBF (the band's prior, or the trace's true one), never revised."""

    mtbf_s: float
    save_s: float
    name: str = "young-daly"
    uses_notice: bool = True

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        return max(daly_interval(self.mtbf_s, self.save_s), 1.0)


@dataclass
class OrbitInterval:
    """orbit's interval policy: insure only against the reclaims the notice will not cover.

    - A reclaim whose notice arrives in time for an emergency checkpoint costs no work, so a
      periodic checkpoint only insures against the others: every reclaim when the emergency
      save does not fit the notice (or there is none), else the share whose notice is lost,
      learnt online (``notices``: a Beta posterior, from the fleet's record of reclaims with
      and without a notice event).
    - Those arrive at the instance's age-dependent rate: a Weibull hazard with the fitted
      shape (< 1: fresh instances die first) and the zone's MTBF as estimated online
      (``rate``: Gamma-Poisson, prior from the spot-advisor band).
    - The interval solves Young's condition for that rate (``core.interval.age_aware_interval``);
      when the work left is shorter, the job runs to its end (the final save covers it).
    """

    rate: ReclaimRateEstimator
    save_s: float
    notice_s: float
    shape: float
    emergency_save_s: float | None = None
    notices: NoticeReliability = field(default_factory=NoticeReliability)
    min_s: float = DEFAULT_MIN_S
    max_s: float = math.inf
    name: str = "orbit"

    def __post_init__(self) -> None:
        for name in ("save_s", "notice_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise OrbitError(f"{name} must be >= 0", field=name, value=v, fix="pass measured seconds")

    @classmethod
    def for_offer(cls, offer: Offer, *, save_s: float, notice_s: float, model: ReclaimModel | None = None,
                  rates: RateBook | None = None, notices: NoticeReliability | None = None, nodes: int = 1,
                  emergency_save_s: float | None = None) -> "OrbitInterval":
        """The policy for a job about to run on ``offer`` (``nodes`` instances of it at once)."""
        m = model or load_reclaim_model()
        est = rates.for_offer(offer) if rates is not None else ReclaimRateEstimator.for_offer(offer, m)
        if nodes > 1:  # a gang is interrupted when any member is: independent reclaims, the pessimistic prior
            est = ReclaimRateEstimator(est.rate_per_hour * nodes, prior_strength=est.prior_strength,
                                       source=f"{est.source} x {nodes} nodes")
        return cls(est, save_s=save_s, notice_s=notice_s, shape=m.up_shape, emergency_save_s=emergency_save_s,
                   notices=notices if notices is not None else NoticeReliability())

    @property
    def uses_notice(self) -> bool:
        return self.notice_s > 0

    @property
    def estimator(self) -> ReclaimRateEstimator:
        """The earlier name of ``rate``."""
        return self.rate

    @property
    def esave(self) -> float:
        return self.save_s if self.emergency_save_s is None else self.emergency_save_s

    @property
    def covered(self) -> bool:
        """Does an emergency checkpoint fit inside the notice?"""
        return emergency_covered(self.notice_s, self.esave)

    @property
    def uncovered_share(self) -> float:
        """Share of reclaims a periodic checkpoint must insure against."""
        return self.notices.miss_rate if self.covered else 1.0

    def rule(self) -> IntervalRule:
        """The interval as a function of the instance's age until the next observation: what
        the agent on the host is given at launch and asks after each durable save."""
        return IntervalRule(mtbf_s=self.rate.mtbf_s, save_s=self.save_s, shape=self.shape,
                            uncovered=self.uncovered_share, min_s=self.min_s, max_s=self.max_s)

    def interval(self, age_s: float, work_left_s: float = math.inf) -> float:
        """Seconds of work before the next durable checkpoint."""
        return self.rule().interval(age_s, work_left_s)

    interval_s = interval

    def decide(self, *, age_s: float = 0.0, work_left_s: float = math.inf) -> dict:
        """The interval with its inputs and a one-line reason, for the ledger's decision row."""
        tau = self.interval(age_s, work_left_s)
        share = self.uncovered_share
        if self.covered:
            why = (f"an emergency save ({self.esave:g} s) fits the {self.notice_s:g} s notice; insuring against the "
                   f"{share:.2%} of reclaims whose notice is lost")
        else:
            why = (f"no emergency save fits the {self.notice_s:g} s notice; insuring against every reclaim")
        return {"policy": self.name, "interval_s": None if math.isinf(tau) else round(tau, 3),
                "reason": f"{why} (MTBF {self.rate.mtbf_s / 3600:.2f} h, age {age_s / 3600:.2f} h)",
                "inputs": {"age_s": age_s, "work_left_s": None if math.isinf(work_left_s) else work_left_s,
                           "save_s": self.save_s, "emergency_save_s": self.esave, "notice_s": self.notice_s,
                           "weibull_shape": self.shape, "uncovered_share": round(share, 6),
                           "rate": self.rate.as_record(), "notices": self.notices.as_record()}}

    def end_session(self, exposure_s: float, reclaimed: bool, noticed: bool | None = None) -> None:
        """An instance is gone after ``exposure_s`` of up-time; ``noticed``: did a notice precede the reclaim."""
        self.rate.observe(1 if reclaimed else 0, max(exposure_s, 0.0))
        if reclaimed and noticed is not None:
            self.notices.observe(1, 0 if noticed else 1)


#: Kept for callers of the earlier name.
OrbitCheckpointing = OrbitInterval

CHECKPOINT_STRATEGIES = ("none", "notice-only", "fixed-30m", "young-daly", "young-daly-true", "orbit")


def make_strategy(name: str, *, model: ReclaimModel, band: int | str, save_s: float, notice_s: float,
                  emergency_save_s: float | None = None, interval_s: float | None = None, nodes: int = 1,
                  true_mtbf_s: float | None = None) -> CheckpointStrategy:
    """A fresh policy by name (``hindsight`` is a search, see ``simulate.hindsight``).

    ``nodes``: instances the job holds at once (the prior rate scales with it);
    ``true_mtbf_s``: the trace's measured MTBF, for ``young-daly-true`` only.
    """
    prior_rate = model.band_rate(band) * nodes
    if name == "none":
        return NoCheckpoint()
    if name == "notice-only":
        return NoCheckpoint(name="notice-only", uses_notice=True)
    if name == "fixed-30m":
        return FixedInterval(1800.0, uses_notice=True, name="fixed-30m")
    if name == "fixed":
        if interval_s is None:
            raise OrbitError("fixed needs interval_s", field="interval_s", value=None, fix="pass the interval in seconds")
        return FixedInterval(interval_s, uses_notice=True, name=f"fixed-{interval_s:.0f}s")
    if name == "young-daly":
        return StaticYoungDaly(mtbf_s=3600.0 / prior_rate, save_s=save_s)
    if name == "young-daly-true":
        if not true_mtbf_s or true_mtbf_s <= 0:
            raise OrbitError("young-daly-true needs the trace's MTBF", field="true_mtbf_s", value=true_mtbf_s,
                             fix="pass the trace's up-time per reclaim in seconds")
        return StaticYoungDaly(mtbf_s=true_mtbf_s, save_s=save_s, name="young-daly-true")
    if name == "orbit":
        est = ReclaimRateEstimator(prior_rate, prior_strength=model.zone_rate_alpha,
                                   source=f"band {band}" + (f" x {nodes} nodes" if nodes > 1 else ""))
        return OrbitInterval(est, save_s=save_s, notice_s=notice_s, shape=model.up_shape,
                             emergency_save_s=emergency_save_s)
    raise OrbitError(f"unknown checkpoint strategy {name!r}", field="policy", value=name,
                     fix="use one of: " + ", ".join(CHECKPOINT_STRATEGIES + ("hindsight",)))
