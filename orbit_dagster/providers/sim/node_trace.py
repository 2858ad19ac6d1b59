"""The embedded market replaying an N-node trace node by node (docs/multi-node.md, "The
simulator and production decide alike").

An N-node trace is a zone's count of one shape's instances at each tick (`orbit simulate
--group` reads the same file). Node by node, node `i` is up while the count is above `i`: a
drop of the count to `c` reclaims nodes `c .. N-1`, the highest ranks, as `policy.group_replay`
reads the trace (a count does not name nodes; the highest ranks is the convention both
drivers share). Each instance the market rents for a group carries its node rank
(`orbit/node`, set by dispatch's gang rental and by a group recovery's replacements) and
follows that node's series:

- it is rented only where its node is up and stays up for the notice: a zone that will
  reclaim node `i` within the notice does not rent it out (so a replacement asked for during a
  notice meets the zone as it will be after the reclaim, as the simulator's `settle` does);
- it is reclaimed when its node's series goes down.

Trace time comes from a clock. `WallClock`: the market's own, `scale` trace seconds per wall
second (a reclaim at a wall time, like `market.TraceReclaims`). `StepClock`: trace time kept by
the training's progress, for replays that must not depend on how fast the machine runs: whoever
keeps it (a test's driver) arms each reclaim's notice at the step the trace's time corresponds to
(`SimProvider.inject_reclaim(at_step=...)`), so the schedule sets no wall-clock reclaim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ...catalog.traces import Trace, cyclic_time
from ...core.errors import NoCapacity
from ...core.offers import Offer


class NodeTrace:
    """An N-node (count) trace read node by node (the module's doc). Past its end the trace
    repeats as the market's replays do (`catalog.traces.cyclic_time`)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.gap = float(trace.gap_seconds)
        self.nodes = max(trace.data)

    def count(self, t_s: float) -> int:
        """How many of the zone's instances the trace holds at trace second `t_s`."""
        k = int(cyclic_time(self.trace, max(t_s, 0.0)) // self.gap)
        return int(self.trace.data[min(k, len(self.trace.data) - 1)])

    def up(self, node: int, t_s: float) -> bool:
        return self.count(t_s) > node

    def next_down(self, node: int, t_s: float, within_s: float | None = None) -> float | None:
        """The first trace second at or after `t_s` at which `node` is down; None if it stays up
        for `within_s` seconds (default: one pass over the trace)."""
        if not self.up(node, t_s):
            return t_s
        end = t_s + (self.trace.duration_s if within_s is None else within_s)
        k = math.floor(t_s / self.gap) + 1
        while k * self.gap <= end:
            if not self.up(node, k * self.gap):
                return k * self.gap
            k += 1
        return None

    def next_reclaim(self, size: int, t_s: float) -> tuple[float, tuple[int, ...]] | None:
        """A group of nodes 0..size-1 running from `t_s`: when the first of them goes, and which
        go then (every node at or above the count the trace drops to)."""
        e = self.next_down(size - 1, t_s)
        if e is None:
            return None
        return e, tuple(range(min(self.count(e), size - 1), size))

    def next_held(self, size: int, t_s: float) -> float | None:
        """The first trace second at or after `t_s` at which the trace holds `size` nodes."""
        k = math.floor(t_s / self.gap)
        if self.count(t_s) >= size:
            return t_s
        for j in range(k + 1, k + 1 + len(self.trace.data) * 2):
            if self.count(j * self.gap) >= size:
                return j * self.gap
        return None

    def refusal(self, node: int, t_s: float, notice_s: float) -> str | None:
        """Why node `node` cannot be rented at `t_s` (None: it can): it is down now, or the
        trace reclaims it within the notice."""
        down = self.next_down(node, t_s, within_s=notice_s)
        if down is None:
            return None
        when = "now" if down <= t_s else "after the reclaim"
        return f"the zone holds {self.count(down)} node(s) {when}, not {node + 1}"


class TraceClock(Protocol):
    def now(self, wall: float) -> float:
        """Trace seconds at wall time `wall`."""

    def wall(self, trace_s: float) -> float | None:
        """The wall time of trace second `trace_s` (None: this clock sets no wall-clock reclaims)."""


@dataclass
class WallClock:
    """The market's clock: trace second `at_s` at wall time `epoch_wall`, `scale` trace seconds a wall second."""

    epoch_wall: float
    at_s: float
    scale: float

    def now(self, wall: float) -> float:
        return self.at_s + (wall - self.epoch_wall) * self.scale

    def wall(self, trace_s: float) -> float | None:
        return self.epoch_wall + (trace_s - self.at_s) / self.scale


@dataclass
class StepClock:
    """Trace time kept by training progress. A session of `size` of the trace's `nodes` nodes,
    from trace second `start_s` at step `step`, advances `step_s * nodes / size` trace seconds a
    step: k of N nodes train the same global batch at k/N of the pace (the simulator's model,
    `policy.group_replay`). `now` is where its keeper last set it (a session's start, a notice)."""

    step_s: float  # trace seconds a step of the whole group
    nodes: int
    start_s: float = 0.0
    step: int = 0
    size: int = 0
    now_s: float = 0.0

    def session(self, start_s: float, step: int, size: int) -> None:
        self.start_s, self.step, self.size, self.now_s = start_s, step, size, start_s

    @property
    def pace_s(self) -> float:
        """Trace seconds a step of this session."""
        return self.step_s * self.nodes / self.size

    def time_of(self, step: float) -> float:
        return self.start_s + (step - self.step) * self.pace_s

    def step_at(self, t_s: float) -> int:
        """The first step boundary at or after trace second `t_s` (to a millionth of a step)."""
        return self.step + math.ceil((t_s - self.start_s) / self.pace_s - 1e-6)

    def at(self, t_s: float) -> None:
        self.now_s = t_s

    def now(self, wall: float) -> float:  # noqa: ARG002 - the steps, not the wall clock, move it
        return self.now_s

    def wall(self, trace_s: float) -> float | None:  # noqa: ARG002 - reclaims are armed at steps
        return None


class NodeTraceReclaims:
    """A reclaim schedule (`provider.ReclaimSchedule`) that rents and reclaims each node of a
    group by its own node's series of an N-node trace (the module's doc). `notice_s`: the
    notice, in trace seconds."""

    by_node = True  # SimProvider.provision passes the instance's node rank

    def __init__(self, nodes: NodeTrace, clock: TraceClock, *, notice_s: float):
        self.nodes, self.clock, self.notice_s = nodes, clock, notice_s

    def reclaim_at(self, offer: Offer, start_wall: float, node: int = 0) -> float | None:
        if not offer.spot:
            return None  # on-demand capacity: always there, never reclaimed
        now = self.clock.now(start_wall)
        why = self.nodes.refusal(node, now, self.notice_s)
        if why is not None:
            raise NoCapacity(why, provider="sim")
        down = self.nodes.next_down(node, now)
        return None if down is None else self.clock.wall(down)
