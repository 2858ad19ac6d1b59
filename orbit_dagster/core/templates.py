"""TaskTemplate: a named, versioned recipe, loaded from YAML (shipped or the user's own)."""
from __future__ import annotations

import os
from importlib import resources as importlib_resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import TemplateError
from .execution import LaunchMode, Placement, Resources

TaskKind = Literal["train", "eval", "collect", "custom"]


class CheckpointPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    every_steps: int = Field(50, ge=1, description="durable checkpoint interval when no policy overrides it")
    memory_every_steps: int = Field(5, ge=1, description="in-memory snapshot interval")
    interval_policy: Literal["fixed", "young-daly"] = "fixed"
    store: Literal["fs", "s3"] = "fs"
    keep_latest: int = Field(3, ge=1)
    keep_best: int = Field(2, ge=0)


class PrimaryMetric(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    mode: Literal["min", "max"]


class EvalSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    entrypoint: str = "eval.py"
    suite: str = "heldout"


class OOMRetry(BaseModel):
    """The one whitelisted change an OOM-classified failure may retry with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    halve: str | None = Field(None, description="config key halved on OOM, e.g. config.micro_batch")
    double: str | None = Field(None, description="config key doubled on OOM, e.g. config.grad_accum")


class TaskTemplate(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    version: int = Field(1, ge=1)
    kind: TaskKind = "train"
    description: str = ""
    workload: str = Field(description="a workload shipped in orbit_dagster.workloads, or a directory path")
    entrypoint: str = "train.py"
    inputs: tuple[str, ...] = Field((), description="files of the workload directory copied into inputs/")
    eval: EvalSpec | None = EvalSpec()
    placement: Placement = "sim"
    launch_mode: LaunchMode = "host_process"
    resources: Resources = Resources()
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: tuple[str, ...] = ()
    image: str | None = None
    region: str | None = None
    max_price_per_gpu_hour: float | None = Field(None, gt=0)
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    primary_metric: PrimaryMetric | None = None
    max_interruptions: int = Field(5, ge=0)
    oom_retry: OOMRetry | None = None
    config: dict[str, Any] = Field(default_factory=dict, description="workload hyper-parameters")
    allow_overrides: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _overrides_name_real_fields(self) -> "TaskTemplate":
        data = self.model_dump()
        for key in self.allow_overrides:
            if not _has_path(data, key):
                raise ValueError(f"allow_overrides names {key!r}, which is not a field of this template")
        if self.oom_retry:
            for key in (self.oom_retry.halve, self.oom_retry.double):
                if key and key not in self.allow_overrides:
                    raise ValueError(f"oom_retry changes {key!r}, which must also be in allow_overrides")
        return self

    @property
    def template_id(self) -> str:
        return f"{self.name}@v{self.version}"


def _has_path(data: dict, dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def user_template_dir() -> Path | None:
    """`$ORBIT_TEMPLATES` if set, else `$ORBIT_HOME/templates` if it exists."""
    explicit = os.environ.get("ORBIT_TEMPLATES")
    if explicit:
        return Path(explicit)
    home = os.environ.get("ORBIT_HOME")
    if home and (Path(home) / "templates").is_dir():
        return Path(home) / "templates"
    return None


def _template_files(extra_dirs: list[Path] | None = None) -> dict[str, Path | Any]:
    found: dict[str, Path | Any] = {}
    shipped = importlib_resources.files("orbit_dagster") / "templates"
    for entry in shipped.iterdir():
        if entry.name.endswith(".yaml"):
            found[entry.name[:-5]] = entry
    dirs = list(extra_dirs or [])
    udir = user_template_dir()
    if udir:
        dirs.append(udir)
    for d in dirs:  # a user's template shadows a shipped one of the same name
        for path in sorted(Path(d).glob("*.yaml")):
            found[path.stem] = path
    return found


def list_templates(extra_dirs: list[Path] | None = None) -> list[str]:
    return sorted(_template_files(extra_dirs))


def parse_template(text: str, *, source: str) -> TaskTemplate:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TemplateError(f"template {source} is not valid YAML: {exc}", fix="correct the YAML syntax") from None
    if not isinstance(raw, dict):
        raise TemplateError(f"template {source} must be a YAML mapping", fix="start the file with `name: ...`")
    try:
        return TaskTemplate.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(template)"
        raise TemplateError(
            f"template {source}: field {field!r} {first['msg'].lower()}",
            field=field,
            value=first.get("input"),
            fix="see docs/concepts.md for the template fields",
        ) from None


def load_template(name_or_path: str, extra_dirs: list[Path] | None = None) -> TaskTemplate:
    """Load by name (shipped or user directory) or by a path to a YAML file."""
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) and path.is_file():
        return parse_template(path.read_text(), source=str(path))
    files = _template_files(extra_dirs)
    if name_or_path not in files:
        raise TemplateError(
            f"no template named {name_or_path!r}",
            field="template",
            value=name_or_path,
            fix=f"use one of: {', '.join(sorted(files)) or '(none)'}, or a path to a .yaml file",
        )
    return parse_template(files[name_or_path].read_text(), source=name_or_path)
