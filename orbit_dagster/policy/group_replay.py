"""One job on a group of nodes through an N-node trace, each reclaim of some of its nodes
decided by the group policy (`policy.group_recovery`) with the inputs production gives it
(`control.group_recovery.group_inputs`): docs/multi-node.md, "The simulator and production".

`simulate.replay` holds a gang: the trace must hold all N nodes, any drop ends the session of
the whole gang, and it is rented again once the trace holds N. Here the trace's count is how
many of the zone's instances the job can hold, and a drop of it below the group's size at
second `e` reclaims that many of the group's nodes:

- the policy is told what production tells it: the template's size (`JobParams.nodes`) and
  elastic floor (`min_nodes`), the group's size then, the lost ranks (the trace counts nodes,
  it does not name them: the highest ranks), the ranks still running when the group ended
  (`stuck`: none when the notice came, since every rank stops at the all-reduced stop flag; all
  survivors when it did not, since they wait in a collective for the vanished peer and are
  released), and whether the provider's instances take another workload (`can_keep`);
- `settle` then asks the market what production's rental asks its provider: the survivors are
  up (the trace holds them), and replacements can be rented only if the zone holds the survivors
  and them after the reclaim (the count at `e`, which just fell below the group: on a count
  trace a replacement is never there at the reclaim, so `replace` falls back as production's
  does when its provider answers "no capacity");
- `shrink`: the survivors go on at once (from the group's release, after its emergency
  checkpoint), a restore later, on a group of that size, at that share of the whole group's pace
  (the global batch is kept: docs/multi-node.md); `regroup`: a group of `nodes` is rented
  when the trace holds it again (from `e`). A shrunk group never grows while it runs (nor does
  production's).

Each session is `simulate._session` (the interval strategy's periodic saves, the emergency
checkpoint at the notice, the restore), billed at the group's size; the interval is asked from
the session's start, as for a gang rented anew (the agent on a kept survivor asks from the
instance's own start: a difference of model, not of decision). Accounts are in seconds of
the template's whole group (a second of a group of k of N nodes counts k/N), so `compare.summarise`
turns them into GPU-hours as for a gang. Every decision is recorded in `extra["group_decisions"]`,
and every completed save in `extra["group_checkpoints"]` (when it began on the trace's clock, the
work it holds in seconds of the whole group, its tier, the session and the group's size then):
what tests/integration/test_group_replay.py compares with the embedded market's checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from orbit_dagster.catalog.traces import Trace, cyclic_time, up_runs
from orbit_dagster.policy.checkpointing import CheckpointStrategy
from orbit_dagster.policy.group_recovery import GroupPlan, plan_group_recovery, settle
from orbit_dagster.policy.simulate import JobParams, ReplayResult, _Book, _noticed, _PriceClock, _session


def count_at(trace: Trace, t_s: float, nodes: int) -> int:
    """How many instances the trace holds at second `t_s` of a cyclic replay (see `up_runs`)."""
    return trace.data[min(int(cyclic_time(trace, t_s, nodes) // trace.gap_seconds), len(trace.data) - 1)]


@dataclass(frozen=True)
class GroupReclaim:
    """What the policy is told at one reclaim of some of a group's nodes (production's inputs)."""

    at_s: float  # the reclaim, on the trace's clock
    size: int  # the group's size then
    lost: tuple[int, ...]
    stuck: tuple[int, ...]  # survivors still running when the group ended (no notice came)
    room: int  # instances the zone holds after the reclaim (what a rental of replacements meets)


def reclaim_at(trace: Trace, at_s: float, size: int, noticed: bool | None) -> GroupReclaim:
    """The reclaim the trace makes at `at_s` of a group of `size`: the highest ranks lost."""
    room = count_at(trace, at_s, size)
    left = min(room, size - 1)
    survivors = tuple(range(left))
    return GroupReclaim(at_s=at_s, size=size, lost=tuple(range(left, size)), stuck=() if noticed else survivors,
                        room=room)


def decide(reclaim: GroupReclaim, *, nodes: int, min_nodes: int | None, can_keep: bool) -> tuple[str, GroupPlan]:
    """The policy's plan at a reclaim and the plan as carried out: the simulator's market answers
    `settle` (survivors up; replacements only where the zone holds them after the reclaim)."""
    plan = plan_group_recovery(nodes=nodes, size=reclaim.size, lost=list(reclaim.lost), stuck=list(reclaim.stuck),
                               min_nodes=min_nodes, can_keep=can_keep)

    def rent(count: int) -> str | None:
        if reclaim.room >= len(plan.keep) + count:
            return None
        # named by the first node that cannot be had, as the embedded market says it when it rents
        # the replacements one by one, each by its node's series (providers/sim/node_trace.py)
        return f"the zone holds {reclaim.room} node(s) after the reclaim, not {max(reclaim.room, len(plan.keep)) + 1}"

    return plan.mode, settle(plan, nodes=nodes, min_nodes=min_nodes, survivors_up=True, rent=rent)


class _GroupBook(_Book):
    """A session's accounts at the group's size: seconds counted as a share of the whole group.
    It also lists the session's completed saves (`saves`): when each began on the trace's clock and
    how much of the job's work (in seconds of the whole group) it holds. `_session` books the
    work before a save, then the save, so the work so far is known at each."""

    def __init__(self, res: ReplayResult, prices: _PriceClock, share: float, durable_s: float = 0.0):
        super().__init__(res, prices)
        self.share, self.durable_s, self.worked_s = share, durable_s, 0.0
        self.saves: list[dict] = []

    def add(self, account: str, a: float, b: float) -> None:
        if account == "checkpoint":  # (a save of no time is a save too: a model that does not count its time)
            self.saves.append({"at_s": a, "work_s": self.durable_s + self.worked_s * self.share, "tier": "durable"})
        if b <= a:
            return
        if account == "useful":
            self.worked_s += b - a
        setattr(self.res, f"{account}_s", getattr(self.res, f"{account}_s") + (b - a) * self.share)
        setattr(self.res, f"{account}_usd", getattr(self.res, f"{account}_usd") + self.prices.cost(a, b))


def replay_group(trace: Trace, strategy: CheckpointStrategy, job: JobParams, *, min_nodes: int | None = None,
                 can_keep: bool = True) -> ReplayResult:
    """Run `job` (a group of `job.nodes`) through `trace` under `strategy`, each reclaim of some
    nodes decided by the group policy (the module's doc); same inputs, same numbers."""
    horizon = job.horizon_s if job.horizon_s is not None else 2 * trace.duration_s
    stop_at = job.start_s + horizon
    res = ReplayResult(policy=strategy.name, finished=False, work_s=job.work_s, wall_s=horizon)
    decisions: list[dict] = []
    saves: list[dict] = []
    size, t, durable = job.nodes, job.start_s, 0.0
    while t < stop_at:
        run = next(up_runs(trace, t, stop_at - t, nodes=size, cyclic=True), None)
        if run is None:
            break
        s0, e, reclaimed = run
        book = _GroupBook(res, _PriceClock(trace, job.spot_usd_per_hour, size), size / job.nodes, durable)
        emergencies = res.emergency_checkpoints
        # A group of k of N nodes trains at k/N of the whole group's pace (the same global batch
        # each step, more micro-batches per rank): the session sees the work left in its own seconds.
        pace = size / job.nodes
        end, done_here, done = _session(s0, e, reclaimed, 0.0, strategy,
                                        replace(job, work_s=(job.work_s - durable) / pace), book)
        durable = job.work_s if done else durable + done_here * pace
        if res.emergency_checkpoints > emergencies:  # a session's emergency save is its last
            book.saves[-1]["tier"] = "emergency"
        saves += [{**c, "session": res.sessions, "size": size} for c in book.saves]
        res.sessions += 1
        res.paid_s += (end - s0) * size / job.nodes
        res.cost_usd += book.prices.cost(s0, end)
        lost_work = reclaimed and not done
        noticed = _noticed(job, e) if lost_work else None
        strategy.end_session(end - s0, lost_work, noticed)
        if done:
            res.finished, res.wall_s = True, end - job.start_s
            break
        if not reclaimed:
            break
        res.reclaims += 1
        reclaim = reclaim_at(trace, e, size, noticed)
        planned, plan = decide(reclaim, nodes=job.nodes, min_nodes=min_nodes, can_keep=can_keep)
        decisions.append({"at_s": e, "size": size, "lost": list(reclaim.lost), "stuck": list(reclaim.stuck),
                          "planned": planned, "mode": plan.mode, "keep": list(plan.keep), "next_size": plan.size,
                          "released_at": end, "emergency_checkpoint": res.emergency_checkpoints > emergencies,
                          "durable_s": durable, "reason": plan.reason})
        # the survivors (and any replacements) go on from the group's release; a group anew once
        # the trace holds it again, after the reclaim
        size, t = plan.size, (end if plan.mode != "regroup" else e)
    res.useful_s = durable
    res.extra["group_decisions"] = decisions
    res.extra["group_checkpoints"] = saves
    return res
