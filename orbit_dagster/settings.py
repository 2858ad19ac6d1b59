"""Where everything lives: one home directory, `$ORBIT_HOME` (default `./.orbit`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .core.errors import OrbitError
from .ledger import Ledger
from .deploy.profiles import follow_mode, profile_ledger_url


def _words(text: str | None) -> tuple[str, ...]:
    """A comma- or space-separated list from the environment."""
    return tuple(w for w in (text or "").replace(",", " ").split() if w)


def _seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    text = os.environ.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
        kind = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        raise OrbitError(f"{name}={str(text)[:64]!r} is not {kind}", field=name, value=text, fix=f"e.g. {name}={default:g}")
    return value


@dataclass(frozen=True)
class Settings:
    home: Path
    # The sim market: does it reclaim (`trace`) or not (`none`); which traces it replays
    # (a directory of preemption traces; generated from the fitted model when unset);
    # how much faster than the wall clock market time runs; the notice in market seconds.
    sim_reclaims: str = "trace"
    sim_traces: str | None = None
    sim_scale: float = 1.0
    sim_notice_seconds: float = 120.0
    # SSH rental hosts: the inventory file (default $ORBIT_HOME/ssh_hosts.yaml).
    ssh_inventory: str | None = None
    # AWS: region, endpoint (moto's or a VPC endpoint), AMI; credentials come from boto3's chain.
    aws_region: str = "us-east-1"
    aws_endpoint_url: str | None = None
    aws_image_id: str | None = None
    # AWS hosts (docs/providers-aws.md): who may reach their SSH port (CIDRs, required unless
    # own security groups are given), how orbit reaches them (user, public/private IP, or a
    # tunnel/bastion endpoint host:port), what runs there (interpreter with torch, workdir),
    # the metadata URL the agent polls for notices, and how long a boot / a stop may take.
    aws_ssh_cidrs: tuple[str, ...] = ()
    aws_security_group_ids: tuple[str, ...] = ()
    aws_subnet_id: str | None = None
    aws_key_name: str | None = None
    aws_instance_profile: str | None = None
    aws_ssh_user: str = "ubuntu"
    aws_address: str = "public"
    aws_ssh_endpoint: str | None = None
    aws_python: str = "python3"
    aws_workdir: str = "~/orbit"
    aws_metadata_url: str = "http://169.254.169.254"
    aws_boot_timeout_s: float = 600.0
    aws_terminate_grace_s: float = 60.0
    # Proactive migration compares an offer's risk over windows of this many seconds.
    migration_window_s: float = 600.0
    # The ledger's database: SQLite under the home by default; a team points every machine at
    # one PostgreSQL (`postgresql+psycopg://USER@HOST:PORT/DB`, the password from PGPASSWORD).
    ledger_url_setting: str | None = None
    # Who follows a training attempt once launched (profiles.follow_mode): `run` or `daemon`;
    # with `daemon`, how long the launching run follows before it hands off, and the longest
    # a running attempt goes without a run collecting its events.
    follow: str = "run"
    handoff_after_s: float = 60.0
    follow_every_s: float = 300.0
    # A run worker on another machine is dead once no heartbeat came for this long (one on
    # this machine is judged by its process at once: control/liveness.py).
    worker_timeout_s: float = 60.0

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> "Settings":
        root = Path(home or os.environ.get("ORBIT_HOME") or ".orbit").expanduser().resolve()
        return cls(
            home=root,
            sim_reclaims=os.environ.get("ORBIT_SIM_RECLAIMS", "trace"),
            sim_traces=os.environ.get("ORBIT_SIM_TRACES") or None,
            sim_scale=float(os.environ.get("ORBIT_SIM_SCALE", 1.0)),
            sim_notice_seconds=float(os.environ.get("ORBIT_SIM_NOTICE_SECONDS", 120)),
            ssh_inventory=os.environ.get("ORBIT_SSH_HOSTS") or None,
            aws_region=os.environ.get("ORBIT_AWS_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
            aws_endpoint_url=os.environ.get("ORBIT_AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None,
            aws_image_id=os.environ.get("ORBIT_AWS_IMAGE_ID") or None,
            aws_ssh_cidrs=_words(os.environ.get("ORBIT_AWS_SSH_CIDR")),
            aws_security_group_ids=_words(os.environ.get("ORBIT_AWS_SECURITY_GROUP_IDS")),
            aws_subnet_id=os.environ.get("ORBIT_AWS_SUBNET_ID") or None,
            aws_key_name=os.environ.get("ORBIT_AWS_KEY_NAME") or None,
            aws_instance_profile=os.environ.get("ORBIT_AWS_INSTANCE_PROFILE") or None,
            aws_ssh_user=os.environ.get("ORBIT_AWS_SSH_USER") or "ubuntu",
            aws_address=os.environ.get("ORBIT_AWS_ADDRESS") or "public",
            aws_ssh_endpoint=os.environ.get("ORBIT_AWS_SSH_ENDPOINT") or None,
            aws_python=os.environ.get("ORBIT_AWS_PYTHON") or "python3",
            aws_workdir=os.environ.get("ORBIT_AWS_WORKDIR") or "~/orbit",
            aws_metadata_url=os.environ.get("ORBIT_AWS_METADATA_URL") or "http://169.254.169.254",
            aws_boot_timeout_s=_seconds("ORBIT_AWS_BOOT_TIMEOUT_S", 600.0),
            aws_terminate_grace_s=_seconds("ORBIT_AWS_TERMINATE_GRACE_S", 60.0),
            migration_window_s=float(os.environ.get("ORBIT_MIGRATION_WINDOW_S", 600)),
            # ORBIT_LEDGER_URL wins; else the deployment profile's (team: its PostgreSQL).
            ledger_url_setting=os.environ.get("ORBIT_LEDGER_URL") or profile_ledger_url(),
            follow=follow_mode(),
            handoff_after_s=_seconds("ORBIT_HANDOFF_AFTER_S", 60.0, zero_ok=True),
            follow_every_s=_seconds("ORBIT_FOLLOW_EVERY_S", 300.0),
            worker_timeout_s=_seconds("ORBIT_WORKER_TIMEOUT_S", 60.0),
        )

    @property
    def ssh_hosts(self) -> Path:
        return Path(self.ssh_inventory) if self.ssh_inventory else self.home / "ssh_hosts.yaml"

    @property
    def ledger_dir(self) -> Path:
        return self.home / "ledger"

    @property
    def bundles_dir(self) -> Path:
        return self.home / "bundles"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    @property
    def sim_dir(self) -> Path:
        return self.home / "sim"

    @property
    def store_uri(self) -> str:
        """The filesystem checkpoint store (`checkpoint.store: fs`)."""
        return os.environ.get("ORBIT_CHECKPOINT_STORE") or (self.home / "checkpoints").as_uri()

    def store_uri_for(self, kind: str) -> str:
        """The store root a template's `checkpoint.store` names: `fs` or `s3`."""
        if kind == "fs":
            return self.store_uri
        if kind == "s3":
            uri = os.environ.get("ORBIT_S3_CHECKPOINT_STORE", "")
            if not uri.startswith("s3://"):
                raise OrbitError("the template wants S3 checkpoints but no S3 store is configured",
                                 field="checkpoint.store", value=kind,
                                 fix="set ORBIT_S3_CHECKPOINT_STORE=s3://BUCKET/PREFIX (credentials: AWS's standard chain)")
            return uri
        raise OrbitError(f"unknown checkpoint store {kind!r}", field="checkpoint.store", value=kind, fix="fs or s3")

    @property
    def ledger_url(self) -> str:
        return self.ledger_url_setting or f"sqlite:///{self.ledger_dir / 'ledger.sqlite'}"

    def ledger(self) -> Ledger:
        return Ledger.open(self.ledger_url, home=self.home)
