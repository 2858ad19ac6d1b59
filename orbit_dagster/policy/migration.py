"""Proactive migration: leave an offer whose risk keeps rising, make-before-break, within budget.

Rule (issue 5): migrate when the offer's risk rose three windows in a row, the remaining
work is long enough for the move to pay for itself, and the move fits the job's budget.
"Pays for itself" is computed, not a threshold: the expected cost to finish where we are
(remaining work / goodput x price, at the latest risk) against the cost of the move
(both instances paid while the replacement boots and the checkpoint is written) plus the
expected cost to finish on the target. The move itself is make-before-break:
provision the replacement, checkpoint, switch, release -- in that order, so a failure at
any step leaves the job running where it was.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from orbit_dagster.catalog.reclaim_model import ReclaimModel
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.offer_choice import expected_goodput
from orbit_dagster.policy.reclaim_rate import ReclaimRateEstimator

MAKE_BEFORE_BREAK = ("provision_replacement", "checkpoint", "switch", "release_old")
WINDOWS = 4  # three rises need four windows


@dataclass(frozen=True)
class MigrationDecision:
    migrate: bool
    reason: str
    steps: tuple[str, ...] = ()
    inputs: dict = field(default_factory=dict)

    def as_record(self) -> dict:
        return {"decision": "migration", "migrate": self.migrate, "reason": self.reason,
                "steps": list(self.steps), "inputs": dict(self.inputs)}


def risk_rising(history: Sequence[float], windows: int = 3) -> bool:
    """True when each of the last ``windows`` values is strictly above the one before it
    (three rises need four windows of history)."""
    if windows < 1:
        raise OrbitError("windows must be >= 1", field="windows", value=windows, fix="use 3 (the issue's rule)")
    if len(history) < windows + 1:
        return False
    tail = list(history)[-(windows + 1):]
    return all(b > a for a, b in zip(tail, tail[1:]))


def risk_history(offer: Offer, reclaim_times: Sequence[float], spans: Sequence[tuple[float, float | None]], *,
                 now: float, window_s: float, windows: int = WINDOWS, scale: float = 1.0,
                 model: ReclaimModel | None = None) -> list[float]:
    """The offer's estimated reclaim rate per hour at the end of each of the last ``windows``
    windows of ``window_s`` ending at ``now`` (oldest first): its prior, updated with the
    reclaims at ``reclaim_times`` and the up-time of ``spans`` ((start, stop), stop None: still
    up) up to each window's end. ``scale``: market seconds per second of these times (a
    compressed market). Both drivers compute the risk here: the price sensor from the
    ledger's instances (`control.migration`), the offers replay from the traces' records."""
    out = []
    for k in range(windows):
        end = now - (windows - 1 - k) * window_s
        exposure = sum(max(0.0, min(stop if stop is not None else end, end) - start) for start, stop in spans
                       if start <= end)
        est = ReclaimRateEstimator.for_offer(offer, model)
        est.observe(sum(1 for t in reclaim_times if t <= end), exposure * scale)
        out.append(est.rate_per_hour)
    return out


def decide_move(history: Sequence[float], *, current: Offer, ranked: Sequence[Offer], remaining_work_s: float,
                save_s: float, restore_s: float, notice_s: float,
                model: ReclaimModel | None = None) -> tuple[Offer, MigrationDecision] | None:
    """The question both drivers ask at a decision tick while a job runs on ``current`` spot:
    None when its risk has not risen ``WINDOWS - 1`` windows in a row or no other offer is
    ranked; else the target (the best-ranked other offer, known by its prior rate: nothing
    of it is observed until the job is there) and `should_migrate`'s decision."""
    if not risk_rising(history, WINDOWS - 1):
        return None
    target = next((o for o in ranked if o.offer_id != current.offer_id), None)
    if target is None:
        return None
    decision = should_migrate(history, remaining_work_s=remaining_work_s, current=current, target=target,
                              target_rate_per_hour=ReclaimRateEstimator.for_offer(target, model).rate_per_hour,
                              save_s=save_s, restore_s=restore_s, notice_s=notice_s, windows=WINDOWS - 1)
    return target, decision


def rebalance_rate(offer: Offer, reclaim_times: Sequence[float], spans: Sequence[tuple[float, float | None]], *,
                   now: float, scale: float = 1.0, model: ReclaimModel | None = None) -> float:
    """The offer's reclaim rate per hour once AWS recommends rebalancing off it: its estimate
    now (as `risk_history` computes it) with the recommendation counted as one more reclaim
    observed now. AWS gives no rate with it, only "elevated risk"; one reclaim's worth of
    evidence is the smallest honest reading, and it weighs more the less the offer has been
    watched."""
    return risk_history(offer, [*reclaim_times, now], spans, now=now, window_s=1.0, windows=1, scale=scale,
                        model=model)[-1]


