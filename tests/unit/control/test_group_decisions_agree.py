"""The simulator and production make the same group decisions on the same reclaims (issue 21,
item 6; docs/multi-node.md, "The simulator and production").

One 3-node trace (a zone's count of instances, one value a minute) is the sequence of group
reclaims. Two drivers walk it:

- the simulator: `policy.group_replay.replay_group`, what `orbit simulate --group` runs;
- production: `control.group_recovery.recover_group`, as `run_attempt` calls it when a group's
  attempt ends, on a real ledger, with a `GroupWatch` over the nodes' statuses and the
  template's `resources.nodes` and `elastic`; its provider's side (which instances are up, and
  whether a replacement can be rented) answered from the same trace: the zone holds, after a
  reclaim, the trace's count. Each next group is what production's decision left in
  `group_members` (or, after a regroup, a group rented anew when the trace holds it).

Both must reach the same decision at every reclaim: the group's size, the lost and the stuck
ranks, replace/shrink/regroup and the next group's size. A unit-level replay on the shared
policy, over several reclaims and without a notice too; the end-to-end run of a group on the
embedded market replaying an N-node trace node by node, checkpoints included, is
tests/integration/test_group_replay.py (one reclaim with a notice, elastic and not).
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from orbit_dagster.catalog.traces import Trace, up_runs
from orbit_dagster.control.billing import instance_row
from orbit_dagster.control.group import GroupWatch, member_rows
from orbit_dagster.control.group_recovery import recover_group
from orbit_dagster.core.errors import NoCapacity
from orbit_dagster.core.offers import Offer
from orbit_dagster.core.submission import apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.ledger import records as R
from orbit_dagster.policy.checkpointing import FixedInterval
from orbit_dagster.policy.group_replay import count_at, replay_group
from orbit_dagster.policy.simulate import JobParams, notice_missed
from orbit_dagster.providers.base import InstanceHandle, InstanceTimes, RunHandle, RunStatus
from orbit_dagster.settings import Settings
from tests.unit.policy.helpers import group_job as job
from tests.unit.policy.helpers import group_trace as trace

JOB = "job-group"
OFFER = Offer(offer_id="sim:g1:zone-a", provider="sim", instance_type="g1", gpu="L4", gpu_count=1, zone="zone-a",
              usd_per_gpu_second_spot=0.0003)


class TraceZone:
    """Production's provider, its answers read from the trace: after a reclaim the zone holds
    `room` instances (the trace's count then; the reclaimed ones are `going`), so a replacement is
    rented only while fewer are up; a released instance is gone; each node's status is set by the
    walk (a notice: the reclaimed node exits as preempted and its peers stop with it; none: its
    host is lost and the peers still wait in a collective)."""

    name, notice_seconds, relaunch = "sim", 120.0, True

    def __init__(self):
        self.up: dict[str, InstanceHandle] = {}
        self.going: set[str] = set()
        self.statuses: dict[str, RunStatus] = {}
        self.room, self.rented = 0, 0

    def provision(self, offer: Offer, *, tags: dict[str, str]) -> InstanceHandle:
        if len(set(self.up) - self.going) >= self.room:
            raise NoCapacity(f"the zone holds {self.room} instance(s)", provider=self.name)
        self.rented += 1
        instance = InstanceHandle(provider="sim", instance_id=f"i-{self.rented}", offer=offer,
                                  started_at=datetime.now(timezone.utc))
        self.up[instance.instance_id] = instance
        return instance

    def group_offers(self, offer: Offer, count: int) -> list[Offer]:
        return [offer] * count

    def instance_alive(self, instance: InstanceHandle) -> bool:
        return instance.instance_id in self.up

    def instance_times(self, instance: InstanceHandle) -> InstanceTimes:
        return InstanceTimes(started_at=instance.started_at, stopped_at=datetime.now(timezone.utc))

    def terminate(self, instance: InstanceHandle, reason: str) -> InstanceTimes:
        self.up.pop(instance.instance_id, None)
        self.going.discard(instance.instance_id)
        return self.instance_times(instance)

    def status(self, run: RunHandle) -> RunStatus:
        return self.statuses[run.instance.instance_id]


def rent_anew(ledger, zone: TraceZone, nodes: int, attempt: int) -> list[InstanceHandle]:
    """Dispatch's gang rental of a whole group, recorded as it records one."""
    zone.room = nodes
    group = [zone.provision(OFFER, tags={}) for _ in range(nodes)]
    run_id = R.run_id_for(JOB, attempt)
    ledger.commit({"instances": [instance_row(i, "train", JOB, run_id) for i in group],
                   "group_members": member_rows(group, job_id=JOB, attempt=attempt)})
    return group


def production(settings: Settings, template, t: Trace, params: JobParams, reclaims: int) -> list[tuple]:
    """recover_group at each of the trace's first `reclaims` reclaims of the group production holds."""
    ledger, zone, nodes = settings.ledger(), TraceZone(), template.resources.nodes
    group, at, attempt, out = rent_anew(ledger, zone, nodes, 1), params.start_s, 1, []
    while len(out) < reclaims:
        size = len(group)
        e = next(end for _, end, reclaimed in up_runs(t, at, 2 * t.duration_s, nodes=size, cyclic=True) if reclaimed)
        room = count_at(t, e, size)
        lost = range(min(room, size - 1), size)
        noticed = params.notice_s > 0 and not notice_missed(params, e)
        for rank, instance in enumerate(group):
            zone.statuses[instance.instance_id] = (
                RunStatus(state="running") if not noticed and rank not in lost else
                RunStatus(state="lost", reason="host gone") if rank in lost and not noticed else
                RunStatus(state="exited", exit_code=75, failure_class="reclaim", reason="reclaim notice")
                if rank in lost else RunStatus(state="exited", exit_code=0, reason="stopped with the group"))
        now = datetime.now(timezone.utc)
        handles = [RunHandle(provider="sim", instance=i, run_ref=f"r{attempt}-{k}", attempt=attempt, launched_at=now)
                   for k, i in enumerate(group)]
        handle = handles[0].model_copy(update={"nodes": tuple(handles[1:])})
        watch = GroupWatch(zone, handle)
        assert watch.status().state != "running"  # the group ended, as run_attempt sees it end
        zone.room, zone.going = room, {group[r].instance_id for r in lost}
        recover_group(settings, ledger, zone, handle, template=template, job_id=JOB, attempt=attempt, watch=watch,
                      checkpoints=[], last_progress=None, reason=f"node {lost[0]}: reclaim")
        row = ledger.one("SELECT chosen, inputs FROM decisions WHERE decision_id = ?",
                         [f"group_recovery:{R.run_id_for(JOB, attempt)}"])
        inputs = json.loads(row["inputs"])
        attempt += 1
        kept = [json.loads(r["handle"]) for r in ledger.rows(
            """SELECT i.handle FROM group_members g JOIN instances i ON i.instance_id = g.instance_id
               WHERE g.run_id = ? ORDER BY g.node_rank""", [R.run_id_for(JOB, attempt)])]
        group = ([InstanceHandle.model_validate(h) for h in kept] if kept else rent_anew_when_held(ledger, zone, t, e,
                                                                                                  nodes, attempt))
        out.append((e, size, [x["node"] for x in inputs["lost"]], inputs.get("stuck", []), row["chosen"], len(group)))
        at = e
        assert set(zone.up) == {i.instance_id for i in group}  # everything else released
    return out


def rent_anew_when_held(ledger, zone: TraceZone, t: Trace, after: float, nodes: int, attempt: int):
    assert next(up_runs(t, after, 2 * t.duration_s, nodes=nodes, cyclic=True)) is not None  # the trace holds one
    return rent_anew(ledger, zone, nodes, attempt)


@pytest.mark.parametrize("overrides, notice_s, modes", [
    ({"elastic.min_nodes": 2, "elastic.max_nodes": 3}, 120.0, ["shrink", "regroup", "shrink"]),
    ({"elastic": None}, 120.0, ["regroup", "regroup"]),  # replace planned, no room at the reclaim
    ({"elastic.min_nodes": 2, "elastic.max_nodes": 3}, 0.0, ["regroup", "regroup"]),  # no notice: peers stuck
])
def test_the_simulator_and_production_decide_alike_at_every_reclaim(orbit_home, overrides, notice_s, modes):
    template = apply_overrides(load_template("fsdp-multinode"), {"resources.nodes": 3, **overrides})
    floor = template.elastic.min_nodes if template.elastic else None
    params = job(notice_s=notice_s)
    sim = replay_group(trace(), FixedInterval(1800.0, uses_notice=True), params, min_nodes=floor)
    simulated = [(d["at_s"], d["size"], d["lost"], d["stuck"], d["mode"], d["next_size"])
                 for d in sim.extra["group_decisions"]]
    assert [d[4] for d in simulated] == modes and sim.finished
    assert production(Settings.from_env(orbit_home), template, trace(), params, len(simulated)) == simulated
