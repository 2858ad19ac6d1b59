"""TaskTemplate: a named, versioned recipe, loaded from YAML (shipped or the user's own).

A template is valid only together with its workload's config schema (`config.py`, see
`config_schema`): loading one validates its `config:` against the schema and fills in the
schema's defaults, so a template in hand always holds the complete, typed config.

A template is therefore code: loading it imports its workload's `config.py`. Templates are
loaded only from the shipped set, the user's directory (`ORBIT_TEMPLATES`, else
`$ORBIT_HOME/templates`: the settings' `template_dirs`, passed in) and a path a person gives (`orbit submit ./mine.yaml`); data from
outside (an imported run's `run.json`) may only name an installed one (`installed_template`).
Each file is size-checked before it is read, and its YAML expansion is bounded
(`safe_yaml`: an alias bomb is refused, not expanded).
"""
from __future__ import annotations

import copy
import hashlib
import re
from importlib import resources as importlib_resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import safe_yaml
from .bounded import read_text_bounded
from .command_template import check_placeholders, has_config_schema, plain_config
from .config_schema import FiniteFloat, config_schema, readable, reason, show, validate_config
from .errors import OrbitError, TemplateError
from .execution import Elastic, EnvName, EnvValue, LaunchMode, Placement, Resources, check_elastic, check_group
from .hashing import canonical_json

TaskKind = Literal["train", "eval", "collect", "custom"]
TEMPLATE_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
MAX_TEMPLATE_BYTES = 1 << 20
MAX_WORKLOAD_CHARS = 1024
# A dotted field path (`config.lr`, `resources.gpu`).
FieldPath = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,7}$",
                                             max_length=128)]
# A file of the workload directory, by name: no path separators, no `..`.
FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")]
# A command workload's argv (no shell): bounded in count and length, every element text.
MAX_ARGV = 256
MAX_ARG_CHARS = 4096
Argv = Annotated[tuple[Annotated[StrictStr, StringConstraints(max_length=MAX_ARG_CHARS)], ...],
                 Field(min_length=1, max_length=MAX_ARGV)]
# A file name a framework writes last into a checkpoint (`.orbit-complete`): a leading dot is fine.
MarkerName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.]*[A-Za-z0-9_-][A-Za-z0-9_.-]*$", max_length=128)]
MAX_PATTERN_CHARS = 512
# The signals a script can catch that frameworks use to stop (not SIGKILL/SIGSTOP: uncatchable).
StopSignal = Literal["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"]


class CheckpointPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    every_steps: StrictInt = Field(50, ge=1, description="durable checkpoint interval when no policy overrides it")
    memory_every_steps: StrictInt = Field(5, ge=1, description="in-memory snapshot interval")
    # `orbit`: the project's interval policy (docs/policies.md); `young-daly`: the classic
    # sqrt(2 * save time * MTBF); `fixed`: every_steps as written.
    interval_policy: Literal["orbit", "fixed", "young-daly"] = "orbit"
    # On AWS's rebalance recommendation (often minutes before the 2-minute notice): `checkpoint`
    # takes an early durable checkpoint at the next step boundary; `record` only records it;
    # `migrate` takes it too and has the control plane move the job make-before-break when the
    # migration policy says the work left is long enough for the move to pay.
    on_rebalance: Literal["checkpoint", "record", "migrate"] = "checkpoint"
    store: Literal["fs", "s3"] = "fs"
    keep_latest: StrictInt = Field(3, ge=1)
    keep_best: StrictInt = Field(2, ge=0)
    # Command workloads (runtime/watcher.py): which names under the checkpoint directory are
    # checkpoints, what a framework writes last into one, and how long every file must stay
    # unchanged before it counts as complete.
    pattern: str | None = Field(None, min_length=1, max_length=MAX_PATTERN_CHARS,
                                description="regex with a named group `step`; default: a name ending in -<step> or _<step>")
    complete_marker: MarkerName | None = None
    settle_seconds: FiniteFloat = Field(2.0, ge=0, le=3600)

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles_with_a_step(cls, pattern: str | None) -> str | None:
        if pattern is None:
            return None
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"is not a regular expression ({exc})") from None
        if "step" not in compiled.groupindex:
            raise ValueError("needs a named group `step`, e.g. ^ckpt_(?P<step>\\d+)\\.pt$")
        return pattern


