"""Spot traces: load the public trace formats and answer replay questions about them.

Formats (see the shared data's SOURCES.md; all from skypilot-org/spot-traces):

- preemption, 1 node: ``{"metadata": {"gap_seconds": 32}, "data": [0|1, ...], "prices": [$/h, ...]}``
- availability, 1 node: ``{"metadata": {"gap_seconds": 195}, "data": [0|1, ...]}``
- availability, N nodes: the same with counts ``0..N`` in ``data``.

Tick ``k`` covers trace time ``[k*gap, (k+1)*gap)``. A value > 0 (or >= the nodes a job
needs) means a spot instance is obtainable or still running; each 1->0 edge is a reclaim.

The simulated spot market (``providers/sim``) and the policy replay engine both call the
helpers here, so an instance lives and dies at the same instants in both.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from orbit_dagster.core.bounded import memory_cap, printable_name, read_text_bounded, size_text
from orbit_dagster.core.errors import OrbitError

TraceKind = Literal["preemption", "availability", "multinode"]

__all__ = [
    "Trace", "TraceFormatError", "load_trace", "load_traces", "find_trace_files",
    "reclaim_offsets", "next_available", "up_runs",
    # re-exported lazily from catalog.reclaim_model (see __getattr__ below)
    "ReclaimModel", "fit_reclaim_model", "generate_trace", "load_reclaim_model",  # noqa: F822 - lazy: __getattr__
]


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
    #: the file's ``metadata`` (``cloud``, ``instance_type``, ``nodes``, ``zone`` are read by
    #: ``catalog.trace_market``); not part of equality, a trace is its ticks
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
    extra = {k: v for k, v in meta.items() if k in ("cloud", "instance_type", "nodes", "zone")}
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
    return trace_from_dict(obj, name=p.stem, source=str(p))


def find_trace_files(data_dir: str | Path) -> list[Path]:
    """Every ``*.json`` under ``<data_dir>/traces`` (or ``data_dir`` itself), sorted for determinism."""
    root = Path(data_dir)
    base = root / "traces" if (root / "traces").is_dir() else root
    return sorted(base.rglob("*.json"))


def load_traces(data_dir: str | Path) -> list[Trace]:
    return [load_trace(p) for p in find_trace_files(data_dir)]


# ---------------------------------------------------------------- replay helpers

def _tick(trace: Trace, t_s: float) -> int:
    return int(math.floor(t_s / trace.gap_seconds + 1e-9))


def _value(trace: Trace, k: int, nodes: int, cyclic: bool) -> bool | None:
    n = len(trace.data)
    if k < 0 or (k >= n and not cyclic):
        return None
    return trace.data[k % n] >= nodes


def up_runs(trace: Trace, start_s: float, horizon_s: float, *, nodes: int = 1,
            cyclic: bool = False) -> Iterator[tuple[float, float, bool]]:
    """Spans ``(begin_s, end_s, reclaimed)`` in trace time where the spot market can hold the job.

    Spans are clipped to ``[start_s, start_s + horizon_s]``. ``reclaimed`` is True when the
    span ends with a 1->0 edge (a reclaim), False when it ends at the horizon or trace end.
    ``cyclic`` replays the trace again from its first tick once it runs out.
    """
    gap = trace.gap_seconds
    end_limit = start_s + horizon_s
    if not cyclic:
        end_limit = min(end_limit, trace.duration_s)
    k = max(_tick(trace, start_s), 0)
    while k * gap < end_limit:
        if not _value(trace, k, nodes, cyclic):
            k += 1
            continue
        j = k
        while _value(trace, j, nodes, cyclic) and j * gap < end_limit:
            j += 1
        begin = max(k * gap, start_s)
        end = min(j * gap, end_limit)
        reclaimed = j * gap <= end_limit and _value(trace, j, nodes, cyclic) is False
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
    k = max(_tick(trace, t_s), 0)
    limit = k + n if cyclic else n
    while k < limit:
        if _value(trace, k, nodes, cyclic):
            return max(t_s, k * trace.gap_seconds)
        k += 1
    return None


def __getattr__(name: str) -> Any:
    """Re-export the reclaim model API without an import cycle (reclaim_model imports Trace)."""
    if name in {"ReclaimModel", "fit_reclaim_model", "generate_trace", "load_reclaim_model"}:
        from orbit_dagster.catalog import reclaim_model

        return getattr(reclaim_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
