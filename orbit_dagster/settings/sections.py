"""Typed sections of the settings, and the parsers every setting goes through: a bad value is
one OrbitError naming the variable, the value and the fix."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import OrbitError
from .variables import Env

SIM_RECLAIMS = ("trace", "none")


def words(text: str | None) -> tuple[str, ...]:
    """A comma- or space-separated list."""
    return tuple(w for w in (text or "").replace(",", " ").split() if w)


def seconds(env: Env, name: str, default: float, *, zero_ok: bool = False) -> float:
    """A number of seconds, positive (or >= 0 with `zero_ok`), finite."""
    text = env.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero_ok else value > 0) or not math.isfinite(value):
        kind = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        raise OrbitError(f"{name}={str(text)[:64]!r} is not {kind}", field=name, value=text, fix=f"e.g. {name}={default:g}")
    return value


def positive(env: Env, name: str, default: float) -> float:
    """A positive, finite number (a rate, a scale)."""
    text = env.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise OrbitError(f"{name}={str(text)[:64]!r} is not a positive number", field=name, value=text,
                         fix=f"e.g. {name}={default:g}")
    return value


def count(env: Env, name: str, default: int) -> int:
    """A whole number >= 1 (how many things at once)."""
    text = env.get(name)
    try:
        value = int(text) if text else default
    except ValueError:
        value = 0
    if value < 1:
        raise OrbitError(f"{name}={str(text)[:64]!r} is not a whole number >= 1", field=name, value=text,
                         fix=f"e.g. {name}={default}")
    return value


def choice(env: Env, name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name) or default
    if value not in allowed:
        raise OrbitError(f"{name}={value[:64]!r} is not one of {', '.join(allowed)}", field=name, value=value,
                         fix=f"set {name} to {' or '.join(allowed)}")
    return value


@dataclass(frozen=True)
class SimSettings:
    """The sim market: does it reclaim (`trace`) or not (`none`); which traces it replays
    (a directory of preemption traces; generated from the fitted model when unset);
    how much faster than the wall clock market time runs; the notice in market seconds."""

    reclaims: str = "trace"
    traces: str | None = None
    scale: float = 1.0
    notice_seconds: float = 120.0

    def __post_init__(self) -> None:  # the sim_market resource's fields land here too
        if self.reclaims not in SIM_RECLAIMS:
            raise OrbitError(f"unknown sim reclaim mode {self.reclaims!r} (ORBIT_SIM_RECLAIMS, or the sim_market "
                             "resource's `reclaims`)", field="ORBIT_SIM_RECLAIMS",
                             value=self.reclaims, fix="use `trace` (replay spot traces) or `none`")
        if not (isinstance(self.scale, (int, float)) and self.scale > 0 and math.isfinite(self.scale)):
            raise OrbitError(f"ORBIT_SIM_SCALE={self.scale!r} is not a positive number", field="ORBIT_SIM_SCALE",
                             value=self.scale, fix="e.g. ORBIT_SIM_SCALE=1")
        notice = self.notice_seconds
        if not (isinstance(notice, (int, float)) and notice >= 0 and math.isfinite(notice)):
            raise OrbitError(f"ORBIT_SIM_NOTICE_SECONDS={notice!r} is not a number of seconds >= 0",
                             field="ORBIT_SIM_NOTICE_SECONDS", value=notice, fix="e.g. ORBIT_SIM_NOTICE_SECONDS=120")

    @classmethod
    def from_env(cls, env: Env) -> "SimSettings":
        return cls(reclaims=choice(env, "ORBIT_SIM_RECLAIMS", "trace", SIM_RECLAIMS),
                   traces=env.get("ORBIT_SIM_TRACES"),
                   scale=positive(env, "ORBIT_SIM_SCALE", 1.0),
                   # 0: a market that gives no notice (an SSH box, a zone that skips them)
                   notice_seconds=seconds(env, "ORBIT_SIM_NOTICE_SECONDS", 120.0, zero_ok=True))


@dataclass(frozen=True)
class AwsSettings:
    """AWS: region, endpoint (moto's or a VPC endpoint), AMI; credentials come from boto3's chain.

    Hosts (docs/providers-aws.md): who may reach their SSH port (CIDRs, required unless own
    security groups are given), how orbit reaches them (user, public/private IP, or a
    tunnel/bastion endpoint host:port), what runs there (interpreter with torch, workdir),
    the metadata URL the agent polls for notices, and how long a boot / a stop may take."""

    region: str = "us-east-1"
    endpoint_url: str | None = None
    image_id: str | None = None
    ssh_cidrs: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    subnet_id: str | None = None
    key_name: str | None = None
    instance_profile: str | None = None
    ssh_user: str = "ubuntu"
    address: str = "public"
    ssh_endpoint: str | None = None
    python: str = "python3"
    workdir: str = "~/orbit"
    metadata_url: str = "http://169.254.169.254"
    boot_timeout_s: float = 600.0
    terminate_grace_s: float = 60.0

    @classmethod
    def from_env(cls, env: Env) -> "AwsSettings":
        return cls(
            region=env.get("ORBIT_AWS_REGION") or env.get("AWS_REGION") or "us-east-1",
            endpoint_url=env.get("ORBIT_AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL"),
            image_id=env.get("ORBIT_AWS_IMAGE_ID"),
            ssh_cidrs=words(env.get("ORBIT_AWS_SSH_CIDR")),
            security_group_ids=words(env.get("ORBIT_AWS_SECURITY_GROUP_IDS")),
            subnet_id=env.get("ORBIT_AWS_SUBNET_ID"),
            key_name=env.get("ORBIT_AWS_KEY_NAME"),
            instance_profile=env.get("ORBIT_AWS_INSTANCE_PROFILE"),
            ssh_user=env.get("ORBIT_AWS_SSH_USER") or "ubuntu",
            address=env.get("ORBIT_AWS_ADDRESS") or "public",
            ssh_endpoint=env.get("ORBIT_AWS_SSH_ENDPOINT"),
            python=env.get("ORBIT_AWS_PYTHON") or "python3",
            workdir=env.get("ORBIT_AWS_WORKDIR") or "~/orbit",
            metadata_url=env.get("ORBIT_AWS_METADATA_URL") or "http://169.254.169.254",
            boot_timeout_s=seconds(env, "ORBIT_AWS_BOOT_TIMEOUT_S", 600.0),
            terminate_grace_s=seconds(env, "ORBIT_AWS_TERMINATE_GRACE_S", 60.0),
        )


DISCOVERY_SOURCES = ("catalog", "sim", "ssh", "aws")


def discovery_sources(text: str | None) -> tuple[str, ...] | None:
    """ORBIT_DISCOVERY_PROVIDERS: names separated by spaces or commas, each once (None: unset)."""
    if text is None:
        return None
    names = tuple(dict.fromkeys(n for n in text.replace(",", " ").split() if n))
    bad = [n for n in names if n not in DISCOVERY_SOURCES]
    if bad or not names:
        raise OrbitError(f"ORBIT_DISCOVERY_PROVIDERS={text!r} names {'no source' if not names else ', '.join(bad)}",
                         field="ORBIT_DISCOVERY_PROVIDERS", value=text,
                         fix=f"name some of: {' '.join(DISCOVERY_SOURCES)} (e.g. `catalog sim aws`)")
    return names
