"""The host contract: every event a rented host writes to its event channel, typed, and its reader.

The channel is `artifacts/events.jsonl` on the host (see runtime/events.py, which appends
to it through `encode`): one JSON object a line, `{"type": KIND, "seq": N, "ts": UNIX_S,
"contract": VERSION, ...fields of KIND}`. The control plane reads it from a byte offset
(providers' `read_events`, through `read_chunk`/`read_file`) and matches on the record
types below, never on strings.

Kinds (version 1): started, device, probe, resumed, loaded, metrics, progress, checkpoint,
interval, notice, evaluation, exit. (`interval` came later than the others: a control plane
that predates it refuses those lines alone, as an unknown kind, and goes on.) Version 2 adds
`rebalance` (AWS's rebalance recommendation) and an emergency save's plan (`plan`,
`plan_fits`, `plan_reason`, `estimate_s`, `time_left_s`; `step` on a notice). Version 3 adds
the local-disk tier of an emergency save: `local_checkpoint` (its copy landed on the instance's
own disk, not yet durable; written by an SDK job's save and by a command workload's agent for
the script's own emergency save, `sha256` optional) and `plan_tier`, `local_seconds`,
`upload_seconds` on the plan and the checkpoint that follows. Each class names its fields and their types; a
field with a default may be absent from a line (an optional field that is None is left out).

Versions. This control plane reads `READS_VERSIONS`; a host writes each line with the first
version that has its kind and every field it carries (`SINCE`, `FIELDS_SINCE`, at most
`CONTRACT_VERSION`), so a version-1 control plane refuses only a newer host's new kinds and
the lines that carry new fields (an emergency save's plan), and goes on. A line older than its kind is refused; a
line with no `contract` (a host from before the field) is read as version 1, so upgrading the
control plane while attempts run on hosts loses nothing.

Refusals. A line that is not UTF-8 JSON, whose kind or version is unknown, or whose
fields are missing, unknown or of the wrong type is returned as a `Rejected` naming the
kind, version or field: never guessed, never raised (the run that follows the attempt
records it as an `event_rejected` ledger event and goes on).

Stdlib only, and copied into every bundle with the few core modules the host needs (core/bundle.py):
it runs on rented hosts that may have nothing but Python and torch.
"""
from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, Union

CONTRACT_VERSION = 3
READS_VERSIONS = frozenset({1, 2, 3})
UNVERSIONED_IS = 1  # a line without `contract`: written by a host of before the field
KIND_FIELD = "type"
VERSION_FIELD = "contract"
EVENTS_FILE = "events.jsonl"
READ_MAX = 4 << 20  # bytes per read: a host's file is read in bounded steps, the rest next poll
COUNT_MAX = 2**62  # a step or byte count a database integer holds
INT_RANGE = (-(2**63), 2**63 - 1)
COUNTS = frozenset({"seq", "step", "bytes", "attempt", "last_step", "size", "iterations", "pid", "next_step",
                    "steps", "cadence_steps", "policy_steps"})
SHOWN_CHARS = 500  # of a refused line, kept in the refusal
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # JSON has no NaN: written as strings


@dataclass(frozen=True, kw_only=True)
class HostEvent:
    """What every line carries; `KIND` is its `type`."""

    KIND: ClassVar[str] = ""
    SINCE: ClassVar[int] = 1  # the contract version that introduced this kind: what its lines say
    # Optional fields a later version added to an older kind: a line that carries one says that
    # version, so an older control plane refuses it by its version, never reads half of it.
    FIELDS_SINCE: ClassVar[dict[str, int]] = {}
    seq: int = 0
    ts: float = 0.0
    contract: int = 1


@dataclass(frozen=True, kw_only=True)
class Started(HostEvent):
    """The agent checked the bundle and the host (precheck: python, torch, devices, ...)."""

    KIND: ClassVar[str] = "started"
    task: str
    attempt: int
    pid: int
    precheck: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Device(HostEvent):
    """The device and precision the runtime chose, before any workload code ran."""

    KIND: ClassVar[str] = "device"
    device: str
    device_name: str
    precision: str


@dataclass(frozen=True, kw_only=True)
class Probe(HostEvent):
    """A measured dense-matmul TFLOP/s of the host's device (runtime/probe.py)."""

    KIND: ClassVar[str] = "probe"
    tflops: float
    dtype: str
    device: str
    device_name: str
    size: int
    iterations: int
    seconds: float
    threads: int | None = None
    torch: str | None = None


