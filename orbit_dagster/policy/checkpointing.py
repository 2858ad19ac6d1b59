"""Checkpoint strategies a replay (and the control plane) can run: a small registry, one class each.

Every strategy answers two questions during a session on one instance:
``interval(age_s)`` -- seconds of work before the next durable checkpoint, asked each time
work resumes -- and ``uses_notice`` -- may it take an emergency checkpoint on a reclaim notice.
It learns through ``end_session(exposure_s, reclaimed)``; the replay engine decides nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from orbit_dagster.catalog.reclaim_model import ReclaimModel
from orbit_dagster.policy.interval import (
    DEFAULT_MAX_S, age_aware_interval, checkpoint_interval, daly_interval, emergency_covered,
)
from orbit_dagster.policy.reclaim_rate import ReclaimRateEstimator


class CheckpointStrategy(Protocol):
    name: str
    uses_notice: bool

    def interval(self, age_s: float) -> float: ...

    def end_session(self, exposure_s: float, reclaimed: bool) -> None: ...


@dataclass
class NoCheckpoint:
    """Never checkpoints until the job ends; ignores notices."""

    name: str = "none"
    uses_notice: bool = False

    def interval(self, age_s: float) -> float:
        return math.inf

    def end_session(self, exposure_s: float, reclaimed: bool) -> None:
        return None


@dataclass
class FixedInterval:
    """A constant interval. ``fixed-30m`` is today's common default: 1800 s, no notice handling."""

    seconds: float
    uses_notice: bool = False
    name: str = "fixed"

    def interval(self, age_s: float) -> float:
        return self.seconds

    def end_session(self, exposure_s: float, reclaimed: bool) -> None:
        return None


@dataclass
class StaticYoungDaly:
    """Daly's interval from the band's prior MTBF, computed once and never revised; no notice handling."""

    mtbf_s: float
    save_s: float
    name: str = "young-daly"
    uses_notice: bool = False

    def interval(self, age_s: float) -> float:
        return max(daly_interval(self.mtbf_s, self.save_s), 1.0)

    def end_session(self, exposure_s: float, reclaimed: bool) -> None:
        return None


@dataclass
class OrbitCheckpointing:
    """orbit's strategy: online MTBF per zone, emergency checkpoint on the notice, age-aware interval.

    - When an emergency checkpoint fits in the notice, reclaims are (nearly) free and the
      periodic interval only insures against uncovered reclaims: ``checkpoint_interval``.
    - Otherwise the interval follows the instance's age with the fitted Weibull shape
      (fresh instances die first) and the zone's MTBF as estimated so far.
    """

    estimator: ReclaimRateEstimator
    save_s: float
    notice_s: float
    emergency_save_s: float
    shape: float
    name: str = "orbit"
    max_s: float = DEFAULT_MAX_S

    @property
    def uses_notice(self) -> bool:
        return self.notice_s > 0

    @property
    def covered(self) -> bool:
        return emergency_covered(self.notice_s, self.emergency_save_s)

    def interval(self, age_s: float) -> float:
        mtbf = self.estimator.mtbf_s
        if self.covered:
            return checkpoint_interval(mtbf, self.save_s, notice_s=self.notice_s,
                                       emergency_save_s=self.emergency_save_s, max_s=self.max_s)
        return age_aware_interval(age_s, mtbf, self.save_s, shape=self.shape,
                                  min_s=min(60.0, self.max_s), max_s=self.max_s)

    def end_session(self, exposure_s: float, reclaimed: bool) -> None:
        self.estimator.observe(1 if reclaimed else 0, max(exposure_s, 0.0))


def make_strategy(name: str, *, model: ReclaimModel, band: int | str, save_s: float, notice_s: float,
                  emergency_save_s: float | None = None, interval_s: float | None = None) -> CheckpointStrategy:
    """Build a fresh strategy by policy name (``hindsight`` is a search, see ``simulate``)."""
    esave = save_s if emergency_save_s is None else emergency_save_s
    if name == "none":
        return NoCheckpoint()
    if name == "fixed-30m":
        return FixedInterval(1800.0, uses_notice=False, name="fixed-30m")
    if name == "fixed":
        if interval_s is None:
            raise ValueError("fixed needs interval_s")
        return FixedInterval(interval_s, uses_notice=notice_s > 0, name=f"fixed-{interval_s:.0f}s")
    if name == "young-daly":
        return StaticYoungDaly(mtbf_s=3600.0 / model.band_rate(band), save_s=save_s)
    if name == "orbit":
        est = ReclaimRateEstimator(model.band_rate(band), prior_strength=model.zone_rate_alpha,
                                   source=f"band {band}")
        return OrbitCheckpointing(est, save_s=save_s, notice_s=notice_s, emergency_save_s=esave,
                                  shape=model.up_shape)
    raise ValueError(f"unknown checkpoint strategy {name!r}")
