"""GPU-rental resources: one Dagster resource per provider, chosen by a job's placement.

Each resource holds what its provider needs beyond `$ORBIT_HOME`: its fields override the
settings' section of that provider through `Settings.override` (an unset field means the
environment's value; the defaults and parsing are the settings' alone). Credentials come only from the
environment, as `dagster.EnvVar`s (the UI shows the variable's name, never its value);
nothing here writes them anywhere. The assets and sensors that rent or release GPUs take
all three; `active(...)` makes them the providers the control plane uses for the run.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import dagster as dg

from ..control import providers as registry
from ..providers.base import Provider
from ..settings import Settings, secret


class SimMarketResource(dg.ConfigurableResource):
    """The embedded spot market (the default placement, `sim`): real local processes billed per
    second at real GCE prices, reclaimed as a replayed spot trace says."""

    reclaims: Optional[str] = None  # `trace` (replay spot traces) or `none`; unset: ORBIT_SIM_RECLAIMS
    traces: Optional[str] = None  # a directory of preemption traces; unset: ORBIT_SIM_TRACES or the fitted model
    scale: Optional[float] = None  # market seconds per wall second; unset: ORBIT_SIM_SCALE
    notice_seconds: Optional[float] = None  # the reclaim notice in market seconds; unset: ORBIT_SIM_NOTICE_SECONDS

    def factory(self) -> Callable[[Settings], Provider]:
        def make(settings: Settings) -> Provider:
            s = settings.override("sim", reclaims=self.reclaims, traces=self.traces, scale=self.scale,
                                  notice_seconds=self.notice_seconds)
            return registry.REGISTRY["sim_host_process"](s)

        return make


class SshRentalResource(dg.ConfigurableResource):
    """Rental boxes reached over SSH (`ssh_rental`), listed in an inventory file; host keys are
    checked against the inventory's known_hosts."""

    inventory: Optional[str] = None  # path of ssh_hosts.yaml; unset: ORBIT_SSH_HOSTS or $ORBIT_HOME/ssh_hosts.yaml

    def factory(self) -> Callable[[Settings], Provider]:
        def make(settings: Settings) -> Provider:
            s = settings.override(ssh_inventory=self.inventory)
            return registry.REGISTRY["ssh_rental_host_process"](s)

        return make


class AwsSpotResource(dg.ConfigurableResource):
    """EC2 spot instances (`aws_spot`). Credentials: the three `EnvVar` fields when set, else
    boto3's own chain (profile, instance role)."""

    region: Optional[str] = None  # unset: settings.aws.region (ORBIT_AWS_REGION / AWS_REGION)
    endpoint_url: Optional[str] = None  # unset: ORBIT_AWS_ENDPOINT_URL / AWS_ENDPOINT_URL (a VPC endpoint, moto)
    access_key_id: Optional[str] = None  # dg.EnvVar("AWS_ACCESS_KEY_ID")
    secret_access_key: Optional[str] = None  # dg.EnvVar("AWS_SECRET_ACCESS_KEY")
    session_token: Optional[str] = None  # dg.EnvVar("AWS_SESSION_TOKEN")
    profile: Optional[str] = None  # a named profile of boto3's config files

    def session(self, region: str) -> Any:
        if not (self.access_key_id or self.profile):
            return None  # boto3's standard chain
        # lazy: boto3 (0.3 s or more) in every process that loads the definitions; only explicit credentials need it
        import boto3

        return boto3.session.Session(aws_access_key_id=self.access_key_id,
                                     aws_secret_access_key=self.secret_access_key,
                                     aws_session_token=self.session_token, profile_name=self.profile,
                                     region_name=region)

    def factory(self) -> Callable[[Settings], Provider]:
        def make(settings: Settings) -> Provider:
            s = settings.override("aws", region=self.region, endpoint_url=self.endpoint_url)
            return registry._aws(s, session=self.session(s.aws.region))

        return make


@contextmanager
def active(sim_market: SimMarketResource, ssh_rental: SshRentalResource, aws_spot: AwsSpotResource) -> Iterator[None]:
    """The providers these resources configure, for the control plane called inside the block."""
    ssh = ssh_rental.factory()
    with registry.using({"sim_host_process": sim_market.factory(), "ssh_rental_host_process": ssh,
                         "ssh_rental_docker_image": ssh, "aws_spot_host_process": aws_spot.factory()}):
        yield


def from_environment() -> dict[str, dg.ConfigurableResource]:
    """The three resources as `definitions.py` wires them: AWS credentials as EnvVars when the
    environment holds them (an EnvVar of an unset variable fails the code location's load)."""
    creds = {field: dg.EnvVar(var) for field, var in (("access_key_id", "AWS_ACCESS_KEY_ID"),
                                                      ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
                                                      ("session_token", "AWS_SESSION_TOKEN")) if secret(var)}
    return {"sim_market": SimMarketResource(), "ssh_rental": SshRentalResource(), "aws_spot": AwsSpotResource(**creds)}