@dataclass(frozen=True, kw_only=True)
class Resumed(HostEvent):
    """Training continues from this checkpoint."""

    KIND: ClassVar[str] = "resumed"
    uri: str
    step: int
    tier: str


@dataclass(frozen=True, kw_only=True)
class Loaded(HostEvent):
    """An evaluation (or a resume's delta base) loaded this checkpoint."""

    KIND: ClassVar[str] = "loaded"
    uri: str
    step: int
    tier: str


@dataclass(frozen=True, kw_only=True)
class Metrics(HostEvent):
    """Training metrics at a step (means since the last report); a diverged one is NaN/inf."""

    KIND: ClassVar[str] = "metrics"
    step: int
    values: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class Progress(HostEvent):
    """The workload completed `step` steps (written before each checkpoint)."""

    KIND: ClassVar[str] = "progress"
    step: int


@dataclass(frozen=True, kw_only=True)
class Checkpoint(HostEvent):
    """A checkpoint is complete in the store (its manifest written last)."""

    KIND: ClassVar[str] = "checkpoint"
    FIELDS_SINCE: ClassVar[dict[str, int]] = {"plan": 2, "plan_fits": 2, "plan_reason": 2, "estimate_s": 2, "time_left_s": 2,
                                              "plan_tier": 3, "local_seconds": 3, "upload_seconds": 3}
    step: int
    tier: str
    uri: str
    sha256: str
    bytes: int
    attempt: int
    weights_sha256: str | None = None
    parent: str | None = None
    train_loss: float | None = None
    save_seconds: float | None = None
    blocked_seconds: float | None = None
    write_seconds: float | None = None
    source: str | None = None
    changed_fraction: float | None = None  # emergency saves: how much changed since the base
    changed_measure: str | None = None
    delta_of: str | None = None
    # Emergency saves: what was chosen to fit the notice, and why (runtime/emergency.py).
    plan: str | None = None  # "full" | "delta"
    plan_fits: bool | None = None  # False: expected to miss the deadline, written anyway
    plan_reason: str | None = None
    estimate_s: float | None = None  # the measured estimate of this save's seconds
    time_left_s: float | None = None  # until the notice's deadline, when the plan was made
    # An emergency save written to the instance's own disk first, then uploaded (`plan_tier`
    # "local"; absent: straight to the store): the seconds of each leg.
    plan_tier: str | None = None
    local_seconds: float | None = None
    upload_seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class LocalCheckpoint(HostEvent):
    """An emergency save's copy is complete on the instance's own disk, and its upload to the
    store begins. Not a checkpoint: nothing resumes from it, and it is lost with the instance;
    the `checkpoint` record follows once the upload's manifest commits.

    Two writers. An SDK job's save (runtime/checkpointing.py): the copy is orbit's own (manifest
    written, fsynced), `sha256` its digest, `seconds` the local write. A command workload's
    (runtime/command.py): the script's own files are the copy; `sha256` is left out (hashing
    them first would delay the upload by a pass over every byte; the digest comes with the
    `checkpoint` record) and `seconds` runs from the notice to the newest file's mtime (the
    script's save, the end of its step included). On node 0 of a group, the files are the
    union of every node's part, fetched beside its own; the notice is the group's first."""

    KIND: ClassVar[str] = "local_checkpoint"
    SINCE: ClassVar[int] = 3
    step: int
    attempt: int
    uri: str  # on the host's disk: the control plane never reads it
    bytes: int
    seconds: float
    sha256: str | None = None  # None: not hashed before the upload (a command workload's files)
    time_left_s: float | None = None  # until the notice's deadline, when the local copy landed
    contract: int = 3


@dataclass(frozen=True, kw_only=True)
class Interval(HostEvent):
    """The agent re-decided the durable checkpoint interval at `step` (runtime/checkpoint_schedule.py):
    the next durable save comes at `next_step`; `age_s`, `work_left_s`, `interval_s` in market seconds."""

    KIND: ClassVar[str] = "interval"
    step: int
    next_step: int
    steps: int
    age_s: float
    policy: str
    reason: str
    cadence_steps: int
    interval_s: float | None = None
    policy_steps: int | None = None
    work_left_s: float | None = None
    step_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Notice(HostEvent):
    """A reclaim notice (the metadata endpoint, or SIGTERM)."""

    KIND: ClassVar[str] = "notice"
    FIELDS_SINCE: ClassVar[dict[str, int]] = {"step": 2, **{"plan": 2, "plan_fits": 2, "plan_reason": 2, "estimate_s": 2, "time_left_s": 2},
                                              "plan_tier": 3}
    source: str
    deadline: float | None
    received_at: float
    # A second record of the same notice, once the emergency save is planned (before it is
    # written, so the ledger knows a notice could not be met even if the host goes first).
    step: int | None = None
    plan: str | None = None
    plan_fits: bool | None = None
    plan_reason: str | None = None
    estimate_s: float | None = None
    time_left_s: float | None = None
    plan_tier: str | None = None  # "local": the instance's disk first, then the store


