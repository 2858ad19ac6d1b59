"""An attempt that spans several instances (resources.nodes > 1), as one run (docs/multi-node.md).

Rented all or none (`rent_group`): N instances of one offer's group (one shape, one zone, one
interconnect: `Provider.group_offers`), node 0 first; a group that cannot be completed is
released and billed at once and the next offer is tried, so no partial group is ever left
running. Launched on every node (`launch_group`) with the node's rank, the group's size and the
c10d rendezvous on node 0's host, which torchrun meets the others at. Followed as one run
(`GroupWatch`): the attempt ends when every node has ended, at once when a node's host is gone
(its peers would wait in a collective for it), and at most `GROUP_STOP_GRACE_S` after the first
node ended (its peers agreed to stop with it: a reclaim notice reaches every rank through the
script's all-reduced stop flag; one that failed leaves them waiting). What ended it and which
nodes were lost is the group's status; every node's instance is released and billed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..core.errors import NoCapacity, ProviderError
from ..core.offers import Offer
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..policy.offer_choice import MAX_OFFERS_TRIED
from ..providers.base import InstanceHandle, LaunchSpec, Provider, RunHandle, RunStatus
from ..settings import Settings
from .billing import release

# After the first node of a group ends, how long the others may take to end too (their last
# save, the exit barrier) before the group is ended for them: a node that failed on its own
# leaves its peers blocked in a collective, which its release ends.
GROUP_STOP_GRACE_S = 120.0
EXIT_PREEMPTED = 75  # the agent's exit after a reclaim notice (runtime/exits.py)


def members(handle: RunHandle) -> tuple[RunHandle, ...]:
    """Every node's run, node 0 first (one for a single instance)."""
    return handle.members


def instances_of(handle: RunHandle) -> list[InstanceHandle]:
    """Every node's instance, node 0 first."""
    return [m.instance for m in handle.members]


def rent_group(settings: Settings, ledger: Ledger, provider: Provider, ranked: list[Offer], nodes: int, *,
               job_id: str, attempt: int, provisioned: list[InstanceHandle]) -> tuple[list[InstanceHandle], list[dict]]:
    """`nodes` instances of the first offer whose whole group has capacity now, node 0 first,
    and the offers tried before it. Each instance is added to `provisioned` once rented (a
    failed dispatch releases and bills them); a group left incomplete is released and billed here."""
    run_id = R.run_id_for(job_id, attempt)
    tried: list[dict] = []
    for offer in ranked[:MAX_OFFERS_TRIED]:
        group: list[InstanceHandle] = []
        try:
            for rank, node_offer in enumerate(provider.group_offers(offer, nodes)):
                group.append(provider.provision(node_offer, tags={"orbit/job": job_id, "orbit/attempt": str(attempt),
                                                                  "orbit/node": str(rank)}))
                provisioned.append(group[-1])
            if len(group) == nodes:
                return group, tried
            error = f"the offer's zone holds {len(group)} of {nodes}"
        except NoCapacity as exc:
            error = str(exc)
        tried.append({"offer": offer.offer_id, "error": error, "rented": len(group)})
        for instance in group:  # all or none: what was rented of this group goes now
            release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                    checkpoints=[], lost=False, last_progress=None,
                    reason=f"group of {nodes} incomplete ({len(group)} rented): {error}"[:500])
            provisioned.remove(instance)
        ledger.commit({"events": [R.event("group_incomplete", job_id=job_id, run_id=run_id, offer=offer.offer_id,
                                          nodes=nodes, rented=[i.instance_id for i in group], reason=error[:500])]})
    if not ranked:
        raise NoCapacity("no offer fits the job's resources", provider=provider.name, retryable=False,
                         fix="widen resources (gpu, gpu_count, max price) or choose another placement")
    raise NoCapacity(f"none of the {len(tried)} best offers can rent a group of {nodes} now: "
                     f"{tried[0]['error'] if tried else ''}", provider=provider.name,
                     fix="the job is retried as an interruption; or lower resources.nodes")


def member_rows(group: list[InstanceHandle], *, job_id: str, attempt: int) -> list[dict]:
    """The ledger's record of which instance is which node of the attempt's group."""
    run_id, now = R.run_id_for(job_id, attempt), utcnow()
    return [{"run_id": run_id, "node_rank": rank, "job_id": job_id, "attempt": attempt,
             "instance_id": inst.instance_id, "offer_id": inst.offer.offer_id, "joined_at": now}
            for rank, inst in enumerate(group)]


def planned_group(settings: Settings, ledger: Ledger, provider: Provider, job_id: str,
                  attempt: int) -> list[InstanceHandle] | None:
    """The nodes the last attempt's recovery kept or rented ahead for this attempt, by rank
    (control/group_recovery.py), when every one is still up; else None. A planned group that lost
    a node meanwhile is released and billed, and the attempt rents a group anew."""
    run_id = R.run_id_for(job_id, attempt)
    rows = ledger.rows("""SELECT g.node_rank, i.handle, i.stopped_at FROM group_members g
                          JOIN instances i ON i.instance_id = g.instance_id
                          WHERE g.run_id = ? ORDER BY g.node_rank""", [run_id])
    if not rows:
        return None
    group = [InstanceHandle.model_validate_json(r["handle"]) for r in rows]
    if all(r["stopped_at"] is None for r in rows) and all(provider.instance_alive(i) for i in group):
        return group
    for instance, row in zip(group, rows):
        if row["stopped_at"] is None:
            release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                    checkpoints=[], lost=False, last_progress=None, reason="its planned group lost a node")
    with ledger.write() as tx:
        tx.execute("DELETE FROM group_members WHERE run_id = ?", [run_id])
        tx.insert("events", [R.event("group_abandoned", job_id=job_id, run_id=run_id,
                                     instances=[i.instance_id for i in group],
                                     reason="a node of the planned group was gone before the launch")])
    return None


