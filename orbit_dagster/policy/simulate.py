"""Deterministic replay of one job through a spot trace, for a checkpoint policy.

The job needs ``work_s`` seconds of work on ``nodes`` instances at once (a gang: an N-node
trace needs all N; a reclaim of any of them ends the session). It holds the gang whenever
the trace can give it (waiting costs nothing), pays from the moment it gets it, and:

1. restores: ``restore_s`` of boot + image + checkpoint load (paid, no progress);
2. works, stopping every ``strategy.interval(age, work_left)`` seconds for a durable
   checkpoint of ``save_s`` (paid, no progress); work becomes durable when a save completes;
3. at a reclaim (the trace drops below ``nodes``), loses every second of work since the
   last completed save, unless the strategy uses the notice and the notice arrives: it
   comes ``notice_s`` before the reclaim with the reclaim's time (as AWS's instance-action
   does); an emergency checkpoint starts ``(1 + EMERGENCY_MARGIN) * emergency_save_s``
   before the reclaim when that fits, and the gang is released as soon as it is durable
   (or at the notice, when no save can complete: nothing left to gain by paying);
4. finishes with a final durable save (every strategy pays it).

Accounting, exact for every run (tests check it), in seconds of the gang and in dollars:
``paid = useful + checkpoint_overhead + restart_overhead + wasted + in_flight``

- useful: work in the final result;
- checkpoint overhead: completed saves (periodic, emergency, final);
- restart overhead: restores, including ones cut short by a reclaim;
- **wasted**: work lost at reclaims (done since the last durable checkpoint), saves a
  reclaim cut short, and paid time after an emergency checkpoint before the reclaim;
- in_flight: work not yet durable when the replay horizon ends (unfinished jobs only).

**Total overhead** = paid - useful = checkpoint + restart + wasted (+ in flight).
Dollars are each interval's seconds at the trace's price of each tick, times ``nodes``.

``notice_miss_rate`` (default 0: every notice arrives) drops the notice of a seeded share of
reclaims, for sensitivity runs: AWS documents the notice as best effort. Which notices are
lost depends on the reclaim's time and the seed only, so every policy loses the same ones.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from orbit_dagster.catalog.traces import Trace, first_up_tick, up_runs
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.interval import EMERGENCY_MARGIN
from orbit_dagster.policy.checkpointing import CheckpointStrategy, FixedInterval


@dataclass(frozen=True)
class JobParams:
    """What the replay needs to know about the job and the platform."""

    work_s: float
    save_s: float = 60.0
    restore_s: float = 300.0
    notice_s: float = 120.0
    emergency_save_s: float | None = None
    start_s: float = 0.0
    horizon_s: float | None = None  # default: two passes over the trace
    nodes: int = 1  # instances held at once (the gang); prices and GPU-hours scale with it
    gpus_per_node: int = 1  # for GPU-hours (1 for CPU instances: instance-hours)
    spot_usd_per_hour: float = 0.918  # per instance, for traces without prices
    notice_miss_rate: float = 0.0  # share of reclaims whose notice never arrives (seeded per reclaim)
    seed: int = 0

    @property
    def esave(self) -> float:
        return self.save_s if self.emergency_save_s is None else self.emergency_save_s


@dataclass
class ReplayResult:
    policy: str
    finished: bool
    work_s: float
    wall_s: float
    paid_s: float = 0.0
    useful_s: float = 0.0
    checkpoint_s: float = 0.0
    restart_s: float = 0.0
    wasted_s: float = 0.0
    in_flight_s: float = 0.0
    cost_usd: float = 0.0
    reclaims: int = 0
    checkpoints: int = 0
    emergency_checkpoints: int = 0
    sessions: int = 0
    useful_usd: float = 0.0
    checkpoint_usd: float = 0.0
    restart_usd: float = 0.0
    wasted_usd: float = 0.0
    in_flight_usd: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.useful_s / self.paid_s if self.paid_s > 0 else 0.0

    @property
    def overhead_s(self) -> float:
        """Total overhead: every paid second that is not useful work."""
        return self.paid_s - self.useful_s

    @property
    def overhead_usd(self) -> float:
        return self.cost_usd - self.useful_usd

    def as_dict(self) -> dict:
        d = asdict(self)
        d["goodput"] = round(self.goodput, 6)
        for k in ("paid_s", "useful_s", "checkpoint_s", "restart_s", "wasted_s", "in_flight_s"):
            d[k.replace("_s", "_gpu_hours")] = round(d.pop(k) / 3600.0, 6)
        d["wall_hours"] = round(d.pop("wall_s") / 3600.0, 6)
        d["job_hours"] = round(d.pop("work_s") / 3600.0, 6)
        d["cost_usd"] = round(self.cost_usd, 6)
        return d


class _PriceClock:
    """Cumulative spot dollars of the gang at any trace time (piecewise constant per tick), on
    the ticks the cyclic replay reads (``catalog.traces.cyclic_ticks``: once through, then from
    the first tick that holds the gang)."""

    def __init__(self, trace: Trace, default_usd_per_hour: float, nodes: int = 1):
        self.gap = trace.gap_seconds
        self.n = len(trace.data)
        self.first = first_up_tick(trace, nodes) or 0
        self.rate = [trace.price_at(k, default_usd_per_hour) * nodes / 3600.0 for k in range(self.n)]
        self.prefix = [0.0]
        for r in self.rate:
            self.prefix.append(self.prefix[-1] + r * self.gap)

    def at(self, t: float) -> float:
        k_all = int(math.floor(t / self.gap))
        if k_all < self.n:
            return self.prefix[k_all] + (t - k_all * self.gap) * self.rate[k_all]
        cycles, r = divmod(k_all - self.n, self.n - self.first)
        k = self.first + r
        per_cycle = self.prefix[-1] - self.prefix[self.first]
        return (self.prefix[-1] + cycles * per_cycle + self.prefix[k] - self.prefix[self.first]
                + (t - k_all * self.gap) * self.rate[k])

    def cost(self, a: float, b: float) -> float:
        return self.at(b) - self.at(a)


def replay(trace: Trace, strategy: CheckpointStrategy, job: JobParams) -> ReplayResult:
    """Run ``job`` through ``trace`` under ``strategy``; same inputs, same numbers."""
    horizon = job.horizon_s if job.horizon_s is not None else 2 * trace.duration_s
    res = ReplayResult(policy=strategy.name, finished=False, work_s=job.work_s, wall_s=horizon)
    book = _Book(res, _PriceClock(trace, job.spot_usd_per_hour, job.nodes))
    durable = 0.0
    for s0, e, reclaimed in up_runs(trace, job.start_s, horizon, nodes=job.nodes, cyclic=True):
        res.sessions += 1
        end, durable, done = _session(s0, e, reclaimed, durable, strategy, job, book)
        res.paid_s += end - s0
        res.cost_usd += book.prices.cost(s0, end)
        lost = reclaimed and not done
        strategy.end_session(end - s0, lost, _noticed(job, e) if lost else None)
        if done:
            res.finished = True
            res.wall_s = end - job.start_s
            break
        if reclaimed:
            res.reclaims += 1
    res.useful_s = durable
    return res


class _Book:
    """Adds an interval of trace time to one account, in seconds and in dollars."""

    def __init__(self, res: ReplayResult, prices: _PriceClock):
        self.res, self.prices = res, prices

    def add(self, account: str, a: float, b: float) -> None:
        if b <= a:
            return
        setattr(self.res, f"{account}_s", getattr(self.res, f"{account}_s") + (b - a))
        setattr(self.res, f"{account}_usd", getattr(self.res, f"{account}_usd") + self.prices.cost(a, b))


def _noticed(job: JobParams, reclaim_at: float) -> bool | None:
    """What the control plane records about a reclaim: did a notice precede it (None: no notice exists)."""
    return None if job.notice_s <= 0 else not notice_missed(job, reclaim_at)


def _session(s0: float, e: float, reclaimed: bool, durable: float, strategy: CheckpointStrategy,
             job: JobParams, book: _Book) -> tuple[float, float, bool]:
    """One gang from ``s0`` to its reclaim (or the horizon) at ``e``: (end, durable, finished)."""
    res = book.res
    if s0 + job.restore_s >= e:
        book.add("restart", s0, e)
        return e, durable, False
    book.add("restart", s0, s0 + job.restore_s)
    t = s0 + job.restore_s
    emergency_at = None
    if reclaimed and strategy.uses_notice and job.notice_s > 0 and not notice_missed(job, e):
        notice_at = max(s0, e - job.notice_s)
        emergency_at = max(notice_at, e - (1.0 + EMERGENCY_MARGIN) * job.esave)
    lost = "wasted" if reclaimed else "in_flight"
    while True:
        tau = max(strategy.interval(t - s0, job.work_s - durable), 1e-6)
        finish_at = t + (job.work_s - durable)
        save_at = min(t + tau, finish_at)
        final = save_at >= finish_at
        if emergency_at is not None and emergency_at < save_at and save_at + job.save_s > e:
            start = max(emergency_at, t)
            if start > t and start + job.esave <= e:
                book.add("useful", t, start)
                book.add("checkpoint", start, start + job.esave)
                durable += start - t
                res.emergency_checkpoints += 1
                start += job.esave
            elif start > t:  # the save cannot complete before the reclaim: that work is lost
                book.add("wasted", t, start)
            # the reclaim time is known: release the gang now rather than pay until it
            return start, durable, False
        if save_at + job.save_s > e:  # reclaimed (or the horizon) while working or saving
            book.add(lost, t, e)
            return e, durable, False
        book.add("useful", t, save_at)
        book.add("checkpoint", save_at, save_at + job.save_s)
        durable += save_at - t
        res.checkpoints += 1
        t = save_at + job.save_s
        if final:
            return t, job.work_s, True


def notice_missed(job: JobParams, reclaim_at: float) -> bool:
    """Is the notice of the reclaim at ``reclaim_at`` lost? Decided by the reclaim's time and
    the seed only, so every policy replayed on a trace loses the same notices."""
    if job.notice_miss_rate <= 0:
        return False
    digest = hashlib.sha256(f"{job.seed}:{reclaim_at:.3f}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < job.notice_miss_rate


# ---------------------------------------------------------------- many jobs, hindsight

def start_offsets(trace: Trace, starts: int) -> list[float]:
    """``starts`` job start times spread evenly over the trace (the trace replays cyclically)."""
    if not isinstance(starts, int) or starts < 1:
        raise OrbitError("starts must be an integer >= 1", field="starts", value=starts,
                         fix="replay at least one job")
    return [i * trace.duration_s / starts for i in range(starts)]


def replay_jobs(trace: Trace, make: Callable[[], CheckpointStrategy], jobs: list[JobParams], *,
                warm: bool = False) -> list[ReplayResult]:
    """Replay each job with a fresh strategy; ``warm`` lets it first observe the trace before the job."""
    out = []
    for job in jobs:
        strategy = make()
        if warm:
            warm_up(strategy, trace, job.start_s, job.nodes, job)
        out.append(replay(trace, strategy, job))
    return out


#: Candidate intervals for the hindsight search: 2 min to 12 h, geometric, plus "never".
HINDSIGHT_GRID_S = tuple(round(120.0 * (360.0 ** (i / 47)), 1) for i in range(48)) + (math.inf,)


def hindsight(trace: Trace, jobs: list[JobParams], *, uses_notice: bool,
              grid: tuple[float, ...] = HINDSIGHT_GRID_S,
              curve: dict[float, float] | None = None) -> tuple[float, list[ReplayResult]]:
    """The best *fixed* interval for this very trace: the offline baseline.

    It may look at the whole trace, future included, to choose one interval for all the
    jobs replayed on it, and it gets the same notice handling as ``orbit`` (``uses_notice``).
    Best = most jobs finished, then the fewest paid GPU-seconds, then the least waste.
    ``curve``, when given, receives every interval's mean overhead seconds per job: how much
    of the best one's edge over its neighbours is the luck of choosing on the realised trace.
    """
    best_key: tuple | None = None
    best: tuple[float, list[ReplayResult]] | None = None
    for tau in grid:
        rs = replay_jobs(trace, lambda tau=tau: FixedInterval(tau, uses_notice=uses_notice, name="hindsight"), jobs)
        if curve is not None:
            curve[tau] = sum(r.overhead_s for r in rs) / len(rs)
        key = (-sum(r.finished for r in rs), sum(r.paid_s for r in rs), sum(r.wasted_s for r in rs))
        if best_key is None or key < best_key:
            best_key, best = key, (tau, rs)
    assert best is not None
    for r in best[1]:
        r.extra["interval_s"] = best[0]
    return best


def warm_up(strategy: CheckpointStrategy, trace: Trace, until_s: float, nodes: int = 1,
            job: JobParams | None = None) -> None:
    """Let a strategy observe the trace's past (before ``until_s``), as the control plane's
    availability feed and its record of earlier instances in the zone would have: each
    lifetime, each reclaim and (given ``job``) whether a notice preceded it. Never the future."""
    if until_s <= 0:
        return
    for s0, e, reclaimed in up_runs(trace, 0.0, until_s, nodes=nodes, cyclic=False):
        lost = reclaimed and e < until_s
        strategy.end_session(e - s0, lost, _noticed(job, e) if (lost and job is not None) else None)


def trace_mtbf_s(trace: Trace, nodes: int = 1) -> float:
    """The trace's true MTBF for a gang of ``nodes``: up-time per reclaim over the whole trace
    (``inf`` when it never reclaims). What ``young-daly-true`` is told; no online policy is."""
    up, reclaims = 0.0, 0
    for s0, e, reclaimed in up_runs(trace, 0.0, trace.duration_s, nodes=nodes, cyclic=False):
        up += e - s0
        reclaims += reclaimed
    return up / reclaims if reclaims else math.inf