@dataclass(frozen=True, kw_only=True)
class Rebalance(HostEvent):
    """AWS's rebalance recommendation (runtime/notices.py); `action`: what the agent did about it
    (`checkpoint`, `schedule`: an early durable save asked for; `record`: nothing)."""

    KIND: ClassVar[str] = "rebalance"
    SINCE: ClassVar[int] = 2
    source: str
    notice_time: float | None
    received_at: float
    action: str
    contract: int = 2


@dataclass(frozen=True, kw_only=True)
class Evaluation(HostEvent):
    """An evaluation's result metrics."""

    KIND: ClassVar[str] = "evaluation"
    metrics: dict[str, float]
    checkpoint: str | None = None


@dataclass(frozen=True, kw_only=True)
class Exit(HostEvent):
    """The agent's last line: its exit code and the failure class it means."""

    KIND: ClassVar[str] = "exit"
    code: int
    failure_class: str | None
    reason: str
    seconds: float
    last_step: int | None = None


KINDS: dict[str, type[HostEvent]] = {c.KIND: c for c in (
    Started, Device, Probe, Resumed, Loaded, Metrics, Progress, Checkpoint, LocalCheckpoint, Interval, Notice, Rebalance,
    Evaluation, Exit)}
STEP_EVENTS = (Metrics, Progress, Checkpoint, Resumed, Loaded)  # the kinds that say a step was reached


@dataclass(frozen=True)
class Rejected:
    """A line refused: where it starts in the file, why (naming the kind, version or field), its start."""

    offset: int
    reason: str
    line: str
    kind: str | None = None


Entry = Union[HostEvent, Rejected]


class ContractError(ValueError):
    """A mapping that is no event of this contract (the message names the kind, version or field)."""

    def __init__(self, reason: str, kind: str | None = None):
        super().__init__(reason)
        self.kind = kind


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _coerce(kind: str, name: str, hint: Any, value: Any) -> Any:
    """`value` as a `hint`, or a ContractError naming the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _coerce(kind, name, hint, value)

    def bad(what: str) -> ContractError:
        return ContractError(f"{kind}: field {name!r} is {_shown(value)}, not {what}", kind)

    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        low, high = (0, COUNT_MAX) if name in COUNTS else INT_RANGE
        if not low <= value <= high:
            raise bad(f"an integer in [{low}, {high}]")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if hint is float:
        if isinstance(value, str) and value in NON_FINITE:
            return NON_FINITE[value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        try:
            return float(value)
        except OverflowError:
            raise bad("a number a float holds") from None
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise bad("a mapping")
        if args[1] is Any:
            return dict(value)
        return {k: _coerce(kind, f"{name}[{_shown(k)}]", args[1], v) for k, v in value.items()}
    raise TypeError(f"host contract: no rule for {hint!r}")  # a class above declares a type no rule covers


def from_mapping(obj: object) -> HostEvent:
    """The record a decoded JSON line holds, or a ContractError naming the kind, version or field."""
    if not isinstance(obj, dict):
        raise ContractError(f"a line is a JSON object, not {type(obj).__name__}")
    kind = obj.get(KIND_FIELD)
    if not isinstance(kind, str) or kind not in KINDS:
        raise ContractError(f"unknown kind {_shown(kind)} (known: {', '.join(sorted(KINDS))})")
    version = obj.get(VERSION_FIELD, UNVERSIONED_IS)
    if isinstance(version, bool) or not isinstance(version, int) or version not in READS_VERSIONS:
        raise ContractError(f"{kind}: contract version {_shown(version)} is not one this control plane reads "
                            f"({', '.join(map(str, sorted(READS_VERSIONS)))})", kind)
    if version < KINDS[kind].SINCE:
        raise ContractError(f"{kind}: a kind of contract version {KINDS[kind].SINCE}; the line says version {version}",
                            kind)
    spec = SPECS[kind]
    unknown = sorted(set(obj) - set(spec) - {KIND_FIELD}, key=str)
    if unknown:
        raise ContractError(f"{kind}: unknown field(s) {', '.join(map(_shown, unknown))}", kind)
    newer = sorted(f for f, since in KINDS[kind].FIELDS_SINCE.items() if f in obj and since > version)
    if newer:
        raise ContractError(f"{kind}: field(s) {', '.join(newer)} of a later contract version; the line says "
                            f"version {version}", kind)
    values = {}
    for name, (hint, required) in spec.items():
        if name in obj:
            values[name] = _coerce(kind, name, hint, obj[name])
        elif required:
            raise ContractError(f"{kind}: field {name!r} is missing", kind)
    values[VERSION_FIELD] = version
    return KINDS[kind](**values)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def to_mapping(event: HostEvent) -> dict[str, Any]:
    """The JSON object of a record: non-finite floats as "nan"/"inf"/"-inf", an optional field
    that is None left out (absent reads as None)."""
    out = {f.name: _plain(getattr(event, f.name)) for f in fields(event)
           if not (f.default is None and getattr(event, f.name) is None)}
    out[KIND_FIELD] = event.KIND
    return out


def fields_of(event: HostEvent) -> dict[str, Any]:
    """A record's own fields (no envelope: seq, ts, contract), JSON-safe."""
    return {k: v for k, v in to_mapping(event).items() if k not in (KIND_FIELD, "seq", "ts", VERSION_FIELD)}


