"""Deadline-aware spot/on-demand choice: the tick model, the safety rule, and the online policies.

The model is the one of "Can't Be Late" (Wu et al., NSDI'24), on the trace's ticks:

- a job needs ``work_ticks`` ticks of progress before ``deadline_ticks``;
- each tick it runs on spot (only where the trace is available), on on-demand (always
  available, dearer) or on nothing;
- every new instance (a switch, or spot again after a reclaim) spends ``changeover_ticks``
  without progress (restore + boot);
- a spot tick followed by a reclaim within ``loss_ticks`` yields no progress (the notice
  window, spent on the emergency checkpoint; or the work since the last periodic
  checkpoint when the notice is too short for one -- see ``loss_ticks_for``).

**Safety rule (shared by every online policy):** idling or taking spot at tick k is allowed
only if on-demand started at tick k+1 still finishes by the deadline:
``k + 1 + changeover + remaining <= deadline``; on-demand is always allowed. By induction
on-demand then stays feasible at every tick, so a deadline that was feasible at the start
(``changeover + work <= deadline``) is never missed, whatever the trace does. Tests check it
on random traces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from orbit_dagster.catalog.traces import cyclic_ticks
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.interval import checkpoint_interval, emergency_covered

NONE, SPOT, OD = "N", "S", "O"


@dataclass(frozen=True)
class DeadlineSetup:
    """One job on one window of a trace, in ticks; ``avail`` covers at least the deadline (+ loss)."""

    avail: tuple[bool, ...]
    spot_cost: tuple[float, ...]  # $ per tick
    od_cost: float  # $ per tick
    work_ticks: int
    deadline_ticks: int
    changeover_ticks: int = 1
    loss_ticks: int = 1
    gap_s: float = 1.0
    history: tuple[bool, ...] = ()  # availability before the job started (what a feed has seen)

    def __post_init__(self) -> None:
        for name in ("work_ticks", "deadline_ticks", "changeover_ticks", "loss_ticks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise OrbitError(f"{name} must be an integer >= 0", field=name, value=v, fix="pass whole ticks")
        if len(self.spot_cost) != len(self.avail):
            raise OrbitError("spot_cost must have one entry per tick of avail", field="spot_cost",
                             value=len(self.spot_cost), fix=f"pass {len(self.avail)} costs")

    @property
    def feasible(self) -> bool:
        """On-demand from the first tick meets the deadline."""
        return self.changeover_ticks + self.work_ticks <= self.deadline_ticks

    def spot_productive(self) -> list[bool]:
        """Per tick: does a spot tick (past its changeover) make progress? False when the
        instance is reclaimed within ``loss_ticks`` after it; ticks past the window count as available."""
        n, r = len(self.avail), self.loss_ticks
        out = []
        for k in range(n):
            ok = self.avail[k]
            for i in range(k + 1, min(k + r, n - 1) + 1):
                if not self.avail[i]:
                    ok = False
                    break
            out.append(ok)
        return out


def loss_ticks_for(gap_s: float, *, notice_s: float, save_s: float, emergency_save_s: float | None,
                   mtbf_s: float) -> int:
    """Ticks of progress a reclaim costs in the tick model.

    With an emergency checkpoint that fits the notice, the reclaim costs the notice window
    (at least one tick). Without one, it costs what periodic checkpointing at the
    Young/Daly interval loses in the worst case: one interval plus one save.
    """
    esave = save_s if emergency_save_s is None else emergency_save_s
    if emergency_covered(notice_s, esave):
        return max(1, math.ceil(notice_s / gap_s - 1e-9))
    tau = checkpoint_interval(mtbf_s, save_s)
    return max(1, math.ceil((tau + save_s) / gap_s - 1e-9))


@dataclass(frozen=True)
class Mode:
    """The instance the job holds after a tick, and changeover ticks it still owes."""

    kind: str = NONE
    owed: int = 0


@dataclass(frozen=True)
class Observation:
    """What an online policy knows at the start of tick ``k``."""

    k: int
    remaining: int
    available: bool
    mode: Mode
    safe: frozenset[str]
    setup: DeadlineSetup  # online policies read only avail[:k+1], history and prices up to k


def safe_actions(setup: DeadlineSetup, k: int, remaining: int, available: bool, mode: Mode) -> frozenset[str]:
    """The safety rule (module docstring). On-demand is always in the set."""
    c, d = setup.changeover_ticks, setup.deadline_ticks
    out = {OD}
    if k + 1 + c + remaining <= d:
        out.add(NONE)
        if available:
            out.add(SPOT)
    return frozenset(out)


def step(setup: DeadlineSetup, k: int, mode: Mode, action: str, productive_spot: bool) -> tuple[Mode, int, float]:
    """Apply ``action`` at tick ``k``: (next mode, progress ticks, dollars)."""
    c = setup.changeover_ticks
    if action == NONE:
        return Mode(NONE, 0), 0, 0.0
    owed = mode.owed if mode.kind == action else c
    if action == SPOT:
        progress = 1 if owed == 0 and productive_spot else 0
        cost = setup.spot_cost[k]
    else:
        progress = 1 if owed == 0 else 0
        cost = setup.od_cost
    return Mode(action, max(owed - 1, 0)), progress, cost


class DeadlinePolicy(Protocol):
    name: str

    def decide(self, obs: Observation) -> str: ...


@dataclass
class DeadlineResult:
    policy: str
    feasible: bool
    finished: bool
    missed: bool
    cost_usd: float
    finish_tick: int | None
    spot_ticks: int = 0
    od_ticks: int = 0
    changeovers: int = 0
    actions: str = ""
    extra: dict = field(default_factory=dict)

    def as_dict(self, gap_s: float) -> dict:
        return {"policy": self.policy, "feasible": self.feasible, "finished": self.finished,
                "missed_deadline": self.missed, "cost_usd": round(self.cost_usd, 6),
                "finish_hours": None if self.finish_tick is None else round(self.finish_tick * gap_s / 3600, 4),
                "spot_hours": round(self.spot_ticks * gap_s / 3600, 4),
                "on_demand_hours": round(self.od_ticks * gap_s / 3600, 4),
                "changeovers": self.changeovers, **self.extra}


def run_deadline(setup: DeadlineSetup, policy: DeadlinePolicy, *, max_ticks: int | None = None,
                 enforce_safety: bool = True) -> DeadlineResult:
    """Replay one job under a policy; raises if an online policy breaks the safety rule
    (the offline optimum knows the future and is exempt: ``enforce_safety=False``)."""
    prod = setup.spot_productive()
    n = len(setup.avail)
    limit = max_ticks if max_ticks is not None else max(n, setup.deadline_ticks + setup.work_ticks + 2 * setup.changeover_ticks)
    mode, remaining, cost = Mode(), setup.work_ticks, 0.0
    res = DeadlineResult(policy=policy.name, feasible=setup.feasible, finished=False, missed=False,
                         cost_usd=0.0, finish_tick=None)
    acts: list[str] = []
    k = 0
    while remaining > 0 and k < limit:
        avail = setup.avail[k] if k < n else False
        safe = safe_actions(setup, k, remaining, avail, mode)
        action = policy.decide(Observation(k, remaining, avail, mode, safe, setup))
        if enforce_safety and action not in safe and setup.feasible:
            raise OrbitError(f"policy {policy.name} chose {action!r} at tick {k}, outside the safe set {sorted(safe)}",
                             field="action", value=action, fix="policies must pick from Observation.safe")
        if action == SPOT and not avail:
            raise OrbitError(f"policy {policy.name} chose spot where the trace has none (tick {k})",
                             field="action", value=action, fix="only choose spot when Observation.available")
        if action != NONE and mode.kind != action:
            res.changeovers += 1
        mode, progress, dollars = step(setup, k, mode, action, prod[k] if k < n else False)
        if action == SPOT and k + 1 < n and not setup.avail[k + 1]:
            mode = Mode(NONE, 0)  # reclaimed: the spot session is over
        remaining -= progress
        cost += dollars
        res.spot_ticks += action == SPOT
        res.od_ticks += action == OD
        acts.append(action)
        k += 1
    res.cost_usd = cost
    res.finished = remaining <= 0
    res.finish_tick = k if res.finished else None
    res.missed = not res.finished or k > setup.deadline_ticks
    res.actions = "".join(acts)
    return res


# ---------------------------------------------------------------- online baselines

@dataclass
class Greedy:
    """The strawman: spot whenever there is some, idle otherwise, on-demand only when the
    safety rule forces it (the last moment)."""

    name: str = "greedy"

    def decide(self, obs: Observation) -> str:
        if SPOT in obs.safe:
            return SPOT
        if NONE in obs.safe:
            return NONE
        return OD


@dataclass
class UniformProgress:
    """Can't Be Late's Uniform Progress: keep progress on the straight line from 0 to the
    job's work at the deadline; spot when available, on-demand when behind the line, with
    the paper's hysteresis (stay on on-demand until a changeover's worth ahead of the line)."""

    name: str = "uniform-progress"

    def decide(self, obs: Observation) -> str:
        s = obs.setup
        done = s.work_ticks - obs.remaining
        line = s.work_ticks * obs.k / max(s.deadline_ticks, 1)
        ahead = done - line
        c = s.changeover_ticks
        if obs.safe == {OD}:
            return OD
        on_od = obs.mode.kind == OD
        if obs.available:
            if on_od and ahead < c:
                return OD
            return SPOT
        if ahead < 0 or (on_od and ahead < c):
            return OD
        return NONE


def setup_from_ticks(avail: Sequence[bool], prices_usd_per_hour: Sequence[float], *, gap_s: float,
                     od_usd_per_hour: float, work_s: float, deadline_s: float, changeover_s: float,
                     loss_ticks: int, history: Sequence[bool] = ()) -> DeadlineSetup:
    """Convert seconds to ticks: work rounds up, the deadline rounds down, changeover rounds up."""
    if work_s <= 0 or deadline_s <= 0:
        raise OrbitError("job hours and deadline hours must be > 0", field="job_hours/deadline_hours",
                         value=(work_s / 3600, deadline_s / 3600), fix="pass positive hours")
    return DeadlineSetup(
        avail=tuple(bool(a) for a in avail),
        spot_cost=tuple(p * gap_s / 3600.0 for p in prices_usd_per_hour),
        od_cost=od_usd_per_hour * gap_s / 3600.0,
        work_ticks=math.ceil(work_s / gap_s - 1e-9),
        deadline_ticks=math.floor(deadline_s / gap_s + 1e-9),
        changeover_ticks=math.ceil(changeover_s / gap_s - 1e-9),
        loss_ticks=loss_ticks,
        gap_s=gap_s,
        history=tuple(bool(a) for a in history),
    )


#: Deadline decisions are taken on ticks of at least this length; finer traces (the 32 s
#: preemption traces) are coarsened, which keeps the DPs small and changes nothing that matters
#: for a decision between spot and on-demand.
MIN_DECISION_TICK_S = 180.0


def coarsen(values: Sequence[int], prices: Sequence[float], factor: int, nodes: int) -> tuple[list[bool], list[float]]:
    """Group ``factor`` ticks: available only if every fine tick is (an instance held through the
    whole coarse tick survives it), priced at the mean."""
    avail, cost = [], []
    for i in range(0, len(values) - factor + 1, factor):
        avail.append(all(v >= nodes for v in values[i:i + factor]))
        cost.append(sum(prices[i:i + factor]) / factor)
    return avail, cost


def setup_from_trace(trace, *, start_tick: int, work_s: float, deadline_s: float, changeover_s: float,
                     notice_s: float, save_s: float, emergency_save_s: float | None, mtbf_s: float,
                     spot_usd_per_hour: float, od_usd_per_hour: float, nodes: int = 1) -> DeadlineSetup:
    """The window of ``trace`` (a catalog.traces.Trace) that a job starting at ``start_tick``
    sees, replayed cyclically past the trace's end (from its first tick that holds the job:
    ``catalog.traces.cyclic_ticks``); ``history`` is the trace before the start.

    Prices are per instance; a job on ``nodes`` instances at once pays ``nodes`` times them
    (spot and on-demand alike) and has spot only where the trace holds at least ``nodes``."""
    factor = max(1, math.ceil(MIN_DECISION_TICK_S / trace.gap_seconds - 1e-9))
    gap = trace.gap_seconds * factor
    loss = loss_ticks_for(gap, notice_s=notice_s, save_s=save_s, emergency_save_s=emergency_save_s, mtbf_s=mtbf_s)
    n = len(trace.data)
    span = (math.floor(deadline_s / gap + 1e-9) + loss + 2) * factor
    ticks = cyclic_ticks(trace, start_tick, span, nodes)
    avail, prices = coarsen([trace.data[k] for k in ticks],
                            [trace.price_at(k, spot_usd_per_hour) * nodes for k in ticks], factor, nodes)
    first = start_tick % factor
    hist_ticks = range(first, min(start_tick, n))
    history, _ = coarsen([trace.data[k] for k in hist_ticks], [0.0] * len(hist_ticks), factor, nodes)
    return setup_from_ticks(avail, prices, gap_s=gap, od_usd_per_hour=od_usd_per_hour * nodes, work_s=work_s,
                            deadline_s=deadline_s, changeover_s=changeover_s, loss_ticks=loss, history=history)
