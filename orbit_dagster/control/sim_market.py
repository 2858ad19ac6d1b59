"""How the simulated market reclaims instances, from settings."""
from __future__ import annotations

from ..providers.sim import NoReclaims, ReclaimSchedule
from .settings import Settings


def schedule_for(settings: Settings) -> ReclaimSchedule:
    if settings.sim_reclaims in ("", "none"):
        return NoReclaims()
    raise ValueError(f"unknown sim reclaim schedule {settings.sim_reclaims!r}")