def encode(event: HostEvent) -> str:
    """One line of the channel. The line is read back first: a record that would be refused is
    never written (ContractError)."""
    line = json.dumps(to_mapping(event), sort_keys=True, default=str, allow_nan=False)
    from_mapping(json.loads(line))
    return line + "\n"


def version_of(event: HostEvent) -> int:
    """The first contract version that has the record's kind and every field it carries."""
    present = [since for name, since in event.FIELDS_SINCE.items() if getattr(event, name) is not None]
    return max([event.SINCE, *present])


def stamp(event: HostEvent, *, seq: int, ts: float) -> HostEvent:
    """The record as written: its place, its time, and its version (`version_of`)."""
    return replace(event, seq=seq, ts=ts, contract=version_of(event))


def decode_line(raw: bytes, offset: int = 0) -> Entry:
    """One line (without its newline) as a record, or its refusal."""
    shown = raw[:SHOWN_CHARS].decode("utf-8", errors="replace")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return Rejected(offset, "not UTF-8 text", shown)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        return Rejected(offset, f"not a JSON line ({type(exc).__name__})", shown)
    try:
        return from_mapping(obj)
    except ContractError as exc:
        return Rejected(offset, str(exc), shown, exc.kind)


def read_chunk(chunk: bytes, offset: int, *, limit: int = READ_MAX) -> tuple[list[Entry], int]:
    """`chunk`, bytes of an events.jsonl read from byte `offset` (at most `limit` of them):
    its whole lines as records or refusals, in order, and the offset after the last whole
    line. A torn last line (its newline not written yet) waits: the offset stays at its
    start, so the next read has it whole. A full read with no newline is one line longer
    than any event: refused, and skipped (else the reader would stop there for good)."""
    end = chunk.rfind(b"\n") + 1
    if end == 0:
        if len(chunk) >= limit:
            shown = chunk[:SHOWN_CHARS].decode("utf-8", errors="replace")
            return [Rejected(offset, f"a line longer than {limit} bytes", shown)], offset + len(chunk)
        return [], offset
    entries: list[Entry] = []
    at = offset
    for raw in chunk[:end].split(b"\n")[:-1]:
        if raw.strip():
            entries.append(decode_line(raw, at))
        at += len(raw) + 1
    return entries, offset + end


def read_file(path: Path, offset: int, *, limit: int = READ_MAX) -> tuple[list[Entry], int]:
    """`read_chunk` of a local file (no file yet: nothing, the offset stays)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read(limit)
    except FileNotFoundError:
        return [], offset
    return read_chunk(chunk, offset, limit=limit)


SPECS = {kind: {f.name: (typing.get_type_hints(cls)[f.name], _required(f)) for f in fields(cls)}
         for kind, cls in KINDS.items()}
