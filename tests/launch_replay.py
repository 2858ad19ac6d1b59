"""The control plane's protocol replayed on a trace: the decisions dispatch, the agent and the
price sensor make, at the moments they make them.

``simulate.replay`` (behind ``orbit simulate``) is the benchmark's model: the interval is
re-decided after every save from the instance's age, an emergency checkpoint starts at the
last moment the notice allows, saves stop the work. The control plane decides differently,
and this replay follows it, so that the two drivers can be compared decision by decision
(``tests/integration/test_policy_replay.py``; docs/policies.md, "One policy, two drivers"):

- **at each dispatch** it asks ``spot_or_on_demand`` (with a deadline) and ``OrbitInterval``
  at the instance's age 0, for the work left from the newest checkpoint as the control
  plane believes it (its measured step and save times: ``Launch.step_s``, ``Launch.save_s``);
  the interval becomes whole steps and the agent's first save is at the next multiple of it
  (absolute step numbers, so a resumed attempt saves on the grid an uninterrupted one would);
- **at each durable save** (asynchronous: the work goes on) the agent asks the policy's rule
  (``OrbitInterval.rule``, given at dispatch) again for the instance's age then and the work
  left, and saves next that many steps later (runtime/checkpoint_schedule.py). The age is
  the step's time on the trace clock less the instance's start; ``Launch.decision_ages``
  gives the ages the real agent measured instead (where a step boundary falls is the host's
  scheduling, not a decision);
- **the agent** saves an emergency checkpoint at the first step after it sees the notice
  and stops; a notice that comes before the workload started leaves nothing to save; an
  emergency save that is not durable by the reclaim (``Launch.emergency_durable``: measured,
  or modelled from the save time) saves nothing, and the ledger then knows of the notice only
  from its event (``Launch.notice_recorded``);
- **every decision tick** on spot (the price sensor) it asks ``spot_or_on_demand`` again
  (its availability estimate updated with the same reclaims and up-time as the rate),
  holding spot, for the work done so far; "on_demand" moves the job make-before-break: the
  replacement is provisioned, the old host saves an emergency checkpoint and stops, and
  the next attempt resumes from it on demand (never reclaimed);
- what it learns is what the ledger records: per spot instance its up-time (start to
  release) and whether it was reclaimed; per reclaim whether a notice came.

Platform timings are inputs, not decisions (``Launch``: when each instance came up, when
its first step began, when its agent saw the notice, whether its emergency save was durable
before the reclaim), measured from a real run or chosen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from orbit_dagster.catalog.reclaim_model import ReclaimModel, load_reclaim_model
from orbit_dagster.catalog.traces import Trace, next_available, reclaim_offsets
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.interval import IntervalRule
from orbit_dagster.core.offers import Offer, on_demand
from orbit_dagster.policy.checkpointing import OrbitInterval
from orbit_dagster.policy.deadline import MIN_DECISION_TICK_S
from orbit_dagster.policy.deadline_plan import MarkovAvailability, spot_or_on_demand
from orbit_dagster.policy.offer_choice import RESTORE_PRIOR_S  # the control plane's: it measures none
from orbit_dagster.policy.reclaim_rate import NoticeReliability, RateBook


@dataclass(frozen=True)
class Launch:
    """One attempt's platform timings on the trace clock, and the control plane's beliefs then."""

    dispatch_at: float  # dispatch asks the policies
    instance_at: float  # the instance is up (a spot one on the trace's capacity)
    work_at: float | None  # its first step begins (None: stopped before any work)
    save_s: float  # the save time the control plane believes (market seconds)
    step_s: float  # the step time it believes (market seconds)
    spot: bool = True
    notice_seen_at: float | None = None  # the agent saw the notice (None: when it was given)
    released_at: float | None = None  # the instance was released (None: as soon as it stopped working)
    # The step at which the agent stopped for its emergency checkpoint (None: the first step after
    # it was told). Which step boundary a notice lands on is the host's scheduling, not a decision.
    stopped_step: int | None = None
    # The instance's age (market seconds) at which the agent re-decided the interval, by the
    # step it decided at (None: the step's modelled time on the trace clock).
    decision_ages: dict[int, float] | None = None
    # Whether the emergency checkpoint the agent began at a reclaim's notice (or at a move's
    # SIGTERM) became durable: the ledger has it. None: modelled: at a reclaim it takes `save_s`
    # from the step the agent stopped at and counts only if durable by the reclaim; at a move it
    # counts. How long a save takes on the host is the host's speed, not a decision: a loaded
    # machine that finishes one too late loses the work since the newest durable checkpoint,
    # and the control plane counts the notice as missed.
    emergency_durable: bool | None = None
    # Whether a notice event reached the ledger before the host's disk was wiped (None: yes,
    # when the notice came at all). With no emergency checkpoint either, the ledger counts
    # the reclaim as one without a notice (control.dispatch.fleet_notices), as the replay does.
    notice_recorded: bool | None = None


@dataclass(frozen=True)
class Move:
    """Timings of a make-before-break move, in seconds after the decision tick."""

    emergency_after_s: float  # the old host's emergency checkpoint is taken
    instance_after_s: float  # the replacement is up
    work_after_s: float  # the next attempt's first step begins
    dispatch_after_s: float | None = None  # the next attempt is dispatched (after the old one ended)


@dataclass(frozen=True)
class Tick:
    """One of the price sensor's decision ticks, and what the control plane knew then."""

    at: float  # trace time
    known_step: int | None  # the step the ledger showed for the running attempt (None: none yet)
    step_s: float  # the step time it believed then (market seconds)
    save_s: float  # the save time it believed then


