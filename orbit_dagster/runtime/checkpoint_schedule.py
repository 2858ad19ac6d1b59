"""When the agent takes its next durable checkpoint: the interval re-decided on the host as the instance ages.

Dispatch decides the first interval (control/dispatch.py `checkpoint_plan`, the instance's
age 0) and gives the agent the plan behind it: the interval rule (`core.interval.IntervalRule`,
what `OrbitInterval` answers until it learns something new), the measured step time, the
template's cadence, the steps of the job and when the instance came up. The first save of an
attempt comes at the next multiple of that interval (a resumed attempt saves on the same grid
as an uninterrupted one). Each durable save after it asks the rule again, here, for the
instance's age then and the work left (in steps through the ledger's measured step time, or
this attempt's own when the template has none yet), and the next save comes that many steps
later: young
instances are reclaimed most, so the interval lengthens as the instance survives, as in
`orbit simulate` (policy/simulate.py), which asks the same rule after every save. Each answer
is an `interval` record in the event stream; the control plane keeps it as a
`checkpoint_interval` decision (one per durable checkpoint, with the age it was made at).

A command workload (runtime/command.py) gets the same schedule: the agent asks the rule each
time it registers a durable checkpoint the script wrote, and publishes the next save step in
a file (ORBIT_CHECKPOINT_SCHEDULE) that the framework callbacks read at each step
(`integrations.env.checkpoint_due`, which any script may call); a script that reads only
ORBIT_CHECKPOINT_EVERY keeps the launch interval.

Why on the host: the answer is needed at a step boundary, when the control plane may be
unreachable or restarting; the inputs do not change during an attempt (the control plane
learns from an instance only once it is gone). Times are market seconds: the sim market
replays its traces `time_scale` times faster than the wall clock.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from ..core.errors import OrbitError
from ..core.host_contract import Interval
from ..core.interval import IntervalRule

PLAN_FIELDS = ("policy", "rule", "cadence_steps", "steps", "step_s", "time_scale", "instance_started_at")


class CheckpointSchedule:
    """Which steps take a durable checkpoint; `after_save` re-decides the interval."""

    def __init__(self, every: int, plan: dict | None = None, *, clock: Callable[[], float] = time.time):
        self.every = max(1, int(every))
        self.next_step: int | None = None  # None: the launch interval's grid (multiples of `every`)
        self.clock = clock
        self.plan = plan
        self.rule: IntervalRule | None = None
        self._first: tuple[float, int] | None = None  # (time, step) of the first step boundary seen
        if plan is not None:
            unknown = set(plan) - set(PLAN_FIELDS)
            if unknown:
                raise OrbitError(f"unknown interval plan field(s) {sorted(unknown)}", field="interval_plan",
                                 value=sorted(unknown), fix=f"use only {', '.join(PLAN_FIELDS)}")
            if plan.get("rule") is not None:
                self.rule = IntervalRule.from_record(plan["rule"])

    def saw_step(self, step: int) -> None:
        if self._first is None:  # the attempt's first step boundary: where its own step time is measured from
            self._first = (self.clock(), step)

    def due(self, step: int) -> bool:
        self.saw_step(step)
        return step % self.every == 0 if self.next_step is None else step >= self.next_step

    def publish(self, path: Path) -> None:
        """The schedule for a command workload's callbacks (`integrations.env.checkpoint_due`):
        written whole under a temporary name and renamed, so a reader never sees half of it."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"every": self.every, "next_step": self.next_step}), encoding="utf-8")
        os.replace(tmp, path)

    def _step_s(self, step: int, scale: float) -> float | None:
        """The plan's step time (the ledger's measure), else this attempt's own so far."""
        given = (self.plan or {}).get("step_s")
        if given:
            return float(given)
        if self._first is None or step <= self._first[1]:
            return None
        return (self.clock() - self._first[0]) / (step - self._first[1]) * scale or None

    def after_save(self, step: int) -> Interval | None:
        """The next interval, decided at `step` (where a durable save was just taken); None
        without a plan (a run launched by hand) or when the job has no step left."""
        plan = self.plan
        if plan is None:
            return None
        steps = plan.get("steps")
        if steps and step >= int(steps):
            return None
        scale = float(plan.get("time_scale") or 1.0)
        age_s = max((self.clock() - float(plan.get("instance_started_at") or self.clock())) * scale, 0.0)
        step_s = self._step_s(step, scale)
        work_left_s = (int(steps) - step) * step_s if steps and step_s else math.inf
        cadence = int(plan.get("cadence_steps") or self.every)
        interval_s, policy_steps = None, None
        if self.rule is not None and step_s:
            interval_s = self.rule.interval(age_s, work_left_s)
            if math.isfinite(interval_s):
                policy_steps = max(1, int(round(interval_s / step_s)))
        n = min(cadence, policy_steps) if policy_steps else (cadence if self.rule is not None else self.every)
        self.every, self.next_step = n, step + n
        if self.rule is None:
            reason = f"{plan.get('policy', 'fixed')}: the launch's interval, not age-dependent"
        elif policy_steps is None or policy_steps >= cadence:
            reason = f"the template's cadence ({cadence} steps); the policy asks for {policy_steps or 'none'}"
        else:
            reason = f"the policy's interval at age {age_s / 3600:.2f} h: {interval_s:.0f} s of work"
        return Interval(step=step, next_step=step + n, steps=n, age_s=round(age_s, 3),
                        interval_s=None if interval_s is None or math.isinf(interval_s) else round(interval_s, 3),
                        policy_steps=policy_steps, cadence_steps=cadence,
                        work_left_s=None if math.isinf(work_left_s) else round(work_left_s, 3),
                        step_s=round(step_s, 6) if step_s else None,
                        policy=str(plan.get("policy") or "fixed"), reason=reason)