class PrimaryMetric(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    mode: Literal["min", "max"]


class EvalSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    entrypoint: FileName | None = None  # "eval.py" unless a command is given
    command: Argv | None = Field(None, description="argv of the eval script; {checkpoint_path} is the checkpoint")
    suite: str = Field("heldout", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    version: int = Field(1, ge=1, le=10_000, description="raise it when the suite changes: every live checkpoint "
                                                          "is then evaluated again (the backfill)")

    @model_validator(mode="before")
    @classmethod
    def _entrypoint_unless_command(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("command") is None and data.get("entrypoint") is None:
            data = {**data, "entrypoint": "eval.py"}
        return data

    @field_validator("command")
    @classmethod
    def _not_both(cls, command: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...] | None:
        if command is not None and info.data.get("entrypoint") is not None:
            raise ValueError("is given together with eval.entrypoint: an evaluation runs one or the other")
        return command

    @property
    def suite_id(self) -> str:
        """`heldout@v1`: evaluation results are per suite version."""
        return f"{self.suite}@v{self.version}"


class OOMRetry(BaseModel):
    """The one whitelisted change an OOM-classified failure may retry with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    halve: FieldPath | None = Field(None, description="config key halved on OOM, e.g. config.micro_batch")
    double: FieldPath | None = Field(None, description="config key doubled on OOM, e.g. config.grad_accum")


class TaskTemplate(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=TEMPLATE_NAME)
    version: StrictInt = Field(1, ge=1)
    kind: TaskKind = "train"
    description: str = Field("", max_length=4096)
    workload: str = Field(min_length=1, max_length=MAX_WORKLOAD_CHARS,
                          description="a workload shipped in orbit_dagster.workloads, or a directory path")
    entrypoint: FileName | None = Field(None, description="the SDK script defining main(ctx); train.py unless "
                                                           "a command is given")
    command: Argv | None = Field(None, description="argv of any script (no shell); `python` is the host's interpreter")
    stop_signal: StopSignal = Field("SIGTERM", description="sent to a command on a reclaim notice")
    inputs: tuple[FileName, ...] = Field((), max_length=256, description="files of the workload directory copied into inputs/")
    eval: EvalSpec | None = EvalSpec()
    placement: Placement = "sim"
    launch_mode: LaunchMode = "host_process"
    resources: Resources = Resources()
    # After `resources` (its validator reads the node count): null, a group keeps its size.
    elastic: Elastic | None = None
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    secret_env: tuple[EnvName, ...] = ()
    image: str | None = Field(None, min_length=1, max_length=512, pattern=r"^\S+$")
    region: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    max_price_per_gpu_hour: FiniteFloat | None = Field(None, gt=0)
    deadline_hours: FiniteFloat | None = Field(None, gt=0, description="finish within this many hours of submission")
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    primary_metric: PrimaryMetric | None = None
    max_interruptions: StrictInt = Field(5, ge=0, le=10_000)
    oom_retry: OOMRetry | None = None
    config: dict[str, Any] = Field(default_factory=dict, description="workload hyper-parameters (its config schema)")
    allow_overrides: tuple[FieldPath, ...] = Field((), max_length=256)
    # `config.*` keys whose change keeps a job's checkpoint lineage: a retry may resume across
    # such a change (more steps, a different micro-batch split); any other config change
    # starts a new lineage.
    resume_compatible: tuple[FieldPath, ...] = Field((), max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _entrypoint_unless_command(cls, data: Any) -> Any:
        """An SDK template's entrypoint defaults to train.py; a command template has none, and no
        SDK evaluation unless it says so (its `eval:` gives a command, or is left out)."""
        if not isinstance(data, dict):
            return data
        if data.get("command") is None:
            return {**data, "entrypoint": "train.py"} if data.get("entrypoint") is None else data
        return data if "eval" in data else {**data, "eval": None}

    @field_validator("command")
    @classmethod
    def _command_or_entrypoint(cls, command: tuple[str, ...] | None, info: ValidationInfo) -> tuple[str, ...] | None:
        if command is not None and info.data.get("entrypoint") is not None:
            raise ValueError("is given together with entrypoint: a template runs an SDK entrypoint or a command, "
                             "remove one of them")
        return command

    @field_validator("resources")
    @classmethod
    def _several_processes_need_a_command(cls, resources: Resources, info: ValidationInfo) -> Resources:
        if resources.processes > 1 and info.data.get("command") is None:
            raise ValueError(f"asks for {resources.processes} processes: several processes are started by torchrun "
                             "for a command workload (`command:`); an SDK entrypoint runs one (processes: 1)")
        check_group(resources, command=info.data.get("command"), kind=info.data.get("kind"))
        return resources

    @field_validator("elastic")
    @classmethod
    def _elastic_holds_the_node_count(cls, elastic: Elastic | None, info: ValidationInfo) -> Elastic | None:
        resources = info.data.get("resources")
        check_elastic(elastic, resources.nodes if resources is not None else 1)
        return elastic

    @field_validator("eval")
    @classmethod
    def _eval_matches_the_workload(cls, spec: EvalSpec | None, info: ValidationInfo) -> EvalSpec | None:
        if spec is not None and info.data.get("command") is not None and spec.command is None:
            raise ValueError("of a command workload needs eval.command (the SDK's eval.entrypoint runs main(ctx)); "
                             "give eval.command, or eval: null")
        return spec

    # Field validators (not one model validator) so that an error names its field: these
    # two come last, and `info.data` holds every field validated before them.
    @field_validator("allow_overrides")
    @classmethod
    def _overrides_name_real_fields(cls, keys: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        data = _plain(info.data)
        for key in keys:
            if not _has_path(data, key) and not _in_a_section_set_to_null(data, key, keys):
                raise ValueError(f"allow_overrides names {key!r}, which is not a field of this template")
        oom = info.data.get("oom_retry")
        for key in (oom.halve, oom.double) if oom else ():
            if key and key not in keys:
                raise ValueError(f"oom_retry changes {key!r}, which must also be in allow_overrides")
        return keys

    @field_validator("resume_compatible")
    @classmethod
    def _resume_keys_are_config_keys(cls, keys: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        data = _plain(info.data)
        for key in keys:
            if not key.startswith("config.") or not _has_path(data, key):
                raise ValueError(f"resume_compatible names {key!r}, which is not a config.* key of this template")
        return keys

    @property
    def template_id(self) -> str:
        return f"{self.name}@v{self.version}"

    @property
    def is_command(self) -> bool:
        return self.command is not None

    def lineage_hash(self) -> str:
        """sha256 of what makes checkpoints interchangeable: the workload, the entrypoint and
        the config without the `resume_compatible` keys (and a command workload's argv). Two attempts with the same hash may
        resume from each other's checkpoints."""
        config = copy.deepcopy(self.config)
        for key in self.resume_compatible:
            _drop_path(config, key.split(".")[1:])
        payload: dict[str, Any] = {"workload": self.workload, "entrypoint": self.entrypoint, "config": config}
        if self.command is not None:  # only then: an SDK template's lineages stay what they were
            payload["command"] = list(self.command)
        text = canonical_json(payload)
        return hashlib.sha256(text.encode()).hexdigest()


def _plain(data: dict) -> dict:
    return {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in data.items()}


def _has_path(data: dict, dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _in_a_section_set_to_null(data: dict, dotted: str, keys: tuple[str, ...]) -> bool:
    """Whether `dotted` lies in a section that is null here and is itself overridable: a
    submission that set `elastic` to null keeps `elastic.min_nodes` in its whitelist."""
    parts = dotted.split(".")
    for n in range(1, len(parts)):
        section = ".".join(parts[:n])
        if section in keys and _has_path(data, section) and _value_at(data, section) is None:
            return True
    return False


def _value_at(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node[part]
    return node


def _drop_path(data: dict, parts: list[str]) -> None:
    node: Any = data
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def typed_template(raw: dict, *, context: str, error: type[OrbitError] = TemplateError,
                   overrides: dict | None = None) -> TaskTemplate:
    """Validate a template's fields and its config against the workload's schema (defaults filled).

    The config goes first: the whitelist may name a config key the YAML leaves to the
    schema's default, and it exists only once the schema has filled it in."""
    _refuse_nul(raw, context=context, error=error)
    workload = raw.get("workload")
    if isinstance(workload, str) and 0 < len(workload) <= MAX_WORKLOAD_CHARS and "\0" not in workload:
        config = {} if raw.get("config") is None else raw.get("config")
        if raw.get("command") is not None and not has_config_schema(workload):
            # A command workload may come without config.py: its values are then only data.
            config = plain_config(config, error=error, context=context)
        else:
            schema = config_schema(workload)
            config = validate_config(schema, config, error=error, context=context, overrides=overrides)
        raw = {**raw, "config": config}
    try:
        template = TaskTemplate.model_validate(raw)
    except ValidationError as exc:
        raise readable(exc, TaskTemplate, error=error, context=context, overrides=overrides) from None
    check_placeholders(template, error=error, context=context)
    return template


def _refuse_nul(raw: Any, *, context: str, error: type[OrbitError]) -> None:
    """No string of a template (key or value, at any depth) holds a NUL byte: no path, name,
    environment variable or ledger row can (the document's size is bounded by `safe_yaml`)."""
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        where, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
        for key, value in items:
            path = f"{where}.{key}" if where else str(key)
            for text in (key, value):
                if isinstance(text, str) and "\0" in text:
                    field = path if len(path) <= 128 and path.isprintable() else show(path)
                    raise error(f"{context}: field {field} holds a NUL byte (value: {show(text)})", field=field,
                                value=text, fix=f"remove the NUL (\\0) from {field}")
            if isinstance(value, (dict, list, tuple)):
                stack.append((path, value))


def _template_files(extra_dirs: list[Path] | None = None) -> dict[str, Path | Any]:
    found: dict[str, Path | Any] = {}
    shipped = importlib_resources.files("orbit_dagster") / "templates"
    for entry in shipped.iterdir():
        if entry.name.endswith(".yaml"):
            found[entry.name[:-5]] = entry
    # The search path is the caller's (the settings' `template_dirs`: ORBIT_TEMPLATES or
    # $ORBIT_HOME/templates); core reads no settings of its own.
    for d in extra_dirs or []:  # a user's template shadows a shipped one of the same name
        for path in sorted(Path(d).glob("*.yaml")):
            found[path.stem] = path
    return found


def list_templates(extra_dirs: list[Path] | None = None) -> list[str]:
    return sorted(_template_files(extra_dirs))


def installed_template(ref: object, extra_dirs: list[Path] | None = None) -> bool:
    """Is `ref` the name of an installed template (shipped, or in `extra_dirs`: the settings'
    `ORBIT_TEMPLATES` or `$ORBIT_HOME/templates`)? A path never is: what names a template from
    outside data must not bring a template (and its workload's code) of its own."""
    return (isinstance(ref, str) and re.fullmatch(TEMPLATE_NAME, ref) is not None
            and ref in _template_files(extra_dirs))


def _src(source: str) -> str:
    """A template's name or path as messages show it: as written when short and printable."""
    return source if len(source) <= 200 and source.isprintable() else show(source)


def parse_template(text: str, *, source: str) -> TaskTemplate:
    if len(text) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"template {_src(source)} is {len(text)} characters long, more than {MAX_TEMPLATE_BYTES}",
                            field="template", value=source, fix="a template is a short recipe: move data into inputs")
    try:
        raw = safe_yaml.load(text)
    except safe_yaml.YamlRefused as exc:
        raise TemplateError(f"template {_src(source)} is refused: {exc}", field="template", value=source,
                            fix="write the values out, or use YAML anchors (&name / *name) only for small blocks "
                                f"(at most {safe_yaml.MAX_NODES} values once expanded)") from None
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an integer of more than 4300 digits
        where = " ".join(str(exc).split())[:300]  # the parser quotes the offending line: keep it short
        raise TemplateError(f"template {_src(source)} is not valid YAML: {where}", field="template", value=source,
                            fix="correct the YAML syntax") from None
    if not isinstance(raw, dict):
        raise TemplateError(f"template {_src(source)} must be a YAML mapping", fix="start the file with `name: ...`")
    return typed_template(raw, context=f"template {_src(source)}")


def load_template(name_or_path: str, extra_dirs: list[Path] | None = None) -> TaskTemplate:
    """Load by name (shipped or user directory) or by a path to a YAML file."""
    if name_or_path.endswith((".yaml", ".yml")):
        text = _read_template_file(name_or_path)
        if text is not None:
            return parse_template(text, source=name_or_path)
    files = _template_files(extra_dirs)
    if name_or_path not in files:
        raise TemplateError(
            f"no template named {show(name_or_path)}",
            field="template",
            value=name_or_path,
            fix=f"use one of: {', '.join(sorted(files)) or '(none)'}, or a path to a .yaml file",
        )
    entry = files[name_or_path]
    if isinstance(entry, Path):  # the user's directory: checked as a file given by path is
        text = _read_template_file(str(entry), shown=name_or_path)
        if text is None:
            raise TemplateError(f"template {show(name_or_path)} ({entry}) is not a regular file", field="template",
                                value=name_or_path, fix="make it a file, or remove it from the templates directory")
        return parse_template(text, source=name_or_path)
    return parse_template(entry.read_text(encoding="utf-8"), source=name_or_path)  # shipped


def _read_template_file(name: str, *, shown: str | None = None) -> str | None:
    """The text of a template given by path; None when no such file (then it is looked up by
    name). Its size is checked before a byte is read, and it is read in bounded chunks."""
    shown = name if shown is None else shown
    try:
        path = Path(name)
        if not path.is_file():
            return None
        return read_text_bounded(path, MAX_TEMPLATE_BYTES, what=f"template {_src(shown)}", field="template",
                                 fix="a template is a short recipe: move data into the workload's inputs")
    except OrbitError as exc:
        raise TemplateError(str(exc).split("; fix: ")[0], field="template", value=shown, fix=exc.fix) from None
    except (OSError, ValueError) as exc:  # unreadable, a name too long, a NUL byte
        raise TemplateError(f"template file {show(shown)} cannot be read: {reason(exc)}", field="template",
                            value=shown,
                            fix="give a readable .yaml file or a template name (`orbit templates` lists them)") from None