@dataclass(frozen=True)
class ControlJob:
    steps: int
    step_s: float  # market seconds a step really takes
    notice_s: float
    submitted_at: float  # trace time of the submission
    deadline_s: float | None = None  # market seconds after submission
    cadence_steps: int = 10**9  # the template's every_steps (the policy may only ask for more)
    nodes: int = Resources().nodes  # instances held at once: what dispatch reads from the template


@dataclass
class Attempt:
    attempt: int
    spot: bool
    dispatch_at: float
    instance_at: float
    resumed_step: int
    work_left_s: float
    interval_s: float | None
    interval_steps: int
    rate: dict
    notices: dict
    dispatch_market: dict | None = None
    work_at: float | None = None
    checkpoints: list = field(default_factory=list)  # [{"step", "at", "tier"}]
    end: str = ""  # "reclaim" | "migration" | "finished"
    reclaim_at: float | None = None
    release_at: float | None = None
    caught: bool | None = None  # reclaimed: did an emergency checkpoint save the newest state
    stop_step_model: int | None = None  # the first step after the agent was told (vs Launch.stopped_step)
    lost_steps: int | None = None  # reclaimed: steps done since the newest checkpoint
    rule: IntervalRule | None = None  # what the agent re-asks after each durable save
    decisions: list = field(default_factory=list)  # the agent's: [{"step", "age_s", "interval_s", "steps"}]


