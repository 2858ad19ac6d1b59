"""Provider registry: `backend_key = f"{placement}_{launch_mode}"` -> a provider instance."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

from ..core.errors import OrbitError
from ..providers.base import Provider
from .settings import Settings


def _sim(settings: Settings) -> Provider:
    from ..providers.sim import SimProvider
    from .sim_market import schedule_for

    return SimProvider(
        settings.sim_dir,
        schedule=schedule_for(settings),
        notice_seconds=settings.sim_notice_seconds,
    )


REGISTRY: dict[str, Callable[[Settings], Provider]] = {
    "sim_host_process": _sim,
}


def register(backend_key: str, factory: Callable[[Settings], Provider]) -> None:
    REGISTRY[backend_key] = factory


@lru_cache(maxsize=32)
def _cached(backend_key: str, settings: Settings) -> Provider:
    return REGISTRY[backend_key](settings)


def provider_for(settings: Settings, backend_key: str) -> Provider:
    if backend_key not in REGISTRY:
        raise OrbitError(
            f"no provider for backend {backend_key!r}",
            field="placement/launch_mode",
            value=backend_key,
            fix=f"use one of: {', '.join(sorted(REGISTRY))}",
        )
    return _cached(backend_key, settings)