def decide_on_rebalance(rate_per_hour: float, *, current: Offer, ranked: Sequence[Offer], remaining_work_s: float,
                        save_s: float, restore_s: float, notice_s: float,
                        model: ReclaimModel | None = None) -> tuple[Offer, MigrationDecision] | None:
    """`checkpoint.on_rebalance: migrate`: the question asked when the job's host reports a
    rebalance recommendation. None when no other offer is ranked; else the target (as in
    `decide_move`) and `should_migrate`'s decision with the recommendation as the trigger in
    place of three rising windows: the same costs, so the move is made only when the work left
    is long enough for it to pay for itself."""
    target = next((o for o in ranked if o.offer_id != current.offer_id), None)
    if target is None:
        return None
    decision = should_migrate([rate_per_hour], remaining_work_s=remaining_work_s, current=current, target=target,
                              target_rate_per_hour=ReclaimRateEstimator.for_offer(target, model).rate_per_hour,
                              save_s=save_s, restore_s=restore_s, notice_s=notice_s, trigger="rebalance")
    return target, decision


def finish_cost(remaining_work_s: float, usd_per_s: float, rate_per_hour: float, *, save_s: float,
                restore_s: float, notice_s: float) -> tuple[float, float]:
    """(expected $ to finish, goodput) for ``remaining_work_s`` on an instance at that price and risk."""
    goodput, _ = expected_goodput(rate_per_hour, save_s=save_s, restore_s=restore_s, notice_s=notice_s)
    if goodput <= 0:
        return math.inf, 0.0
    return remaining_work_s / goodput * usd_per_s, goodput


def should_migrate(risk_history: Sequence[float], *, remaining_work_s: float, current: Offer, target: Offer,
                   target_rate_per_hour: float, save_s: float = 60.0, restore_s: float = 300.0,
                   notice_s: float = 120.0, budget_left_usd: float | None = None,
                   windows: int = 3, trigger: Literal["risk", "rebalance"] = "risk") -> MigrationDecision:
    """Decide whether to move from ``current`` to ``target`` now.

    ``risk_history`` is the current offer's reclaim rate per hour, one value per window
    (oldest first), e.g. from the price/availability feed's estimator. ``trigger``: `risk`,
    the rate must have risen ``windows`` windows in a row; `rebalance`, the host reported AWS's
    rebalance recommendation, which is the trigger itself (the last value: `rebalance_rate`).
    """
    if trigger not in ("risk", "rebalance"):
        raise OrbitError(f"trigger {trigger!r} is not a migration trigger", field="trigger", value=trigger,
                         fix="use risk or rebalance")
    if remaining_work_s < 0:
        raise OrbitError("remaining_work_s must be >= 0", field="remaining_work_s", value=remaining_work_s,
                         fix="pass the seconds of work left")
    if any((not isinstance(r, (int, float))) or math.isnan(r) or r < 0 for r in risk_history):
        raise OrbitError("risk values must be numbers >= 0", field="risk_history", value=list(risk_history),
                         fix="pass reclaim rates per hour, oldest first")
    cur_rate = float(risk_history[-1]) if risk_history else 0.0
    inputs = {"risk_history": [float(r) for r in risk_history], "remaining_work_s": remaining_work_s,
              "current": current.offer_id, "target": target.offer_id, "target_rate_per_hour": target_rate_per_hour,
              "save_s": save_s, "restore_s": restore_s, "notice_s": notice_s, "budget_left_usd": budget_left_usd,
              "trigger": trigger}
    if trigger == "risk" and not risk_rising(risk_history, windows):
        return MigrationDecision(False, f"risk has not risen {windows} windows in a row", inputs=inputs)
    kw = dict(save_s=save_s, restore_s=restore_s, notice_s=notice_s)
    stay, g_stay = finish_cost(remaining_work_s, current.usd_per_second, cur_rate, **kw)
    go, g_go = finish_cost(remaining_work_s, target.usd_per_second, target_rate_per_hour, **kw)
    # make-before-break: the old instance keeps running (and paying) while the new one
    # boots and restores, and while the checkpoint that the new one restores is written
    move = (restore_s + save_s) * current.usd_per_second + restore_s * target.usd_per_second
    inputs.update({"stay_usd": _r(stay), "move_usd": _r(move), "finish_on_target_usd": _r(go),
                   "goodput_stay": round(g_stay, 6), "goodput_target": round(g_go, 6)})
    if not go + move < stay:
        return MigrationDecision(False, "remaining work too short for the move to pay for itself", inputs=inputs)
    if budget_left_usd is not None and go + move > budget_left_usd:
        return MigrationDecision(False, "the move does not fit the job's remaining budget", inputs=inputs)
    why = ("AWS recommends rebalancing off the instance" if trigger == "rebalance"
           else f"risk rose {windows} windows in a row")
    return MigrationDecision(True, f"{why} and moving saves {stay - go - move:.2f} USD in expectation",
                             MAKE_BEFORE_BREAK, inputs)


def _r(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 6)