def replay_control(trace: Trace, offer: Offer, job: ControlJob, launches: list[Launch], *,
                   ticks: tuple[Tick, ...] = (), move: Move | None = None,
                   model: ReclaimModel | None = None) -> dict:
    """Replay the protocol over ``launches`` (in order); ``ticks``: the price sensor's decision
    ticks; ``move``: the timings of a move to on-demand."""
    if job.steps < 1 or job.step_s <= 0:
        raise OrbitError("the job needs steps >= 1 and step_s > 0", field="job", value=(job.steps, job.step_s),
                         fix="pass the job's steps and its step time in market seconds")
    m = model or load_reclaim_model()
    book, notices = RateBook(model=m), NoticeReliability()
    spot_offer, od_offer = offer, on_demand(offer)
    done, attempts, switches = 0, [], []
    pending: Launch | None = None
    queue = list(launches)
    while done < job.steps and (pending is not None or queue):
        launch = pending or queue.pop(0)
        pending = None
        a = _dispatch(len(attempts) + 1, launch, job, spot_offer, od_offer, book, notices, done, m)
        attempts.append(a)
        if a.dispatch_market is not None:
            switches.append({"at": launch.dispatch_at, "action": a.dispatch_market["action"], "by": "dispatch",
                             "attempt": a.attempt})
        done, switch_at = _session(trace, a, launch, job, spot_offer, book, ticks, move, done, switches)
        if a.spot and a.release_at is not None and math.isfinite(a.release_at):
            lost = a.end == "reclaim"
            # what the ledger bills: up to the release (the control plane's own latency included)
            up_to = launch.released_at if launch.released_at is not None else a.release_at
            book.for_offer(spot_offer).observe(1 if lost else 0, max(up_to - a.instance_at, 0.0))
            if lost:
                notices.observe(1, 0 if _notice_known(a, launch, job) else 1)
        if switch_at is not None:  # on demand from here on: the given spot launches are moot
            if move is None:
                raise OrbitError("the replay moved to on-demand but was given no move timings", field="move",
                                 value=None, fix="pass Move(...) measured from a real move")
            nxt = next((x for x in queue if not x.spot), launch)
            queue = []
            after = move.dispatch_after_s if move.dispatch_after_s is not None else move.instance_after_s
            pending = Launch(dispatch_at=switch_at + after, instance_at=switch_at + move.instance_after_s,
                             work_at=switch_at + move.work_after_s, save_s=nxt.save_s, step_s=nxt.step_s, spot=False,
                             decision_ages=nxt.decision_ages if not nxt.spot else None)
    return {"attempts": [vars(a) for a in attempts], "switches": switches, "finished": done >= job.steps,
            "migrations": sum(1 for a in attempts if a.end == "migration")}


def _notice_known(a: Attempt, launch: Launch, job: ControlJob) -> bool:
    """Whether the ledger knows the reclaim came with a notice: an emergency checkpoint of the
    attempt, or a notice event (``control.dispatch.fleet_notices``)."""
    if job.notice_s <= 0:
        return False
    recorded = launch.notice_recorded if launch.notice_recorded is not None else True
    return bool(a.caught) or recorded


def _market(job: ControlJob, spot_offer: Offer, od_offer: Offer | None, book: RateBook, *, at: float,
            done: int, step_s: float, save_s: float, holding: str, running_since: float | None = None) -> dict | None:
    """``spot_or_on_demand`` asked as ``control.deadline.choose`` asks it: the offer's rate from
    every spot instance billed so far, the one still running (since ``running_since``) included."""
    if job.deadline_s is None or od_offer is None:
        return None
    est = book.for_offer(spot_offer)
    if running_since is not None:
        est = replace(est, exposure_s=est.exposure_s + max(at - running_since, 0.0))
    availability = MarkovAvailability.from_exposure(load_reclaim_model(), MIN_DECISION_TICK_S,
                                                    reclaims=est.reclaims, exposure_s=est.exposure_s)
    d = spot_or_on_demand(work_left_s=max(job.steps - done, 0) * step_s,
                          time_left_s=max(job.deadline_s - (at - job.submitted_at), 0.0), spot_available=True,
                          holding=holding, spot_usd_per_hour=spot_offer.usd_per_second * 3600.0,
                          on_demand_usd_per_hour=od_offer.usd_per_second * 3600.0, restore_s=RESTORE_PRIOR_S,
                          save_s=save_s, notice_s=job.notice_s, mtbf_s=est.mtbf_s, availability=availability)
    return {"action": "on_demand" if d.action == "on_demand" else "spot", "policy_action": d.action,
            "reason": d.reason, **d.inputs}


