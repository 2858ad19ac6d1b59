"""Spot traces: load the public trace formats and answer replay questions about them.

Formats (see the shared data's SOURCES.md; all from skypilot-org/spot-traces):

- preemption, 1 node: ``{"metadata": {"gap_seconds": 32}, "data": [0|1, ...], "prices": [$/h, ...]}``
- availability, 1 node: ``{"metadata": {"gap_seconds": 195}, "data": [0|1, ...]}``
- availability, N nodes: the same with counts ``0..N`` in ``data``.

``metadata.cloud`` (``aws`` or ``gcp``) says which cloud's market a trace was measured in,
and so its reclaim notice; nothing guesses it from a file's name. The one exception is the
shared data set's own, documented naming convention (its ``SOURCES.md`` names every file
``<cloud>-<YYYY-MM-DD>_<zone>_<tag>``): a file with such a name *inside that data set's
directory* (``<root>/traces/...`` beside ``<root>/SOURCES.md``) gets its cloud and date
recorded from the name when it is loaded, and the trace says so (``metadata.convention``; ``metadata.cloud_from`` when the cloud was read from it).

Tick ``k`` covers trace time ``[k*gap, (k+1)*gap)``. A value > 0 (or >= the nodes a job
needs) means a spot instance is obtainable or still running; each 1->0 edge is a reclaim.

The simulated spot market (``providers/sim``) and the policy replay engine both call the
helpers here, so an instance lives and dies at the same instants in both.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Any, Iterator, Literal

from orbit_dagster.core.bounded import memory_cap, printable_name, read_text_bounded, size_text
from orbit_dagster.core.errors import OrbitError

TraceKind = Literal["preemption", "availability", "multinode"]

__all__ = [
    "Trace", "TraceFormatError", "load_trace", "load_traces", "find_trace_files",
    "reclaim_offsets", "next_available", "up_runs", "CLOUDS", "SHARED_NAME", "shared_data_root",
    "trace_source", "trace_date", "record_name_convention",
]

#: The clouds a trace can be measured in (``metadata.cloud``).
CLOUDS = ("aws", "gcp")
#: The shared data set's file names (its SOURCES.md): ``<cloud>-<YYYY-MM-DD>_<zone>_<tag>``.
SHARED_NAME = re.compile(r"^(?P<cloud>aws|gcp)-(?P<date>\d{4}-\d{2}-\d{2})_"
                         r"(?P<zone>[a-z]{2}-[a-z]+(?:-\d[a-z]|\d-[a-z]))_(?P<tag>.+)$")
#: What ``metadata.convention`` holds when the cloud and date were read from the file name.
NAME_CONVENTION = "shared data set file name (SOURCES.md)"


class TraceFormatError(OrbitError):
    """A trace file that does not follow one of the formats in SOURCES.md."""


@dataclass(frozen=True)
class Trace:
    """One spot trace: a tick length and one availability value (and maybe a price) per tick."""

    name: str
    gap_seconds: float
    data: tuple[int, ...]
    prices: tuple[float, ...] | None
    kind: TraceKind
    #: the file's ``metadata`` (``cloud``, ``date``, ``instance_type``, ``nodes``, ``zone`` are read
    #: by ``catalog.trace_market``), plus what loading recorded: ``dataset`` (the directory the
    #: file lies in) and ``convention`` (set when the cloud and date come from the shared data
    #: set's naming convention); not part of equality, a trace is its ticks
    metadata: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def duration_s(self) -> float:
        return self.gap_seconds * len(self.data)

    def available(self, nodes: int = 1) -> tuple[bool, ...]:
        """Per tick: can a job that needs ``nodes`` instances hold them?"""
        return tuple(v >= nodes for v in self.data)

    def price_at(self, k: int, default: float) -> float:
        """Spot $/h of tick ``k``; ``default`` for traces that carry no prices."""
        if self.prices is None:
            return default
        return self.prices[k % len(self.prices)]


def _fail(path: str, field: str, value: object, fix: str) -> TraceFormatError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return TraceFormatError(f"trace {path}: field {field!r} = {shown} is invalid", field=field, value=value, fix=fix)


MAX_NODES = 100_000


def _finite(x: int | float) -> bool:
    """A finite number that a float holds (a JSON integer can be larger than any float)."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def trace_from_dict(obj: Any, *, name: str, source: str | None = None) -> Trace:
    """Validate a decoded trace document; every error names the file, the field and the fix."""
    src = source or name
    if not isinstance(obj, dict):
        raise _fail(src, "<document>", type(obj).__name__, "a trace is a JSON object with 'metadata' and 'data'")
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        raise _fail(src, "metadata", meta, "'metadata' must be an object such as {\"gap_seconds\": 32}")
    gap = meta.get("gap_seconds", obj.get("gap_seconds"))
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not _finite(gap) or gap <= 0:
        raise _fail(src, "metadata.gap_seconds", gap, "set metadata.gap_seconds to the tick length in seconds (> 0)")
    data = obj.get("data")
    if not isinstance(data, list) or not data:
        raise _fail(src, "data", data, "'data' must be a non-empty list of availability values (0/1 or node counts)")
    for i, v in enumerate(data):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v < 0 or v != int(v) \
                or v > MAX_NODES:
            raise _fail(src, f"data[{i}]", v, "availability values are non-negative integers (0/1, or node counts)")
    values = tuple(int(v) for v in data)
    prices = obj.get("prices")
    if prices is not None:
        if not isinstance(prices, list) or len(prices) != len(values):
            n = len(prices) if isinstance(prices, list) else type(prices).__name__
            raise _fail(src, "prices", n, f"'prices' must be a list of {len(values)} $/h values, one per tick of 'data'")
        for i, p in enumerate(prices):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not _finite(p) or p < 0:
                raise _fail(src, f"prices[{i}]", p, "prices are non-negative $/h numbers")
        prices = tuple(float(p) for p in prices)
    kind: TraceKind
    if max(values) > 1:
        kind = "multinode"
    elif prices is not None:
        kind = "preemption"
    else:
        kind = "availability"
    cloud = meta.get("cloud")
    if cloud is not None and cloud not in CLOUDS:
        raise _fail(src, "metadata.cloud", cloud, "set metadata.cloud to \"aws\" or \"gcp\" (the cloud the trace "
                    "was measured in), or pass --cloud aws|gcp")
    when = meta.get("date")
    if when is not None:
        try:
            date.fromisoformat(when if isinstance(when, str) and len(when) == 10 else "?")
        except ValueError:
            raise _fail(src, "metadata.date", when, "set metadata.date to the day the trace begins, as YYYY-MM-DD") \
                from None
    extra = {k: v for k, v in meta.items() if k in ("cloud", "date", "instance_type", "nodes", "zone")}
    return Trace(name=name, gap_seconds=float(gap), data=values, prices=prices, kind=kind, metadata=extra)


