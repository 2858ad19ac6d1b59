"""TaskSubmission: a template plus whitelisted overrides. Anything else is an error, never dropped.

Everything a person types is bounded here before it reaches a template: names by pattern
and length, overrides by count, key shape and value size. `--set` values are read as plain
scalars (see `parse_value`), not as YAML: YAML 1.1 reads `010` as 8, `1:30` as 90 and
`1e-3` as text, none of which a person means.
"""
from __future__ import annotations

import copy
import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .config_schema import show
from .errors import InvalidOverride, OrbitError, OverrideNotAllowed
from .execution import ExecutionRequest
from .templates import TEMPLATE_NAME, TaskTemplate, typed_template

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
NAME_RULE = "1 to 63 characters: letters, digits, '_', '.' or '-', starting with a letter or digit"
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
KEY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,7}$"
MAX_OVERRIDES = 64
MAX_KEY_CHARS = 128
MAX_VALUE_CHARS = 1024  # a string override of more than 1 KiB is data, not a setting
MAX_TEMPLATE_REF_CHARS = 1024

_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][-+]?[0-9]+)?$")
_SPECIAL_FLOATS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, "inf": math.inf, "-inf": -math.inf,
                   ".nan": math.nan, "nan": math.nan}


class TaskSubmission(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str = Field(min_length=1, max_length=MAX_TEMPLATE_REF_CHARS)
    overrides: dict[str, Any] = Field(default_factory=dict)
    experiment: str = Field("default", pattern=NAME_PATTERN)
    project: str = Field("default", pattern=NAME_PATTERN)


def check_name(field: str, value: object) -> str:
    """An experiment or project name, or an OrbitError naming the field, the value and the rule."""
    if not isinstance(value, str) or not re.fullmatch(NAME_PATTERN, value):
        raise OrbitError(f"--{field} {show(value)} is not a valid {field} name", field=field, value=value,
                         fix=f"use {NAME_RULE}")
    return value


def check_job_id(value: object) -> str:
    if not isinstance(value, str) or not re.fullmatch(JOB_ID_PATTERN, value):
        raise OrbitError(f"{show(value)} is not a job id", field="job", value=value,
                         fix="give a job id as `orbit submit` printed it (`orbit status` lists them)")
    return value


def check_template_ref(value: object) -> str:
    """A template name (`charlm-finetune`) or a path to a `.yaml`/`.yml` file."""
    ok = isinstance(value, str) and (
        re.fullmatch(TEMPLATE_NAME, value)
        or (value.endswith((".yaml", ".yml")) and len(value) <= MAX_TEMPLATE_REF_CHARS and "\0" not in value))
    if not ok:
        raise OrbitError(f"{show(value)} is neither a template name nor a path to a .yaml file", field="template",
                         value=value, fix="give a name from `orbit templates` (lowercase letters, digits, '-', '_') "
                                          "or a path ending in .yaml")
    return value


def parse_value(raw: str) -> Any:
    """A `--set` value as a plain scalar: null, true/false, an integer, a float, else text.

    Quotes keep text as text (`--set region='123'`); anything else (lists, mappings, dates)
    stays the text it was written as, for the template's types to accept or refuse."""
    text = raw.strip()
    low = text.lower()
    if text == "":
        return ""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if low in ("null", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if low in _SPECIAL_FLOATS:  # a float the schema refuses as not finite, with that reason
        return _SPECIAL_FLOATS[low]
    return text


def parse_set_args(pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`["config.lr=1e-3", "placement=ssh_rental"]` -> typed dict; bounded and checked key by key."""
    if len(pairs) > MAX_OVERRIDES:
        raise InvalidOverride(f"{len(pairs)} overrides given; at most {MAX_OVERRIDES} are accepted", field="--set",
                              value=len(pairs), fix="change fewer fields at once, or write a template of your own")
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidOverride(f"override {show(pair)} is not of the form key=value", field="--set", value=pair,
                                  fix="write e.g. --set config.lr=0.001")
        _check_key(key)
        if len(raw) > MAX_VALUE_CHARS:
            raise InvalidOverride(f"override {key} is {len(raw)} characters long; at most {MAX_VALUE_CHARS} are accepted",
                                  field=key, value=raw, fix="give a short value; put data into the workload's inputs")
        if key in out:
            raise InvalidOverride(f"override {key} is given twice", field=key, value=raw,
                                  fix="give each key once")
        out[key] = parse_value(raw)
    return out


def _check_key(key: object) -> None:
    if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or not re.fullmatch(KEY_PATTERN, key):
        raise InvalidOverride(f"override key {show(key)} is not a dotted field name", field="--set", value=key,
                              fix="write a field path such as config.lr or resources.gpu (see the template's allow_overrides)")


def check_overrides(overrides: object) -> dict[str, Any]:
    """Overrides given as a dict (the Python API): the same bounds as `--set`, scalars only."""
    if not isinstance(overrides, dict):
        raise InvalidOverride(f"overrides must be a mapping of field to value, not {show(overrides)}",
                              field="overrides", value=overrides, fix="pass e.g. {'config.lr': 0.001}")
    if len(overrides) > MAX_OVERRIDES:
        raise InvalidOverride(f"{len(overrides)} overrides given; at most {MAX_OVERRIDES} are accepted",
                              field="overrides", value=len(overrides), fix="change fewer fields at once")
    for key, value in overrides.items():
        _check_key(key)
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise InvalidOverride(f"override {key}={show(value)}: a value must be a string, number, true/false or null",
                                  field=key, value=value, fix="give a single value, not a list or mapping")
        if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
            raise InvalidOverride(f"override {key} is {len(value)} characters long; at most {MAX_VALUE_CHARS} are accepted",
                                  field=key, value=value, fix="give a short value; put data into the workload's inputs")
    return overrides


def apply_overrides(template: TaskTemplate, overrides: dict[str, Any]) -> TaskTemplate:
    """Return the template with overrides applied, every field and the config validated again
    against its types and the workload's schema; raise before anything is written."""
    allowed = set(template.allow_overrides)
    for key in overrides:
        if key not in allowed:
            raise OverrideNotAllowed(
                f"override {show(key)} is not allowed by template {template.name!r}",
                field=key,
                value=overrides[key],
                fix=f"allowed overrides are: {', '.join(sorted(allowed)) or '(none)'}",
            )
    data = copy.deepcopy(template.model_dump())
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):  # an earlier override of this batch set a parent to null
            raise InvalidOverride(f"override {key} changes a field inside {'.'.join(parents)}, which is null here",
                                  field=key, value=value, fix=f"give {'.'.join(parents)} a value, or drop {key}")
        node[leaf] = value
    return typed_template(data, context=f"template {template.name!r}", error=InvalidOverride, overrides=overrides)


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
