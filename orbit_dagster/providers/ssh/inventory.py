"""The user's rental hosts (`$ORBIT_HOME/ssh_hosts.yaml`) and how to reach one safely.

```yaml
hosts:
  - name: box1                      # offer id ssh:box1
    host: 203.0.113.7
    port: 22
    user: ubuntu
    key_file: ~/.ssh/rental_ed25519  # or key_env: ORBIT_BOX1_KEY (the key text in that variable)
    known_hosts: ~/.ssh/known_hosts  # the host's key must be in it (ssh-keyscan, verified out of band)
    trust_on_first_use: false       # true: accept an unknown key once and write it to known_hosts
    gpus: {model: A100-80G, count: 2}  # catalog specs; a model it lacks needs tflops_bf16 (+ memory_gb)
    usd_per_hour: 3.20               # the whole host, on demand
    workdir: ~/orbit                 # where bundles, runs and checkpoints live on the host
    python: python3                  # the host's interpreter (needs torch)
    docker: false                    # true: launch_mode docker_image may run here
```
Secrets (private keys, passphrases) come only from files the user owns or environment
variables; the inventory holds paths and variable names, never key material.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...catalog.gpus import UnknownGpu, gpu_spec, normalise_gpu_name
from ...core import safe_yaml
from ...core.bounded import read_text_bounded
from ...core.config_schema import show
from ...core.errors import OrbitError
from ...core.execution import Resources
from ...core.offers import Offer

INVENTORY_FILE = "ssh_hosts.yaml"


class InventoryError(OrbitError):
    """The SSH host inventory is missing or does not validate."""


def canonical_gpu(name: str) -> str:
    """The catalog's name for a GPU (`a100-80gb` -> `A100-80G`); a model it lacks is kept as written,
    to be priced by the inventory's `tflops_bf16` or the TFLOPS probe."""
    try:
        return normalise_gpu_name(name)
    except UnknownGpu:
        return name.strip()


class HostGpus(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="GPU model; catalog names and vendor aliases are normalised")
    count: int = Field(ge=0)
    memory_gb: float = Field(0, ge=0, description="per GPU; 0 = the catalog's figure")
    tflops_bf16: float | None = Field(None, gt=0, description="dense BF16 per GPU; needed for a model the "
                                                               "catalog lacks (e.g. a consumer card)")

    @field_validator("model")
    @classmethod
    def _canonical(cls, v: str) -> str:
        return canonical_gpu(v)

    def spec_fields(self) -> dict:
        """Offer fields from the catalog's spec for this model, the inventory's figures first."""
        try:
            spec = gpu_spec(self.model)
            tflops, memory, bandwidth = spec.bf16_tflops, spec.memory_gb, spec.memory_bandwidth_gbps
        except UnknownGpu:
            tflops = memory = bandwidth = None
        return {"spec_tflops_bf16": self.tflops_bf16 or tflops, "gpu_memory_gb": self.memory_gb or memory or 0.0,
                "memory_bandwidth_gbps": bandwidth}