def _dispatch(n: int, launch: Launch, job: ControlJob, spot_offer: Offer, od_offer: Offer | None, book: RateBook,
              notices: NoticeReliability, done: int, model: ReclaimModel) -> Attempt:
    market = _market(job, spot_offer, od_offer, book, at=launch.dispatch_at, done=done, step_s=launch.step_s,
                     save_s=launch.save_s, holding="none")
    offer = spot_offer if launch.spot else od_offer
    assert offer is not None
    work_left = max(job.steps - done, 0) * launch.step_s or math.inf
    policy = OrbitInterval.for_offer(offer, save_s=launch.save_s, notice_s=job.notice_s, model=model, rates=book,
                                     notices=notices, nodes=job.nodes)
    decision = policy.decide(age_s=0.0, work_left_s=work_left)
    rule = policy.rule()
    tau = decision["interval_s"]
    steps = max(1, int(round(tau / launch.step_s))) if tau is not None else None
    return Attempt(attempt=n, spot=launch.spot, dispatch_at=launch.dispatch_at, instance_at=launch.instance_at,
                   resumed_step=done, work_left_s=work_left, interval_s=tau,
                   interval_steps=min(job.cadence_steps, steps) if steps else job.cadence_steps,
                   rate=book.for_offer(offer).as_record(), notices=notices.as_record(), dispatch_market=market,
                   work_at=launch.work_at, rule=rule)


