"""A workload's config schema, and pydantic errors turned into one readable line.

Every workload declares the hyper-parameters it takes as a pydantic model, `class
Config(BaseModel)` in a `config.py` beside its scripts (types, ranges with `Field(gt=...,
le=...)`, choices with `Literal`, `extra="forbid"` so that a misspelt key is an error).
The template loader validates a template's `config:` against it, fills in the defaults
(so the frozen bundle lists every value the workload runs with) and checks every override
again. Values come from YAML and `--set`, where `true` is a bool and `1e-3` may be text:
the schema should use strict types (`StrictInt`, `StrictBool`, a strict finite float) so
that pydantic's lax mode cannot turn `true` into 1 or `"5"` into 5.

`config.py` is imported by the control plane (it runs there, not only on the host), so it
should declare the schema and nothing else.
"""
from __future__ import annotations

import hashlib
import reprlib
import sys
import types
from pathlib import Path
from typing import Annotated, Any

from pydantic import AllowInfNan, BaseModel, Strict, ValidationError
from pydantic_core import PydanticCustomError

from .errors import OrbitError, TemplateError
from .workload import workload_dir

SCHEMA_FILE = "config.py"
SCHEMA_CLASS = "Config"
EXAMPLE = "orbit_dagster/workloads/charlm/config.py"

# A float that is a number and finite: no bool, no text, no inf or nan (`.inf` is YAML for inf).
FiniteFloat = Annotated[float, Strict(), AllowInfNan(False)]

_SHOWN_CHARS = 60
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = _SHOWN_CHARS, 40, _SHOWN_CHARS
_cache: dict[tuple[str, int, int], type[BaseModel]] = {}


def show(value: object) -> str:
    """A value as an error message shows it: repr, cut short (a 1 MiB string stays one short
    line). Cut before it is formatted: a string by its head, anything else through a repr
    bounded in depth and breadth, so a value of 10^9 shared parts (a YAML alias bomb) costs
    no more to show than a small one."""
    if isinstance(value, str):
        head = repr(value[:_SHOWN_CHARS])
        if len(value) <= _SHOWN_CHARS and len(head) <= _SHOWN_CHARS:
            return head
        return f"{head[:_SHOWN_CHARS]}... ({len(value)} characters)"
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails (an int of 10^5 digits) is named by its type
        text = f"<{type(value).__name__}>"
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({_extent(value)})"


def _extent(value: object) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        return f"{type(value).__name__} of {len(value)} items"
    if isinstance(value, dict):
        return f"mapping of {len(value)} keys"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return type(value).__name__


def reason(exc: BaseException) -> str:
    """Why an OS call failed, without the (possibly huge) path the caller already shows."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"


def config_schema(workload: str) -> type[BaseModel]:
    """The `Config` model of a workload (shipped name or directory); a TemplateError naming the fix."""
    try:
        directory = workload_dir(workload)
    except (OSError, ValueError) as exc:  # a name too long for the filesystem, a NUL byte
        raise TemplateError(f"workload {show(workload)} cannot be looked up: {reason(exc)}", field="workload",
                            value=workload, fix="name a shipped workload or an existing directory") from None
    path = directory / SCHEMA_FILE
    fix = (f"add {SCHEMA_FILE} to the workload directory declaring `class {SCHEMA_CLASS}(BaseModel)` with "
           f"model_config = ConfigDict(extra='forbid') and one typed field per config key (see {EXAMPLE})")
    if not path.is_file():
        raise TemplateError(f"workload {workload!r} declares no config schema: {directory.name}/{SCHEMA_FILE} is missing",
                            field="workload", value=workload, fix=fix)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _cache:
        _cache[key] = _import_schema(path, workload, fix)
    return _cache[key]


def _import_schema(path: Path, workload: str, fix: str) -> type[BaseModel]:
    # A module name per file, registered before it runs: pydantic resolves the schema's
    # annotations (`from __future__ import annotations`) through sys.modules.
    name = "orbit_workload_config_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        # Compiled from the source by hand: an import would write __pycache__ into the
        # workload directory, and validating a submission writes nothing.
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
    except Exception as exc:  # the workload author's code: any failure is theirs to fix
        sys.modules.pop(name, None)
        first = (str(exc).splitlines() or [""])[0][:200]
        raise TemplateError(f"{path.name} of workload {workload!r} failed to import: {type(exc).__name__}: {first}",
                            field="workload", value=workload, fix=f"correct {path.name}") from None
    model = getattr(module, SCHEMA_CLASS, None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TemplateError(f"{path.name} of workload {workload!r} has no pydantic model named {SCHEMA_CLASS!r}",
                            field="workload", value=workload, fix=fix)
    if model.model_config.get("extra") != "forbid":
        raise TemplateError(f"{path.name} of workload {workload!r}: {SCHEMA_CLASS} must forbid unknown keys "
                            "(a misspelt key would otherwise be dropped without a word)",
                            field="workload", value=workload, fix="set model_config = ConfigDict(extra='forbid')")
    return model


def validate_config(schema: type[BaseModel], config: Any, *, error: type[OrbitError], context: str,
                    overrides: dict | None = None) -> dict[str, Any]:
    """The config checked against the workload's schema, defaults filled in, as plain JSON values."""
    if not isinstance(config, dict):
        raise error(f"{context}: field 'config' must be a mapping of hyper-parameters, not {show(config)}",
                    field="config", value=config, fix="write `config:` followed by `key: value` lines")
    try:
        return schema.model_validate(config).model_dump(mode="json")
    except ValidationError as exc:
        raise readable(exc, schema, error=error, context=context, prefix="config", overrides=overrides) from None