class SshHost(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    host: str = Field(min_length=1)
    port: int = Field(22, ge=1, le=65535)
    user: str = Field(min_length=1)
    key_file: Path | None = None
    key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    key_passphrase_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    known_hosts: Path
    trust_on_first_use: bool = False
    gpus: HostGpus
    usd_per_hour: float = Field(ge=0)
    workdir: str = "~/orbit"
    python: str = Field("python3", min_length=1)
    docker: bool = False
    region: str = ""
    connect_timeout_s: float = Field(10.0, gt=0)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        if not (v.startswith("/") or v == "~" or v.startswith("~/")) or "\n" in v:
            raise ValueError("must be an absolute path or start with ~/ (the remote user's home)")
        return v.rstrip("/") or "/"

    @model_validator(mode="after")
    def _one_key(self) -> "SshHost":
        if (self.key_file is None) == (self.key_env is None):
            raise ValueError("give exactly one of key_file (a private key path) or key_env (a variable holding it)")
        return self

    @property
    def offer_id(self) -> str:
        return f"ssh:{self.name}"

    def offer(self, gpu_count: int | None = None) -> Offer:
        """This host as an offer of `gpu_count` of its GPUs (all by default), priced pro rata."""
        n = self.gpus.count if gpu_count is None else gpu_count
        per_gpu_s = self.usd_per_hour / max(self.gpus.count, 1) / 3600.0
        return Offer(offer_id=self.offer_id, provider="ssh", instance_type=f"{self.name}:{n}x{self.gpus.model}",
                     gpu=self.gpus.model, gpu_count=n, region=self.region, usd_per_gpu_second_on_demand=per_gpu_s,
                     usd_per_gpu_second_spot=None, spot=False, **self.gpus.spec_fields())

    def fits(self, r: Resources) -> bool:
        if r.gpu not in ("any", "", None) and self.gpus.model.lower() != canonical_gpu(r.gpu).lower():
            return False
        memory = self.gpus.spec_fields()["gpu_memory_gb"]
        return self.gpus.count >= r.gpu_count and memory >= r.gpu_memory_gb


def shape(host: SshHost) -> tuple[str, int, str]:
    """What makes hosts interchangeable nodes of one group: GPU model and count, and region."""
    return host.gpus.model.lower(), host.gpus.count, host.region


class Inventory(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    hosts: list[SshHost] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> "Inventory":
        names = [h.name for h in self.hosts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"host names must be unique; repeated: {', '.join(dupes)}")
        return self

    def group_of(self, first: SshHost, resources: Resources | None = None) -> list[SshHost]:
        """The hosts that may form a group with `first` (itself first): the same GPU model and
        count in the same region (one shape in one zone), each fitting `resources`."""
        return [first] + [h for h in self.hosts if h.name != first.name and shape(h) == shape(first)
                          and (resources is None or h.fits(resources))]

    def largest_group(self, resources: Resources) -> int:
        """The most hosts of one shape in one region that fit `resources`: the largest group."""
        return max((len(self.group_of(h, resources)) for h in self.hosts if h.fits(resources)), default=0)

    def host(self, name: str) -> SshHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InventoryError(f"no SSH host named {name!r} in the inventory", field="name", value=name,
                             fix=f"use one of: {', '.join(h.name for h in self.hosts) or '(none)'}")


MAX_INVENTORY_BYTES = 4 << 20


def load_inventory(path: Path) -> Inventory:
    path = Path(path).expanduser()
    if not path.is_file():
        raise InventoryError(f"SSH host inventory {path} does not exist", field="inventory", value=str(path),
                             fix="write it (see docs/providers-ssh.md) or pass its path to the ssh provider")
    try:
        text = read_text_bounded(path, MAX_INVENTORY_BYTES, what=f"SSH host inventory {path}", field="inventory",
                                 fix="an inventory lists hosts: keep it under 4 MiB")
    except OrbitError as exc:  # too large, or not UTF-8
        raise InventoryError(str(exc).split("; fix: ")[0], field="inventory", value=str(path), fix=exc.fix) from None
    try:
        raw = safe_yaml.load(text)  # its alias expansion bounded, as a template's is
    except safe_yaml.YamlRefused as exc:
        raise InventoryError(f"SSH host inventory {path} is refused: {exc}", field="inventory", value=str(path),
                             fix="write the hosts out instead of repeating blocks through YAML aliases") from None
    except (yaml.YAMLError, ValueError) as exc:
        where = " ".join(str(exc).split())[:300]
        raise InventoryError(f"SSH host inventory {path} is not valid YAML: {where}", fix="correct the YAML") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InventoryError(f"SSH host inventory {path} must be a mapping with `hosts:`", field="hosts",
                             fix="start the file with `hosts:` and a list of hosts")
    try:
        return Inventory.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first["loc"]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "hosts"
        value = first.get("input")  # paths and variable names only: the inventory holds no secrets
        raise InventoryError(f"SSH host inventory {path}: field {field!r} {first['msg'].lower()} (value: {show(value)})",
                             field=field, value=value, fix="see docs/providers-ssh.md for the host fields") from None
