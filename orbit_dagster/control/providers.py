"""Provider registry: `backend_key = f"{placement}_{launch_mode}"` -> a provider instance."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from ..catalog.aws import parse_spot_price_history
from ..core.errors import OrbitError
from ..providers.base import Provider
from ..settings import Settings


def _sim(settings: Settings) -> Provider:
    # lazy: the sim provider and its market bring numpy and urllib/ssl (0.3-0.5 s); `orbit submit` imports
    # this registry (validate.py) and builds no provider
    from ..providers.sim.provider import SimProvider
    from .market_clock import schedule_for

    schedule, market = schedule_for(settings)
    return SimProvider(settings.sim_dir, schedule=schedule, notice_seconds=market.notice_wall_s, market=market)


def _ssh(settings: Settings) -> Provider:
    from ..providers.ssh.provider import SshProvider  # lazy: paramiko (0.3-0.4 s), for the SSH backend only

    return SshProvider(settings.ssh_hosts, state_dir=settings.home / "ssh")


def _aws(settings: Settings, session: Any = None) -> Provider:
    # Credentials: boto3's standard chain only (environment, profile, instance role); none
    # are read, stored or logged here. Everything else comes from ORBIT_AWS_* (settings.aws).
    from ..providers.aws.provider import AwsSpotProvider  # lazy: boto3 and paramiko (0.6 s or more), for AWS only

    # Spot prices come from EC2's price history; an operator can add rows in the same
    # format (`az_id  instance_type  product  usd_per_hour  timestamp`, tab-separated) to
    # $ORBIT_HOME/aws_spot_prices.tsv, e.g. where the history API is not reachable.
    prices_file = settings.home / "aws_spot_prices.tsv"
    prices = parse_spot_price_history(prices_file) if prices_file.is_file() else []
    a = settings.aws
    return AwsSpotProvider(region=a.region, endpoint_url=a.endpoint_url, state_dir=settings.home / "aws",
                           image_id=a.image_id, static_spot_prices=prices, ssh_cidrs=a.ssh_cidrs,
                           security_group_ids=a.security_group_ids, subnet_id=a.subnet_id,
                           key_name=a.key_name, instance_profile=a.instance_profile, ssh_user=a.ssh_user,
                           address=a.address, ssh_endpoint=a.ssh_endpoint, python=a.python,
                           workdir=a.workdir, metadata_url=a.metadata_url,
                           boot_timeout_s=a.boot_timeout_s, terminate_grace_s=a.terminate_grace_s,
                           session=session)


REGISTRY: dict[str, Callable[[Settings], Provider]] = {
    "sim_host_process": _sim,
    "ssh_rental_host_process": _ssh,
    "ssh_rental_docker_image": _ssh,
    "aws_spot_host_process": _aws,
}


# The GPU-rental resources of the Dagster run or sensor being evaluated (resources/rentals.py)
# replace the default factories for as long as it runs: the control plane below them asks
# for a provider by backend key and gets the one the resource configured.
_ACTIVE: ContextVar[Mapping[str, Callable[[Settings], Provider]]] = ContextVar(
    "orbit_provider_factories", default=MappingProxyType({}))  # read-only: set() replaces it, never mutates


@contextmanager
def using(factories: dict[str, Callable[[Settings], Provider]]) -> Iterator[None]:
    token = _ACTIVE.set({**_ACTIVE.get(), **factories})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def register(backend_key: str, factory: Callable[[Settings], Provider]) -> None:
    REGISTRY[backend_key] = factory


def provider_for(settings: Settings, backend_key: str) -> Provider:
    active = _ACTIVE.get()
    if backend_key in active:
        return active[backend_key](settings)
    if backend_key not in REGISTRY:
        raise OrbitError(
            f"no provider for backend {backend_key!r}",
            field="placement/launch_mode",
            value=backend_key,
            fix=f"use one of: {', '.join(sorted(REGISTRY))}",
        )
    # Built per call (cheap: traces and offers are cached below it), so a process that lives
    # long, like the daemon's code server, sees a market restarted by `orbit demo`.
    return REGISTRY[backend_key](settings)
