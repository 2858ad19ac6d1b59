"""TaskSubmission: a template plus whitelisted overrides. Anything else is an error, never dropped."""
from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import InvalidOverride, OverrideNotAllowed
from .execution import ExecutionRequest
from .templates import TaskTemplate

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class TaskSubmission(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    experiment: str = Field("default", pattern=NAME_PATTERN)
    project: str = Field("default", pattern=NAME_PATTERN)


def parse_set_args(pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`["config.lr=1e-3", "placement=ssh_rental"]` -> typed dict (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidOverride(
                f"override {pair!r} is not of the form key=value", field=pair, fix="write e.g. --set config.lr=0.001"
            )
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key] = raw
    return out


def apply_overrides(template: TaskTemplate, overrides: dict[str, Any]) -> TaskTemplate:
    """Return the template with overrides applied; raise before anything is written."""
    allowed = set(template.allow_overrides)
    for key in overrides:
        if key not in allowed:
            raise OverrideNotAllowed(
                f"override {key!r} is not allowed by template {template.name!r}",
                field=key,
                value=overrides[key],
                fix=f"allowed overrides are: {', '.join(sorted(allowed)) or '(none)'}",
            )
    data = copy.deepcopy(template.model_dump())
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    try:
        return TaskTemplate.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise InvalidOverride(
            f"override {field!r}={first.get('input')!r}: {first['msg'].lower()}",
            field=field,
            value=first.get("input"),
            fix="give a value of the field's type (see the template)",
        ) from None


def execution_request_for(template: TaskTemplate) -> ExecutionRequest:
    return ExecutionRequest(
        placement=template.placement,
        launch_mode=template.launch_mode,
        resources=template.resources,
        env=dict(template.env),
        secret_env=tuple(template.secret_env),
        image=template.image,
        max_price_per_gpu_hour=template.max_price_per_gpu_hour,
        region=template.region,
    )