def _session(trace: Trace, a: Attempt, launch: Launch, job: ControlJob, spot_offer: Offer, book: RateBook,
             ticks: tuple[Tick, ...], move: Move | None, done: int, switches: list) -> tuple[int, float | None]:
    """One attempt from its instance to its end: (newest checkpoint's step after it, the decision
    tick of a move to on-demand or None)."""
    s, w, k0, step = launch.instance_at, launch.work_at, done, job.step_s
    reclaim = None
    if launch.spot:
        if next_available(trace, s) != s:
            raise OrbitError(f"attempt {a.attempt}: the trace has no capacity at {s:.0f} s", field="instance_at",
                             value=s, fix="launch spot instances only where the trace is up")
        offsets = reclaim_offsets(trace, s, trace.duration_s)
        reclaim = s + offsets[0] if offsets else None
    a.reclaim_at = reclaim

    def steps_by(t: float) -> int:  # steps completed by trace time t
        return k0 if w is None or t < w else min(job.steps, k0 + int(math.floor((t - w) / step + 1e-9)))

    def time_of(k: int) -> float:
        assert w is not None
        return w + (k - k0) * step

    def first_step_after(t: float) -> int:  # where the agent stops once it is told at t
        return k0 + max(1, int(math.ceil((t - w) / step - 1e-9)))

    # How it ends, by default: the final step's durable checkpoint.
    stop_at = time_of(job.steps) if w is not None else math.inf
    end, last, emergency, late = "finished", job.steps, False, False
    if reclaim is not None and job.notice_s > 0:
        seen = launch.notice_seen_at if launch.notice_seen_at is not None else reclaim - job.notice_s
        if seen < stop_at:
            if w is None:  # the notice came before the workload started: nothing to save, it stops
                stop_at, end, last = min(seen, reclaim), "reclaim", k0
            elif first_step_after(seen) < job.steps:
                last = a.stop_step_model = first_step_after(seen)
                last = launch.stopped_step if launch.stopped_step is not None else last
                stop_at, end, emergency = time_of(last), "reclaim", True
                durable = (launch.emergency_durable if launch.emergency_durable is not None
                           else stop_at + launch.save_s <= reclaim)
                if not durable:  # the save was cut short: the agent stopped, the host went at the reclaim
                    stop_at, emergency, late = reclaim, False, True
    elif reclaim is not None and reclaim < stop_at:  # no notice: killed where it stands
        stop_at, end, last = reclaim, "reclaim", steps_by(reclaim)
    # The sensor sees the attempt running until the control plane has released its instance.
    until = max(stop_at, launch.released_at) if launch.released_at is not None else stop_at
    switch_at = _ask_ticks(a, launch, job, spot_offer, book, ticks, until=until, switches=switches)
    if switch_at is not None and switch_at >= stop_at:  # the agent had stopped: only the reclaim is avoided
        end = "migration"
    elif switch_at is not None:
        assert move is not None, "a move to on-demand needs its timings (Move)"
        told = switch_at + move.emergency_after_s  # SIGTERM once the replacement is up
        if w is None or told < w:
            stop_at, end, last, emergency = told, "migration", k0, False
        else:
            last = a.stop_step_model = min(first_step_after(told), job.steps)
            last = launch.stopped_step if launch.stopped_step is not None else last
            stop_at, end, emergency = time_of(last), "migration", last < job.steps
            if emergency and launch.emergency_durable is False:  # killed at the end of its grace, unsaved
                emergency, late = False, True
    every = a.interval_steps
    k = (k0 // every + 1) * every
    while k <= min(last, job.steps - 1):
        if (emergency or late) and k == last:
            break  # that step's save is the emergency one (durable or cut short)
        if end == "reclaim" and not emergency and time_of(k) + launch.save_s > stop_at:
            break  # killed before this save completed
        a.checkpoints.append({"step": k, "at": time_of(k), "tier": "durable"})
        k += _redecide(a, launch, job, k, time_of(k))
    if end == "finished" or last == job.steps:
        end = "finished"
        a.checkpoints.append({"step": job.steps, "at": time_of(job.steps), "tier": "durable"})
    elif emergency:
        a.checkpoints.append({"step": last, "at": time_of(last), "tier": "emergency"})
    a.end, a.release_at = end, stop_at
    if end == "reclaim":
        a.caught = emergency
        a.lost_steps = (last - max([c["step"] for c in a.checkpoints], default=k0))
    return max([c["step"] for c in a.checkpoints], default=done), switch_at


def _redecide(a: Attempt, launch: Launch, job: ControlJob, k: int, at: float) -> int:
    """The agent's decision at the durable save of step ``k``: steps to the next save."""
    ages = launch.decision_ages or {}
    age = ages[k] if k in ages else max(at - launch.instance_at, 0.0)
    work_left = (job.steps - k) * launch.step_s
    tau = a.rule.interval(age, work_left) if a.rule is not None else math.inf
    n = min(job.cadence_steps, max(1, int(round(tau / launch.step_s)))) if math.isfinite(tau) else job.cadence_steps
    a.decisions.append({"step": k, "age_s": age, "model_age_s": max(at - launch.instance_at, 0.0),
                        "interval_s": tau, "steps": n, "work_left_s": work_left})
    return n


def _ask_ticks(a: Attempt, launch: Launch, job: ControlJob, spot_offer: Offer, book: RateBook,
               ticks: tuple[Tick, ...], *, until: float, switches: list) -> float | None:
    """The price sensor's ticks while the attempt runs on spot: the first that says on-demand.
    It knows the work done from the metrics the agent reported (they reach the ledger in
    batches, so it may lag the agent): the tick's known step, else where the attempt resumed."""
    if not launch.spot or job.deadline_s is None:
        return None
    for tick in ticks:
        t = tick.at
        if launch.instance_at <= t < until:
            done = tick.known_step if tick.known_step is not None else a.resumed_step
            d = _market(job, spot_offer, on_demand(spot_offer), book, at=t, done=done, step_s=tick.step_s,
                        save_s=tick.save_s, holding="spot", running_since=launch.instance_at)
            if d is not None and d["action"] == "on_demand":
                switches.append({"at": t, "action": "on_demand", "by": "tick", "attempt": a.attempt, "done_steps": done,
                                 "work_left_s": d["work_left_s"], "time_left_s": d["time_left_s"]})
                return t
    return None