REFUSED = "orbit_refused"  # a validator's own refusal (`refused`): it names its field, value and fix


def refused(message: str, *, fix: str, field: str | None = None, value: Any = None) -> PydanticCustomError:
    """What a validator raises when it knows better than the schema what is wrong: the field
    (dotted, from the model's top; default: the validated field), the value and the fix."""
    return PydanticCustomError(REFUSED, "{message}", {"message": message, "fix": fix, "field": field, "value": value})


def readable(exc: ValidationError, model: type[BaseModel], *, error: type[OrbitError], context: str,
             prefix: str = "", overrides: dict | None = None) -> OrbitError:
    """The first error of a ValidationError as one OrbitError naming the field, the value and the fix."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    ctx = err.get("ctx") or {} if err["type"] == REFUSED else {}
    field = ctx.get("field") or ".".join(([prefix] if prefix else []) + loc) or prefix or "(template)"
    msg = err["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    overrides = overrides or {}
    if field in overrides:
        value = overrides[field]
        text = f"{context}: override {field}={show(value)}: {msg}"
    else:
        value = ctx["value"] if ctx.get("field") else err.get("input") if err["type"] != "missing" else None
        shown = "" if err["type"] == "missing" else f" (value: {show(value)})"
        text = f"{context}: field {field!r} {msg}{shown}"
    return error(text, field=field, value=value, fix=ctx.get("fix") or fix_for(model, loc, err["type"], field))


def fix_for(model: type[BaseModel], loc: list[str], kind: str, field: str) -> str:
    """What a field takes, read from the model's JSON schema (types, ranges, choices)."""
    try:
        schema = model.model_json_schema()
    except Exception:  # a field type without a JSON schema: say where to look instead
        return f"see the model that declares {field}"
    defs = schema.get("$defs", {})
    node: dict = schema
    for part in loc:
        props = _fields_of(node, defs)
        if part not in props:
            parent = field.rsplit(".", 1)[0] if "." in field else "the template"
            if kind == "extra_forbidden" and props:
                return f"remove it; {parent} takes only: {', '.join(props)}"
            return f"see the fields of {parent}"
        node = props[part]
    hint = describe(_resolve(node, defs), defs)
    if kind == "missing":
        return f"{field} is required: give {hint}"
    return f"{field} takes {hint}"


def _resolve(node: dict, defs: dict) -> dict:
    ref = node.get("$ref")
    if ref:
        return _resolve(defs.get(ref.rsplit("/", 1)[-1], {}), defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        return _resolve(node["allOf"][0], defs)
    return node


def _fields_of(node: dict, defs: dict) -> dict:
    """The properties of a model's schema, also of an optional one (`X | None`: anyOf X, null)."""
    node = _resolve(node, defs)
    for option in node.get("anyOf", ()):
        if _resolve(option, defs).get("properties"):
            return _resolve(option, defs)["properties"]
    return node.get("properties", {})


def describe(node: dict, defs: dict) -> str:
    """`a number > 0 and <= 1`, `one of 'all', 'head'`, `an integer >= 1 or null`."""
    if "anyOf" in node:
        options = [_resolve(o, defs) for o in node["anyOf"]]
        parts = [describe(o, defs) for o in options if o.get("type") != "null"]
        nullable = len(parts) < len(options)
        return " or ".join(parts + (["null"] if nullable else [])) or "a value"
    if "enum" in node:
        return "one of " + ", ".join(repr(v) for v in node["enum"])
    if "const" in node:
        return repr(node["const"])
    kind = node.get("type")
    if kind in ("integer", "number"):
        words = ["an integer" if kind == "integer" else "a number"]
        bounds = [f"{op} {node[k]}" for k, op in (("exclusiveMinimum", ">"), ("minimum", ">="),
                                                  ("exclusiveMaximum", "<"), ("maximum", "<=")) if k in node]
        return " ".join(words + ([" and ".join(bounds)] if bounds else []))
    if kind == "boolean":
        return "true or false"
    if kind == "string":
        extra = [f"of at most {node['maxLength']} characters"] if "maxLength" in node else []
        extra += [f"matching {node['pattern']}"] if "pattern" in node else []
        return " ".join(["a string", *extra])
    if kind == "array":
        return "a list"
    if kind == "object":
        return "a mapping"
    return "a value of the declared type"
