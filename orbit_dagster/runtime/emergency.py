"""Emergency saves sized to the notice: what to write before the reclaim's deadline, and why.

The checkpointer measures every save it lands (bytes and the seconds from the start of its
write to its manifest: serialise, hash, write; `SaveTimes`), so when a notice comes it knows
how long this state takes on this host and store. `choose` then picks what fits the time
left, in order of preference:
1. a delta against the last durable checkpoint, when one is kept and small (the usual rule);
2. the full state, if its estimate fits;
3. a delta of any size (more than the usual half of the bytes changed), if that fits where
   the full state does not;
4. the instance's own disk first (tier "local"), when the store is too slow for the notice
   but the local disk is fast enough (its own measured throughput, `local_times`): the same
   save, fsynced with its manifest on the local disk, then uploaded to the store in the time
   that is left. The checkpoint is registered only once the upload's manifest commits; until
   then the copy exists on that disk alone and goes with the instance (a spot instance's
   local disk does not outlive a reclaim unless the provider keeps the volume), so this
   plan buys a checkpoint only when the host outlives the estimate, which it often does;
5. nothing fits: the full state is written anyway (a host often outlives its notice; a
   checkpoint cut off has no manifest and is never registered, so a late one costs nothing
   but can save the work), and the plan says so beforehand: the agent emits it as a `notice`
   record (host contract) that the control plane stores, so the ledger knows the notice
   could not be met even if the host is gone before the checkpoint lands.

Every plan names its estimate, the time left and the measurement behind it. Stdlib only.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

ASSUMED_NOTICE_S = 30.0  # a SIGTERM carries no deadline: GCP's notice, the shortest a cloud gives
SAFETY = 0.8  # share of the time left a plan may use: estimates vary, and the event must be written too
MEASURED = 5  # the most recent saves the estimate uses


@dataclass(frozen=True)
class Plan:
    kind: str  # "full" | "delta"
    fits: bool
    estimate_s: float | None  # None: no save measured yet on this host
    time_left_s: float
    reason: str
    tier: str = "store"  # "store": straight to the checkpoint store; "local": the instance's disk first

    def fields(self) -> dict:
        """The plan as the host contract's optional checkpoint/notice fields (`plan_tier` only
        when local: a plan straight to the store stays a version-2 line older readers take)."""
        return {"plan": self.kind, "plan_fits": self.fits, "plan_reason": self.reason,
                "estimate_s": None if self.estimate_s is None else round(self.estimate_s, 3),
                "time_left_s": round(self.time_left_s, 3), **({"plan_tier": "local"} if self.tier == "local" else {})}


class SaveTimes:
    """Measured throughput of this host's saves to its store."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=MEASURED)

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._rates.append(nbytes / seconds)

    @property
    def rate(self) -> float | None:
        """Bytes per second: the median of the recent saves (one slow save is not the rule)."""
        return statistics.median(self._rates) if self._rates else None

    def estimate(self, nbytes: int) -> float | None:
        rate = self.rate
        return None if rate is None else nbytes / rate


def time_left(notice: dict | None, now: float | None = None) -> tuple[float, str]:
    """(seconds until the notice's deadline, where that figure comes from)."""
    now = time.time() if now is None else now
    notice = notice or {}
    if notice.get("deadline"):
        return max(0.0, float(notice["deadline"]) - now), "the notice's deadline"
    received = float(notice.get("received_at") or now)
    return (max(0.0, received + ASSUMED_NOTICE_S - now),
            f"no deadline given ({notice.get('source') or 'unknown'}): {ASSUMED_NOTICE_S:.0f} s assumed from its receipt")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def choose(*, full_bytes: int, delta_bytes: int | None, usual_delta: bool, times: SaveTimes, notice: dict | None,
           last_durable_step: int | None, now: float | None = None, local_times: SaveTimes | None = None) -> Plan:
    """The plan for an emergency save of a state of `full_bytes` whose delta against the kept
    base would be `delta_bytes` (None: no base kept); `usual_delta`: the delta passes the usual rule.
    `local_times`: the instance's own disk, measured (None: no local tier on this host)."""
    left, source = time_left(notice, now)
    budget = left * SAFETY
    rate = times.rate
    plan = _to_store(full_bytes, delta_bytes, usual_delta, rate, left, budget, source, last_durable_step)
    if plan.fits or local_times is None or local_times.rate is None or rate is None:
        return plan
    return _local_first(plan, full_bytes if plan.kind == "full" else delta_bytes, local_times.rate, rate, budget,
                        last_durable_step) or plan


def _local_first(store_plan: Plan, nbytes: int, local_rate: float, rate: float, budget: float,
                 last_durable_step: int | None) -> Plan | None:
    """The store's plan, written to the local disk first, when that fits the notice; else None."""
    est = nbytes / local_rate
    if est > budget:
        return None
    upload = nbytes / rate
    return Plan(store_plan.kind, True, est, store_plan.time_left_s,
                f"{store_plan.reason.split(': expected to miss')[0]}: the store does not fit the notice, the "
                f"instance's disk does ({_mb(nbytes)} at {local_rate / 1e6:.1f} MB/s measured there: estimated "
                f"{est:.1f} s); written there first, then uploaded (estimated {upload:.1f} s more) and registered "
                f"only when the upload's manifest commits; the local copy is lost with the instance, and if it goes "
                f"before the upload completes, {_stands(last_durable_step)}", tier="local")


def _to_store(full_bytes: int, delta_bytes: int | None, usual_delta: bool, rate: float | None, left: float,
              budget: float, source: str, last_durable_step: int | None) -> Plan:
    if rate is None:
        kind = "delta" if usual_delta else "full"
        return Plan(kind, True, None, left, f"no save measured on this host yet: a {kind} save of "
                                            f"{_mb(delta_bytes if usual_delta else full_bytes)}; {left:.1f} s left "
                                            f"({source})")
    measured = f"at {rate / 1e6:.1f} MB/s measured on this host"
    if usual_delta:
        est = delta_bytes / rate
        return Plan("delta", est <= budget, est, left, f"a delta of {_mb(delta_bytes)} against the last durable "
                    f"checkpoint: estimated {est:.1f} s {measured}, {left:.1f} s left ({source})"
                    + ("" if est <= budget else _missed(last_durable_step)))
    est = full_bytes / rate
    if est <= budget:
        return Plan("full", True, est, left, f"the full state, {_mb(full_bytes)}: estimated {est:.1f} s {measured}, "
                                             f"{left:.1f} s left ({source})")
    if delta_bytes is not None and delta_bytes / rate <= budget:
        d = delta_bytes / rate
        return Plan("delta", True, d, left, f"the full state ({_mb(full_bytes)}, estimated {est:.1f} s {measured}) "
                                            f"does not fit {left:.1f} s left ({source}); a delta of "
                                            f"{_mb(delta_bytes)} does: estimated {d:.1f} s")
    return Plan("full", False, est, left, f"the full state, {_mb(full_bytes)}: estimated {est:.1f} s {measured}, "
                                          f"{left:.1f} s left ({source})" + _missed(last_durable_step))


def _stands(last_durable_step: int | None) -> str:
    return (f"the last durable checkpoint (step {last_durable_step}) stands" if last_durable_step is not None
            else "no durable checkpoint stands (the attempt restarts)")


def _missed(last_durable_step: int | None) -> str:
    return (f": expected to miss the deadline; written anyway (a host often outlives its notice, and a "
            f"checkpoint cut off is never registered); if the host goes first, {_stands(last_durable_step)}")
