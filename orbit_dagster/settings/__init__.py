"""Every setting of orbit's control plane, in one home: read once from the environment, typed.

`Settings.from_env()` takes one snapshot of the environment and parses every `ORBIT_*`
variable (declared, with its default and meaning, in `variables.py`; docs/deploy.md's table
is made from that list) and every provider's configuration into typed fields and sections
(`settings.aws`, `settings.sim`, `settings.profile`, `settings.sql_limits()`, ...). A bad
value is one OrbitError naming the variable, the value and the fix. Nothing else in orbit
reads `os.environ` for its settings; the host side (`runtime/`, `providers/sim/host.py`, which
plays a rented machine, and `providers/ssh/host.py`, which runs on one) reads its own environment.

Two accessors serve what is not a setting: `environment()`, a copy of the environment for
the processes we start, and `secret(name)`, a secret a provider forwards by name (an SSH
key's `key_env`, a template's `secret_env`, AWS credentials), read when it is needed and
never kept in a Settings.

Layering: this package imports core, and the ledger/storage parsers of their own limits
(`SqlLimits.parse`, `s3.tuning`); none of those import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from ..core.errors import OrbitError
from ..ledger import Ledger
from ..ledger.limits import SqlLimits
from ..storage import open_store
from ..storage.s3 import BadTuning, tuning
from .deployment import CodeServerAddress, Profile, parse_follow
from .sections import AwsSettings, SimSettings, count, discovery_sources, positive, seconds
from .variables import Env


def environment() -> dict[str, str]:
    """A copy of this process's environment: what the processes we start inherit, and what
    `Settings.from_env` parses."""
    return dict(os.environ)


def home_dir() -> Path:
    """`ORBIT_HOME` alone (default `./.orbit`), for where the whole settings may be what failed
    to parse: the CLI's error lines and its log of internal errors."""
    return Path(os.environ.get("ORBIT_HOME") or ".orbit").expanduser()


def secret(name: str) -> str | None:
    """A secret forwarded by name (never a setting, never stored): None when unset or empty."""
    return os.environ.get(name) or None


def secrets(names) -> dict[str, str]:
    """The secrets of `names` that are set, for a launch to pass on (by pipe, never argv or a file)."""
    return {n: os.environ[n] for n in names if os.environ.get(n) is not None}


