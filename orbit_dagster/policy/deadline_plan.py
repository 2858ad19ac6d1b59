"""Planning by dynamic programming over the deadline tick model.

- ``optimal``: the offline optimum. It knows the whole trace, so its DP is deterministic;
  its cost is the floor every online policy is measured against ("gap to optimal").
- ``OrbitDeadline``: orbit's online policy. Same DP, but over a two-state Markov model of
  spot availability whose per-tick switch probabilities are estimated online (Beta
  posteriors: prior from the fitted ReclaimModel, evidence from the availability the
  control plane's feed has seen, before and during the job). It minimises *expected*
  cost and is restricted to the shared safety rule, so it never misses a feasible
  deadline. It re-plans every ``replan_s`` of job time as its estimates move.

Both share the state space: (remaining work w, the instance held m), m in
{none, spot owing j changeover ticks, on-demand owing j}, j = 0..changeover.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.policy.deadline import (
    MIN_DECISION_TICK_S,
    NONE,
    OD,
    SPOT,
    DeadlineResult,
    DeadlineSetup,
    Mode,
    Observation,
    loss_ticks_for,
    run_deadline,
    safe_actions,
)

BIG = 1e12  # "deadline missed": large but finite so that 0 * BIG stays 0
ACTIONS = (NONE, SPOT, OD)


class _Modes:
    """Index of each mode: 0 = none, 1..c+1 = spot owing j, c+2..2c+2 = on-demand owing j."""

    def __init__(self, c: int):
        self.c = c
        self.count = 2 * c + 3

    def index(self, kind: str, owed: int) -> int:
        if kind == NONE:
            return 0
        return (1 if kind == SPOT else self.c + 2) + owed

    def kind_owed(self, m: int) -> tuple[str, int]:
        if m == 0:
            return NONE, 0
        if m <= self.c + 1:
            return SPOT, m - 1
        return OD, m - self.c - 2

    def after(self, m_prev: int, action: str) -> tuple[int, bool]:
        """(next mode index if the session continues, does this tick make progress)."""
        kind, owed = self.kind_owed(m_prev)
        now = owed if kind == action else self.c
        return self.index(action, max(now - 1, 0)), now == 0


def _shift(v: np.ndarray) -> np.ndarray:
    """v[w - 1] for w >= 1 (one tick of progress); w = 0 stays done."""
    out = v.copy()
    out[1:] = v[:-1]
    return out


# ---------------------------------------------------------------- offline optimum

def optimal(setup: DeadlineSetup) -> DeadlineResult:
    """Minimum cost over every action sequence, knowing the trace (backward induction)."""
    modes = _Modes(setup.changeover_ticks)
    W, D, M = setup.work_ticks, setup.deadline_ticks, modes.count
    prod = setup.spot_productive()
    n = len(setup.avail)
    nm_s, ok_s = (np.array(x) for x in zip(*(modes.after(m, SPOT) for m in range(M))))
    nm_o, ok_o = (np.array(x) for x in zip(*(modes.after(m, OD) for m in range(M))))
    v_next = np.full((W + 1, M), BIG)
    v_next[0, :] = 0.0
    choice = np.zeros((D, W + 1, M), dtype=np.int8)
    for k in range(D - 1, -1, -1):
        avail = k < n and setup.avail[k]
        avail_next = k + 1 >= n or setup.avail[k + 1]
        q_none = np.broadcast_to(v_next[:, 0:1], (W + 1, M))
        if avail:
            target = v_next[:, nm_s] if avail_next else np.broadcast_to(v_next[:, 0:1], (W + 1, M))
            q_spot = setup.spot_cost[k] + (np.where(ok_s, _shift(target), target) if prod[k] else target)
        else:
            q_spot = np.full((W + 1, M), BIG)
        target = v_next[:, nm_o]
        q_od = setup.od_cost + np.where(ok_o, _shift(target), target)
        q = np.stack([q_none, q_spot, q_od])
        arg = np.argmin(q, axis=0)
        v = np.take_along_axis(q, arg[None], axis=0)[0]
        v[0, :] = 0.0
        choice[k] = arg
        v_next = v
    if v_next[W, 0] >= BIG / 2:
        res = run_deadline(setup, _AlwaysOD(), enforce_safety=False)
        res.policy = "optimal"
        res.extra["note"] = "infeasible: no schedule meets the deadline; on-demand throughout"
        return res
    res = run_deadline(setup, _Table(choice, modes), enforce_safety=False)
    res.extra["dp_cost_usd"] = round(float(v_next[W, 0]), 6)
    return res


@dataclass
class _AlwaysOD:
    name: str = "optimal"

    def decide(self, obs: Observation) -> str:
        return OD


@dataclass
class _Table:
    choice: np.ndarray
    modes: _Modes
    name: str = "optimal"

    def decide(self, obs: Observation) -> str:
        if obs.k >= self.choice.shape[0]:
            return OD
        m = self.modes.index(obs.mode.kind, obs.mode.owed)
        return ACTIONS[int(self.choice[obs.k, obs.remaining, m])]


# ---------------------------------------------------------------- orbit: online, expected cost

@dataclass
class MarkovAvailability:
    """Beta posteriors of the per-tick probabilities that spot vanishes (q10) / returns (q01)."""

    q10_prior: float
    q01_prior: float
    strength10: float
    strength01: float
    n1: int = 0
    n10: int = 0
    n0: int = 0
    n01: int = 0

    @classmethod
    def from_model(cls, model: ReclaimModel, gap_s: float) -> "MarkovAvailability":
        q10 = 1.0 - math.exp(-gap_s / model.prior_up_mean_s)
        q01 = 1.0 - math.exp(-gap_s / model.prior_down_mean_s)
        # prior weights: the zone-rate Gamma's shape, and 1/sigma^2 of the log down-time spread
        return cls(q10, q01, model.zone_rate_alpha, 1.0 / max(model.zone_down_log_sigma, 0.1) ** 2)

    @classmethod
    def from_exposure(cls, model: ReclaimModel, gap_s: float, *, reclaims: int, exposure_s: float
                      ) -> "MarkovAvailability":
        """The prior updated with what a fleet's record of instances shows: ``exposure_s`` of
        up-time (one up tick per ``gap_s``) and ``reclaims`` up -> down switches in it. The
        control plane's deadline decisions are fed this (control/deadline.py), from the same
        reclaims and exposure as the offer's rate; down-time is not in that record, so the
        return probability stays the prior's."""
        est = cls.from_model(model, gap_s)
        up_ticks = int(max(exposure_s, 0.0) // gap_s)
        est.n1, est.n10 = max(up_ticks, reclaims), reclaims
        return est

    def observe(self, seq: tuple[bool, ...] | list[bool]) -> None:
        for a, b in zip(seq, seq[1:]):
            if a:
                self.n1 += 1
                self.n10 += not b
            else:
                self.n0 += 1
                self.n01 += bool(b)

    @property
    def q10(self) -> float:
        return (self.strength10 + self.n10) / (self.strength10 / self.q10_prior + self.n1)

    @property
    def q01(self) -> float:
        return (self.strength01 + self.n01) / (self.strength01 / self.q01_prior + self.n0)


@dataclass
class OrbitDeadline:
    """orbit's deadline policy: expected-cost DP over the online Markov estimate, safe actions only."""

    model: ReclaimModel
    replan_s: float = 6 * 3600.0
    replan_change: float = 0.1
    name: str = "orbit"
    _planned_with: tuple[float, float] = (1.0, 1.0)
    _plan: np.ndarray | None = field(default=None, repr=False)
    _plan_k0: int = 0
    _modes: _Modes | None = None
    _est: MarkovAvailability | None = None
    _seen_to: int = 0

    def decide(self, obs: Observation) -> str:
        s = obs.setup
        if self._est is None:
            self._est = MarkovAvailability.from_model(self.model, s.gap_s)
            self._est.observe(list(s.history) + [s.avail[0]] if s.history else [s.avail[0]])
            self._seen_to = 0
        if obs.k > self._seen_to:
            self._est.observe(s.avail[self._seen_to: obs.k + 1])
            self._seen_to = obs.k
        replan_ticks = max(1, int(self.replan_s / s.gap_s))
        if self._plan is None or (obs.k - self._plan_k0 >= replan_ticks and self._moved()):
            self._replan(s, obs.k)
        if obs.safe == {OD}:
            return OD
        assert self._plan is not None and self._modes is not None
        a = 1 if obs.available else 0
        m = self._modes.index(obs.mode.kind, obs.mode.owed)
        action = ACTIONS[int(self._plan[obs.k - self._plan_k0, obs.remaining, a, m])]
        return action if action in obs.safe else OD

    def _moved(self) -> bool:
        """Re-plan only when an estimate moved by more than ``replan_change`` (relative)."""
        assert self._est is not None
        q10, q01 = self._planned_with
        return (abs(self._est.q10 / q10 - 1) > self.replan_change
                or abs(self._est.q01 / q01 - 1) > self.replan_change)

    def _replan(self, s: DeadlineSetup, k0: int) -> None:
        assert self._est is not None
        self._planned_with = (self._est.q10, self._est.q01)
        self._modes = modes = _Modes(s.changeover_ticks)
        self._plan = _markov_plan(s, k0, self._est.q10, self._est.q01, s.spot_cost[min(k0, len(s.spot_cost) - 1)], modes)
        self._plan_k0 = k0


def _markov_plan(s: DeadlineSetup, k0: int, q10: float, q01: float, spot_cost: float, modes: _Modes,
                 first_q: dict | None = None) -> np.ndarray:
    """Policy table [k - k0, w, a, m] -> action index, by backward induction from the deadline.

    ``first_q``, when given, receives the expected cost of each action at ``k0`` (arrays over w, a, m)."""
    W, D, M = s.work_ticks, s.deadline_ticks, modes.count
    c, r = s.changeover_ticks, s.loss_ticks
    keep = (1.0 - q10) ** max(r - 1, 0)  # chance that no reclaim hits the rest of the loss window
    # P(a' = 1 | a) and P(a' = 0 | a), for a = 0, 1, shaped to broadcast over (w, a, m)
    p1 = np.array([q01, 1.0 - q10]).reshape(1, 2, 1)
    p0 = 1.0 - p1
    nm_s, ok_s = zip(*(modes.after(m, SPOT) for m in range(M)))
    nm_o, ok_o = zip(*(modes.after(m, OD) for m in range(M)))
    nm_s, nm_o = np.array(nm_s), np.array(nm_o)
    ok_s, ok_o = np.array(ok_s).reshape(1, M), np.array(ok_o).reshape(1, 1, M)
    v_next = np.full((W + 1, 2, M), BIG)
    v_next[0] = 0.0
    horizon = max(D - k0, 1)
    table = np.full((horizon, W + 1, 2, M), 2, dtype=np.int8)
    slack = (np.arange(W + 1) + c + 1).reshape(W + 1, 1, 1)
    for k in range(D - 1, k0 - 1, -1):
        slack_ok = (k + slack) <= D  # the safety rule: may idle or take spot
        idle = p1 * v_next[:, 1:2, 0:1] + p0 * v_next[:, 0:1, 0:1]  # (w, a, 1)
        q_none = np.where(slack_ok, np.broadcast_to(idle, (W + 1, 2, M)), BIG)
        cont = v_next[:, 1, nm_s]  # spot continues where a' = 1: (w, m)
        gain = np.where(ok_s, keep * _shift(cont) + (1 - keep) * cont, cont)
        q_spot = spot_cost + (1.0 - q10) * gain + q10 * v_next[:, 0, 0:1]
        q_spot = np.where(slack_ok[:, 0, :], q_spot, BIG)
        nxt = p1 * v_next[:, 1:2, nm_o] + p0 * v_next[:, 0:1, nm_o]  # (w, a, m)
        q_od = s.od_cost + np.where(ok_o, _shift(nxt), nxt)
        q_s = np.empty_like(q_none)
        q_s[:, 0, :] = BIG  # no spot where the trace has none
        q_s[:, 1, :] = q_spot
        ns = np.minimum(q_none, q_s)
        v = np.minimum(ns, q_od)
        table[k - k0] = np.where(q_od < ns, 2, np.where(q_s < q_none, 1, 0))
        if k == k0 and first_q is not None:
            first_q.update({NONE: q_none, SPOT: q_s, OD: q_od})
        v[0] = 0.0
        v_next = v
    return table


# ---------------------------------------------------------------- the control plane's door

ACTION_NAMES = {NONE: "wait", SPOT: "spot", OD: "on_demand"}


@dataclass(frozen=True)
class SpotDecision:
    """What to hold for the next tick, why, and every input (for the ledger's decision row)."""

    action: str  # "spot" | "on_demand" | "wait"
    reason: str
    inputs: dict


def spot_or_on_demand(*, work_left_s: float, time_left_s: float, spot_available: bool, holding: str = "none",
                      changeover_left_s: float = 0.0, spot_usd_per_hour: float, on_demand_usd_per_hour: float,
                      restore_s: float, save_s: float, notice_s: float, mtbf_s: float,
                      availability: MarkovAvailability | None = None, model: ReclaimModel | None = None,
                      tick_s: float = MIN_DECISION_TICK_S) -> SpotDecision:
    """orbit's deadline policy for one decision now: the same DP and safety rule ``orbit simulate`` replays.

    ``holding``: "spot", "on_demand" or "none" (what the job runs on now; ``changeover_left_s``
    of its restore still to go). ``availability``: the Markov estimate the control plane keeps
    up to date from its feed (``MarkovAvailability.observe``); without one, the model's prior.
    Prices are for everything the job holds (all nodes). A deadline that on-demand can no
    longer meet gets on-demand: it finishes soonest.
    """
    for name, v in (("work_left_s", work_left_s), ("time_left_s", time_left_s), ("restore_s", restore_s),
                    ("save_s", save_s), ("notice_s", notice_s), ("changeover_left_s", changeover_left_s)):
        if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
            raise OrbitError(f"{name} must be >= 0", field=name, value=v, fix="pass seconds")
    kinds = {"spot": SPOT, "on_demand": OD, "none": NONE}
    if holding not in kinds:
        raise OrbitError(f"unknown holding {holding!r}", field="holding", value=holding, fix="spot, on_demand or none")
    gap = float(tick_s)
    loss = loss_ticks_for(gap, notice_s=notice_s, save_s=save_s, emergency_save_s=None, mtbf_s=mtbf_s)
    setup = DeadlineSetup(avail=(bool(spot_available),), spot_cost=(spot_usd_per_hour * gap / 3600.0,),
                          od_cost=on_demand_usd_per_hour * gap / 3600.0, work_ticks=math.ceil(work_left_s / gap - 1e-9),
                          deadline_ticks=math.floor(time_left_s / gap + 1e-9),
                          changeover_ticks=math.ceil(restore_s / gap - 1e-9), loss_ticks=loss, gap_s=gap)
    c = setup.changeover_ticks
    mode = Mode(kinds[holding], min(math.ceil(changeover_left_s / gap - 1e-9), c) if holding != "none" else 0)
    inputs = {"work_left_s": work_left_s, "time_left_s": time_left_s, "spot_available": bool(spot_available),
              "holding": holding, "spot_usd_per_hour": spot_usd_per_hour,
              "on_demand_usd_per_hour": on_demand_usd_per_hour, "restore_s": restore_s, "save_s": save_s,
              "notice_s": notice_s, "mtbf_s": mtbf_s, "tick_s": gap, "loss_ticks": loss}
    if setup.work_ticks == 0:
        return SpotDecision("wait", "no work left", inputs)
    if not setup.feasible or mode.kind == OD and setup.work_ticks + mode.owed > setup.deadline_ticks:
        return SpotDecision("on_demand", "on-demand can no longer meet the deadline: finishing as early as possible",
                            inputs)
    safe = safe_actions(setup, 0, setup.work_ticks, bool(spot_available), mode)
    est = availability or MarkovAvailability.from_model(model or load_reclaim_model(), gap)
    modes = _Modes(c)
    q: dict = {}
    table = _markov_plan(setup, 0, est.q10, est.q01, setup.spot_cost[0], modes, first_q=q)
    a, m = (1 if spot_available else 0), modes.index(mode.kind, mode.owed)
    action = ACTIONS[int(table[0, setup.work_ticks, a, m])]
    costs = {ACTION_NAMES[k]: (None if v[setup.work_ticks, a, m] >= BIG / 2 else round(float(v[setup.work_ticks, a, m]), 4))
             for k, v in q.items()}
    inputs.update({"q_spot_lost_per_tick": round(est.q10, 6), "q_spot_back_per_tick": round(est.q01, 6),
                   "expected_cost_usd": costs, "safe": sorted(ACTION_NAMES[x] for x in safe)})
    if action not in safe:
        action = OD
    slack_h = (setup.deadline_ticks - setup.work_ticks - c) * gap / 3600
    if safe == frozenset({OD}):
        why = "the safety rule: any later start of on-demand would miss the deadline"
    else:
        why = (f"lowest expected cost to finish ({costs[ACTION_NAMES[action]]} $) with {slack_h:.2f} h of slack; "
               + ", ".join(f"{k} {v} $" for k, v in costs.items() if k != ACTION_NAMES[action] and v is not None))
    return SpotDecision(ACTION_NAMES[action], why, inputs)