MAX_TRACE_BYTES = 256 << 20


def load_trace(path: str | Path) -> Trace:
    """Read one trace file (any format in SOURCES.md), size-checked before it is read."""
    if not printable_name(str(path)):
        raise TraceFormatError(f"trace path {str(path)[:80]!r} holds a NUL or other control character", field="trace",
                               value=str(path)[:200], fix="pass the trace file's path as it is written")
    p = Path(path)
    if not p.is_file():
        raise TraceFormatError(f"trace file {p} does not exist", field="trace", value=str(p),
                               fix="pass the path of a spot-trace JSON file")
    cap = memory_cap(MAX_TRACE_BYTES, 1 / 16)  # parsed into Python objects: ~10x its size in memory
    try:
        text = read_text_bounded(p, cap, what=f"trace {p}", field="trace",
                                 fix=f"pass a trace of at most {size_text(cap)} (split a longer one by time)")
    except OrbitError as err:  # too large, or not UTF-8: a TraceFormatError like every other refusal here
        raise TraceFormatError(str(err).split("; fix: ")[0], field="trace", value=str(p), fix=err.fix) from None
    try:
        obj = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
        raise TraceFormatError(f"trace {p} is not valid JSON ({err})", field="<document>", value=str(p),
                               fix="pass a spot-trace JSON file (skypilot-org/spot-traces format)") from err
    trace = trace_from_dict(obj, name=p.stem, source=str(p))
    root = shared_data_root(p)
    meta = dict(trace.metadata)
    if root is None:
        meta["dataset"] = p.parent.name or "."
        return replace(trace, metadata=meta)
    meta["dataset"] = p.resolve().parent.relative_to(root / "traces").as_posix() or "."
    return record_name_convention(replace(trace, metadata=meta))