def launch_group(provider: Provider, group: list[InstanceHandle], bundle_dir, spec: LaunchSpec, *, store_uri: str,
                 resume_uri: str | None, rdzv_id: str) -> RunHandle:
    """The attempt on every node: each its rank, its view of the store and of the checkpoint to
    resume; torchrun on each meets the others at node 0's rendezvous. Node 0's handle holds the rest."""
    endpoint = provider.rendezvous_endpoint(group[0])
    handles = []
    for rank, instance in enumerate(group):
        node_spec = spec.model_copy(update={
            "nnodes": len(group), "node_rank": rank, "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id,
            "store_uri": provider.host_store_uri(instance, store_uri),
            "resume_from": provider.stage_checkpoint(instance, resume_uri) if resume_uri else None,
            "probe": spec.probe and rank == 0})  # one probe per offer is enough
        handles.append(provider.launch(instance, bundle_dir, node_spec))
    return handles[0].model_copy(update={"nodes": tuple(handles[1:])})


def is_reclaim(status: RunStatus) -> bool:
    return status.state == "lost" or status.failure_class == "reclaim" or status.exit_code == EXIT_PREEMPTED


@dataclass
class GroupWatch:
    """The status of an attempt's group (see the module's doc): `status()` polls its nodes."""

    provider: Provider
    handle: RunHandle
    grace_s: float = GROUP_STOP_GRACE_S
    clock: Callable[[], float] = time.monotonic
    ended: dict[int, RunStatus] = field(default_factory=dict)  # node rank -> how it ended (first seen)
    first_end: float | None = None

    @property
    def lost_nodes(self) -> list[int]:
        """Ranks whose node was reclaimed or lost (a notice, or its host gone)."""
        return sorted(rank for rank, status in self.ended.items() if is_reclaim(status))

    @property
    def exited(self) -> list[int]:
        """Ranks whose workload exited by itself (none of its processes is left running)."""
        return sorted(rank for rank, status in self.ended.items() if status.state == "exited")

    def status(self) -> RunStatus:
        nodes = members(self.handle)
        running = []
        for rank, member in enumerate(nodes):
            if rank in self.ended:
                continue
            status = self.provider.status(member)
            if status.state in ("exited", "lost"):
                self.ended[rank] = status
                self.first_end = self.first_end if self.first_end is not None else self.clock()
            else:
                running.append((rank, status))
        if not running:
            return combine(self.ended, len(nodes))
        if any(s.state == "lost" for s in self.ended.values()):
            return combine(self.ended, len(nodes), stopped=[r for r, _ in running])
        if self.first_end is not None and self.clock() - self.first_end > self.grace_s:
            return combine(self.ended, len(nodes), stopped=[r for r, _ in running], late=True)
        return RunStatus(state="running" if any(s.state == "running" for _, s in running) else "starting")


def combine(ended: dict[int, RunStatus], size: int, *, stopped: list[int] = (), late: bool = False) -> RunStatus:
    """One status for the group: what its first reclaimed node says (the group stopped with it),
    else its first failed node's, else success when every node exited 0."""
    if len(ended) == size and all(s.state == "exited" and s.exit_code == 0 for s in ended.values()):
        first = ended[0]
        return RunStatus(state="exited", exit_code=0, reason=first.reason or "completed",
                         last_step=max((s.last_step for s in ended.values() if s.last_step is not None), default=None))
    rank, why = next(((r, s) for r, s in sorted(ended.items()) if is_reclaim(s)), None) or next(
        ((r, s) for r, s in sorted(ended.items()) if not (s.state == "exited" and s.exit_code == 0)),
        (None, None))
    if why is None:  # every node that ended exited 0, the rest did not end in time
        return RunStatus(state="exited", exit_code=1, failure_class="infrastructure",
                         reason=f"nodes {stopped} did not end within {GROUP_STOP_GRACE_S:.0f} s of the others")
    tail = (f"; nodes {stopped} stopped with it" + (" (they had not ended in time)" if late else "")) if stopped else ""
    if is_reclaim(why) and why.state != "lost":  # a notice: the group stopped with it, as one reclaim
        return RunStatus(state="exited", exit_code=EXIT_PREEMPTED, failure_class="reclaim",
                         reason=f"node {rank}: {why.reason}{tail}", last_step=why.last_step)
    return why.model_copy(update={"reason": f"node {rank}: {why.reason}{tail}"})


def release_group(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, **bill) -> float:
    """Stop and bill every node's instance (node 0 first); the dollars."""
    return sum(release(settings, ledger, provider, instance, **bill) for instance in instances_of(handle))


def where(handle: RunHandle, run_id: str, node: int, name: str, at: int) -> dict:
    """Which instance wrote a line of an attempt's events and, in a group, its node and the id
    its ledger event gets: named by its place, so a re-read records it once (a re-attach reads a
    group's other nodes from their start)."""
    instance = handle.members[node].instance.instance_id
    if not handle.nodes:
        return {"instance_id": instance}
    return {"instance_id": instance, "node": node, "group": run_id, "event_id": f"{name}:{run_id}:n{node}:{at}"}


def collect_nodes(provider: Provider, handle: RunHandle, dest, log: Callable[[str], None]) -> None:
    """Every node's artifacts: node 0's in `dest`, node K's in `dest/node-K`."""
    for node, member in enumerate(handle.members):
        try:
            provider.collect(member, dest / f"node-{node}" if node else dest)
        except (OSError, ProviderError) as exc:
            log(f"could not collect artifacts{f' of node {node}' if node else ''}: {exc}")