@dataclass(frozen=True)
class Settings:
    home: Path
    # The snapshot the settings were parsed from (not shown: it holds whatever the
    # environment holds), for the parsers that take the environment's text whole.
    env: Mapping[str, str] = field(default_factory=environment, repr=False, compare=False)
    sim: SimSettings = SimSettings()
    aws: AwsSettings = AwsSettings()
    # SSH rental hosts: the inventory file (default $ORBIT_HOME/ssh_hosts.yaml).
    ssh_inventory: str | None = None
    # Templates: a directory that shadows the shipped ones (default $ORBIT_HOME/templates).
    templates: str | None = None
    # Checkpoint stores: the filesystem one (default under the home) and S3 when configured.
    checkpoint_store: str | None = None
    s3_checkpoint_store: str | None = None
    # The longest one evaluation may run.
    eval_timeout_s: float = 1800.0
    # Checkpoints one evaluation run evaluates on the instance it rented: its own, then other
    # pending ones of the same job and suite (1: one instance per evaluation).
    eval_share: int = 8
    # The largest workload tree a bundle packages (core/packaging.py).
    bundle_max_bytes: int = 256 << 20
    # Proactive migration compares an offer's risk over windows of this many seconds.
    migration_window_s: float = 600.0
    # What offer discovery asks for shapes (control/discovery.py); None: by what is configured.
    discovery_sources: tuple[str, ...] | None = None
    # The deployment profile (embedded / team), and the ledger's database: SQLite under the
    # home by default; a team points every machine at one PostgreSQL
    # (`postgresql+psycopg://USER@HOST:PORT/DB`, the password from PGPASSWORD).
    profile: Profile = Profile.parse(None, None, None)
    ledger_url_setting: str | None = None
    # Who follows a training attempt once launched: `run` or `daemon`; with `daemon`, how
    # long the launching run follows before it hands off, and the longest a running attempt
    # goes without a run collecting its events.
    follow: str = "run"
    handoff_after_s: float = 60.0
    follow_every_s: float = 300.0
    # A run worker on another machine is dead once no heartbeat came for this long (one on
    # this machine is judged by its process at once: control/liveness.py).
    worker_timeout_s: float = 60.0
    # The code server an operator runs (None: orbit starts its own), and an operator's own
    # workspace for the webserver and daemon (None: orbit serves the code location).
    code_server: CodeServerAddress | None = None
    workspace: Path | None = None

    @classmethod
    def from_env(cls, home: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> "Settings":
        """The settings of this process's environment (or of `env`, a whole environment)."""
        snapshot = dict(env) if env is not None else environment()
        return cls._parse(home, snapshot, Env(snapshot))

    @classmethod
    def _parse(cls, home: str | Path | None, snapshot: dict[str, str], env: Env) -> "Settings":
        root = Path(home or env.get("ORBIT_HOME") or ".orbit").expanduser().resolve()
        profile = Profile.parse(env.get("ORBIT_PROFILE"), env.get("ORBIT_POOLS"), env.get("ORBIT_POSTGRES_URL"))
        code_server, workspace = env.get("ORBIT_CODE_SERVER"), env.get("ORBIT_WORKSPACE")
        settings = cls(
            home=root,
            env=snapshot,
            sim=SimSettings.from_env(env),
            aws=AwsSettings.from_env(env),
            ssh_inventory=env.get("ORBIT_SSH_HOSTS"),
            templates=env.get("ORBIT_TEMPLATES"),
            checkpoint_store=env.get("ORBIT_CHECKPOINT_STORE"),
            s3_checkpoint_store=env.get("ORBIT_S3_CHECKPOINT_STORE"),
            eval_timeout_s=seconds(env, "ORBIT_EVAL_TIMEOUT_S", 1800.0),
            eval_share=count(env, "ORBIT_EVAL_SHARE", 8),
            migration_window_s=positive(env, "ORBIT_MIGRATION_WINDOW_S", 600.0),
            discovery_sources=discovery_sources(env.get("ORBIT_DISCOVERY_PROVIDERS")),
            bundle_max_bytes=int(positive(env, "ORBIT_BUNDLE_MAX_MB", 256.0) * 2**20),
            profile=profile,
            # ORBIT_LEDGER_URL wins; else the deployment profile's (team: its PostgreSQL).
            ledger_url_setting=env.get("ORBIT_LEDGER_URL") or profile.ledger_url,
            follow=parse_follow(env.get("ORBIT_FOLLOW"), profile.name),
            handoff_after_s=seconds(env, "ORBIT_HANDOFF_AFTER_S", 60.0, zero_ok=True),
            follow_every_s=seconds(env, "ORBIT_FOLLOW_EVERY_S", 300.0),
            worker_timeout_s=seconds(env, "ORBIT_WORKER_TIMEOUT_S", 60.0),
            code_server=CodeServerAddress.parse(code_server) if code_server else None,
            workspace=Path(workspace).expanduser().resolve() if workspace else None,
        )
        settings.sql_limits()  # a bad ORBIT_SQL_* is refused here too, before anything starts
        settings.s3_tuning()
        return settings

    def with_env(self, **values: str) -> "Settings":
        """These settings as if the environment also held `values` (parsed the same way); the
        processes started with `deploy.instance.environment` get them too."""
        return Settings.from_env(self.home, env={**self.env, **values})

    def override(self, section: str | None = None, **values: Any) -> "Settings":
        """These settings with `values` (those not None or empty) in place, in `section`
        (`aws`, `sim`) or at the top: how a Dagster resource's fields override the environment's."""
        given = {k: v for k, v in values.items() if v is not None and v != ""}
        if section is None:
            return replace(self, **given) if given else self
        current = getattr(self, section)
        names = {f.name for f in fields(current)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"{section} settings have no field {', '.join(unknown)}")
        return replace(self, **{section: replace(current, **given)}) if given else self

    # ---- derived ---------------------------------------------------------------------
    @property
    def ssh_hosts(self) -> Path:
        return Path(self.ssh_inventory) if self.ssh_inventory else self.home / "ssh_hosts.yaml"

    @property
    def template_dirs(self) -> list[Path]:
        """Where templates other than the shipped ones are searched: `ORBIT_TEMPLATES`, else
        `$ORBIT_HOME/templates` if it exists."""
        if self.templates:
            return [Path(self.templates)]
        home_dir = self.home / "templates"
        return [home_dir] if home_dir.is_dir() else []

    @property
    def discovery(self) -> tuple[str, ...]:
        """What offer discovery asks: ORBIT_DISCOVERY_PROVIDERS, else the shipped catalog and the
        embedded market, the SSH inventory when it exists, AWS when an endpoint or an AMI is set."""
        if self.discovery_sources is not None:
            return self.discovery_sources
        return ("catalog", "sim", *(("ssh",) if self.ssh_hosts.is_file() else ()),
                *(("aws",) if self.aws.endpoint_url or self.aws.image_id else ()))

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
        return self.checkpoint_store or (self.home / "checkpoints").as_uri()

    @property
    def s3_configured(self) -> bool:
        uri = self.s3_checkpoint_store or ""
        return uri.startswith("s3://") and len(uri) > len("s3://")

    def store_uri_for(self, kind: str) -> str:
        """The store root a template's `checkpoint.store` names: `fs` or `s3`."""
        if kind == "fs":
            return self.store_uri
        if kind == "s3":
            if not self.s3_configured:
                raise OrbitError("the template wants S3 checkpoints but no S3 store is configured",
                                 field="checkpoint.store", value=kind,
                                 fix="set ORBIT_S3_CHECKPOINT_STORE=s3://BUCKET/PREFIX (credentials: AWS's "
                                     "standard chain), or use checkpoint.store=fs")
            return str(self.s3_checkpoint_store)
        raise OrbitError(f"unknown checkpoint store {kind!r}", field="checkpoint.store", value=kind, fix="fs or s3")

    def s3_tuning(self) -> dict[str, int]:
        """The S3 store's part size, threshold and concurrency (ORBIT_S3_PART_SIZE, _MULTIPART_THRESHOLD, _CONCURRENCY)."""
        try:
            return tuning(self.env)
        except BadTuning as exc:  # the store's own error (it runs on hosts too), as the settings' kind
            raise OrbitError(str(exc).split("; fix: ")[0], field=exc.field, value=exc.value, fix=exc.fix) from None

    def open_store(self, root_uri: str):
        """The checkpoint store at `root_uri`, with these settings' S3 tuning and client choice."""
        return open_store(root_uri, env=self.env)

    def sql_limits(self, *, timeout_s: float | None = None, memory: str | None = None) -> SqlLimits:
        """The SQL face's limits (ORBIT_SQL_*); `timeout_s`/`memory` (a flag, an argument) win."""
        return SqlLimits.parse(self.env, timeout_s=timeout_s, memory=memory)

    @property
    def ledger_url(self) -> str:
        return self.ledger_url_setting or f"sqlite:///{self.ledger_dir / 'ledger.sqlite'}"

    def ledger(self) -> Ledger:
        ledger = Ledger.open(self.ledger_url, home=self.home)
        ledger.sql_limits = self.sql_limits()  # what `ledger.query()` runs within
        return ledger


__all__ = ["Settings", "AwsSettings", "SimSettings", "Profile", "CodeServerAddress", "environment", "home_dir", "secret",
           "secrets"]