def record_name_convention(trace: Trace) -> Trace:
    """``trace`` with the cloud and date its shared-data-set name gives recorded in its metadata.

    For traces of the shared data set only (``load_trace`` calls it for a file inside that
    data set's directory): the data set's SOURCES.md names each file by its cloud and start
    day, which is its documented convention; any other file's name is never read, so that a
    replay never guesses a cloud from the name of an arbitrary file. Explicit metadata wins.
    """
    m = SHARED_NAME.match(trace.name)
    if not m:
        return trace
    meta = dict(trace.metadata)
    if "cloud" not in meta:
        meta["cloud"], meta["cloud_from"] = m["cloud"], NAME_CONVENTION
    meta.setdefault("date", m["date"])
    meta["convention"] = NAME_CONVENTION
    return replace(trace, metadata=meta)


def shared_data_root(path: str | Path) -> Path | None:
    """The shared data directory a trace file lies in (``<root>/traces/.../<file>`` with
    ``<root>/SOURCES.md``, the data set's description), or None for any other file."""
    p = Path(path).resolve()
    for parent in p.parents:
        if parent.name == "traces":
            return parent.parent if (parent.parent / "SOURCES.md").is_file() else None
    return None


def trace_source(trace: Trace) -> str:
    """Where a trace comes from, for a split: its data set directory and its cloud."""
    return f"{trace.metadata.get('dataset', '?')}/{trace.metadata.get('cloud') or 'cloud unknown'}"


def trace_date(trace: Trace) -> date | None:
    """The day a trace begins: ``metadata.date`` (given, or recorded from the shared data set's names)."""
    when = trace.metadata.get("date")
    return date.fromisoformat(when) if isinstance(when, str) else None


def find_trace_files(data_dir: str | Path) -> list[Path]:
    """Every ``*.json`` under ``<data_dir>/traces`` (or ``data_dir`` itself), sorted for determinism."""
    root = Path(data_dir)
    base = root / "traces" if (root / "traces").is_dir() else root
    return sorted(base.rglob("*.json"))


def load_traces(data_dir: str | Path) -> list[Trace]:
    """Every trace of a data directory (see :func:`load_trace` for what loading records)."""
    return [load_trace(p) for p in find_trace_files(data_dir)]


# ---------------------------------------------------------------- replay helpers

def _tick(trace: Trace, t_s: float) -> int:
    return int(math.floor(t_s / trace.gap_seconds + 1e-9))


def first_up_tick(trace: Trace, nodes: int = 1) -> int | None:
    """The trace's first tick that holds ``nodes`` instances; None if none does."""
    return next((k for k, v in enumerate(trace.data) if v >= nodes), None)


class _Cycle:
    """Where a cyclic replay reads the trace: once through, then again and again from its first
    tick that holds ``nodes``. The end is joined to the start only where the trace says the
    instance was up: a trace that ends up and starts down would otherwise invent a reclaim at
    the join, one the trace never recorded (and a down run it never had)."""

    def __init__(self, trace: Trace, nodes: int):
        self.n = len(trace.data)
        first = first_up_tick(trace, nodes)
        self.first = 0 if first is None else first  # never up: every pass reads all of it (all down)

    def tick(self, k: int) -> int:
        """The trace tick that tick ``k`` (>= 0) of the replay reads."""
        return k if k < self.n else self.first + (k - self.n) % (self.n - self.first)


def cyclic_ticks(trace: Trace, start: int, count: int, nodes: int = 1) -> list[int]:
    """The trace ticks that ticks ``start`` (>= 0) to ``start + count - 1`` of a cyclic replay
    read (see ``_Cycle``)."""
    cycle = _Cycle(trace, nodes)
    return [cycle.tick(k) for k in range(start, start + count)]


def cyclic_time(trace: Trace, t_s: float, nodes: int = 1) -> float:
    """The trace second that second ``t_s`` (>= 0) of a cyclic replay reads (see ``_Cycle``)."""
    cycle = _Cycle(trace, nodes)
    if t_s < trace.duration_s:
        return t_s
    gap = trace.gap_seconds
    return cycle.first * gap + (t_s - trace.duration_s) % ((cycle.n - cycle.first) * gap)


def _value(trace: Trace, k: int, nodes: int, cyclic: bool, cycle: _Cycle | None = None) -> bool | None:
    n = len(trace.data)
    if k < 0 or (k >= n and not cyclic):
        return None
    return trace.data[(cycle or _Cycle(trace, nodes)).tick(k) if k >= n else k] >= nodes


def up_runs(trace: Trace, start_s: float, horizon_s: float, *, nodes: int = 1,
            cyclic: bool = False) -> Iterator[tuple[float, float, bool]]:
    """Spans ``(begin_s, end_s, reclaimed)`` in trace time where the spot market can hold the job.

    Spans are clipped to ``[start_s, start_s + horizon_s]``. ``reclaimed`` is True when the
    span ends with a 1->0 edge (a reclaim), False when it ends at the horizon or trace end.
    ``cyclic`` replays the trace again once it runs out, from its first tick that holds
    ``nodes`` (``_Cycle``: never a reclaim the trace did not record).
    """
    gap = trace.gap_seconds
    end_limit = start_s + horizon_s
    if not cyclic:
        end_limit = min(end_limit, trace.duration_s)
    cycle = _Cycle(trace, nodes)
    k = max(_tick(trace, start_s), 0)
    while k * gap < end_limit:
        if not _value(trace, k, nodes, cyclic, cycle):
            k += 1
            continue
        j = k
        while _value(trace, j, nodes, cyclic, cycle) and j * gap < end_limit:
            j += 1
        begin = max(k * gap, start_s)
        end = min(j * gap, end_limit)
        reclaimed = j * gap <= end_limit and _value(trace, j, nodes, cyclic, cycle) is False
        if end > begin:
            yield begin, end, reclaimed
        k = j


def reclaim_offsets(trace: Trace, start_s: float, horizon_s: float, *, nodes: int = 1,
                    cyclic: bool = False) -> list[float]:
    """Seconds after ``start_s`` of every reclaim (1->0 edge) in ``(start_s, start_s + horizon_s]``.

    The first offset is when an instance obtained at ``start_s`` is reclaimed (the trace
    must read 1 at ``start_s``: see :func:`next_available`); later ones hit the replacements
    obtained at ``next_available`` after each reclaim.
    """
    if horizon_s < 0:
        raise OrbitError("horizon_s must be >= 0", field="horizon_s", value=horizon_s, fix="pass a non-negative horizon")
    return [end - start_s for _, end, rec in up_runs(trace, start_s, horizon_s, nodes=nodes, cyclic=cyclic) if rec]


def next_available(trace: Trace, t_s: float, *, nodes: int = 1, cyclic: bool = False) -> float | None:
    """Earliest trace time >= ``t_s`` at which an instance can be obtained; None if never."""
    n = len(trace.data)
    cycle = _Cycle(trace, nodes)
    k = max(_tick(trace, t_s), 0)
    limit = k + n if cyclic else n
    while k < limit:
        if _value(trace, k, nodes, cyclic, cycle):
            return max(t_s, k * trace.gap_seconds)
        k += 1
    return None

