"""A group's attempt ended with some of its nodes reclaimed or lost: what goes on, and the bill.

The policy (`policy.group_recovery`) chooses from the template's `elastic` and whether the
provider's instances take another workload: shrink onto the survivors, replace the lost nodes,
or regroup. Carried out here, once per attempt (the decision row is the claim, so a second
process that finishes the same attempt changes nothing):

1. replacements are rented first, while the reclaimed nodes are still in their notice
   (make-before-break), of the survivors' offer (one shape, one zone); none to be had: the job
   shrinks if its elastic floor allows, else regroups;
2. each survivor's seconds so far are billed to this attempt (`billing.carry_over`) and it
   becomes a node of the next attempt's group, recorded in `group_members` under the next
   run with its new rank (survivors first, in their order, then the replacements): dispatch
   launches the next attempt there (`group.planned_group`);
3. every other node of the group is released and billed (lost: the work after the last
   checkpoint is waste).
The decision (`decisions`, kind `group_recovery`) and a `group_interrupted` event name the
lost nodes, the group and the reason.
"""
from __future__ import annotations

import json
from datetime import datetime

from ..core.costs import Bought
from ..core.errors import NoCapacity
from ..core.templates import TaskTemplate
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..policy.group_recovery import GroupPlan, plan_group_recovery, settle
from ..providers.base import InstanceHandle, Provider, RunHandle
from ..settings import Settings
from .billing import carry_over, instance_row, release
from .group import GroupWatch, member_rows


def recover_group(settings: Settings, ledger: Ledger, provider: Provider, handle: RunHandle, *,
                  template: TaskTemplate, job_id: str, attempt: int, watch: GroupWatch,
                  checkpoints: list[Bought], last_progress: datetime | None, reason: str) -> float:
    """Plan and carry out what follows a group's reclaim (the module's doc); the dollars billed
    to this attempt's nodes. A survivor whose ranks were still running when the group ended
    (`watch`: blocked in a collective for a peer that vanished) is released with the rest,
    which ends them, and never kept."""
    run_id, next_run = R.run_id_for(job_id, attempt), R.run_id_for(job_id, attempt + 1)
    members, lost_nodes = handle.members, watch.lost_nodes
    plan = plan_group_recovery(**group_inputs(template, watch, size=len(members), provider=provider))
    decision_id = f"group_recovery:{run_id}"
    with ledger.write() as tx:  # the claim: one process carries the plan out
        claimed = tx.insert("decisions", [{"decision_id": decision_id, "job_id": job_id, "attempt": attempt,
                                           "kind": "group_recovery", "chosen": plan.mode, "runner_up": None,
                                           "inputs": R.dumps({"reason": plan.reason, **plan.inputs}), "ts": utcnow()}])
    usd = 0.0
    if claimed:
        plan, replacements, done = _carry_out(settings, ledger, provider, members, plan, template, job_id=job_id,
                                              attempt=attempt, checkpoints=checkpoints, last_progress=last_progress)
        usd += done
        _record(ledger, plan, members, replacements, decision_id=decision_id, job_id=job_id, run_id=run_id,
                next_run=next_run, attempt=attempt, lost_nodes=lost_nodes, reason=reason)
    for member in members:  # the rest of the group (not carried into the next attempt) goes
        if ledger.scalar("SELECT run_id FROM instances WHERE instance_id = ?", [member.instance.instance_id]) in (
                run_id, None):
            usd += release(settings, ledger, provider, member.instance, job_id=job_id, run_id=run_id, attempt=attempt,
                           checkpoints=checkpoints, lost=True, last_progress=last_progress,
                           reason=f"attempt ended: LOST ({reason})"[:500])
    return usd


def group_inputs(template: TaskTemplate, watch: GroupWatch, *, size: int, provider: Provider) -> dict:
    """What production tells the policy about an ended group (the simulator's replay tells it the
    same: policy/group_replay.py): the template's size and elastic floor, the ended group's size,
    its lost ranks, the ranks still running when it ended (`stuck`), and whether the provider's
    instances take another workload."""
    lost = watch.lost_nodes
    return {"nodes": template.resources.nodes, "size": size, "lost": lost,
            "stuck": [r for r in range(size) if r not in lost and r not in watch.exited],
            "min_nodes": template.elastic.min_nodes if template.elastic else None,
            "can_keep": bool(getattr(provider, "relaunch", False))}


def _carry_out(settings: Settings, ledger: Ledger, provider: Provider, members: tuple[RunHandle, ...],
               plan: GroupPlan, template: TaskTemplate, *, job_id: str, attempt: int,
               checkpoints: list[Bought],
               last_progress: datetime | None) -> tuple[GroupPlan, list[InstanceHandle], float]:
    """Rent the replacements (first), then carry the survivors over; a plan that cannot be had
    falls back (shrink if elastic allows, else regroup), saying so (`policy.group_recovery.settle`)."""
    run_id, next_run = R.run_id_for(job_id, attempt), R.run_id_for(job_id, attempt + 1)
    keep = [members[r].instance for r in plan.keep]
    replacements: list[InstanceHandle] = []

    def rent(count: int) -> str | None:
        try:
            for rank, offer in enumerate(provider.group_offers(keep[0].offer, len(keep) + count)[len(keep):],
                                         len(keep)):
                replacements.append(provider.provision(offer, tags={"orbit/job": job_id,
                                                                    "orbit/attempt": str(attempt + 1),
                                                                    "orbit/node": str(rank),
                                                                    "orbit/replaces": run_id}))
            if len(replacements) < count:
                raise NoCapacity(f"the survivors' zone holds {len(replacements)} more node(s), not {count}",
                                 provider=provider.name)
        except NoCapacity as exc:
            for instance in replacements:  # all or none, as a group's rental
                release(settings, ledger, provider, instance, job_id=job_id, run_id=next_run, attempt=attempt + 1,
                        checkpoints=[], lost=False, last_progress=None, reason=f"replacement not needed: {exc}"[:500])
            replacements.clear()
            return str(exc)
        return None

    floor = template.elastic.min_nodes if template.elastic else None
    plan = settle(plan, nodes=template.resources.nodes, min_nodes=floor,
                  survivors_up=all(provider.instance_alive(i) for i in keep), rent=rent)
    keep = [members[r].instance for r in plan.keep]
    if replacements:
        ledger.commit({"instances": [instance_row(i, "train", job_id, next_run) for i in replacements]})
    usd = 0.0
    for instance in keep if plan.mode != "regroup" else []:
        usd += carry_over(ledger, instance, job_id=job_id, run_id=run_id, attempt=attempt, next_run=next_run,
                          checkpoints=checkpoints, lost=True, last_progress=last_progress)
    if plan.mode != "regroup":
        ledger.commit({"group_members": member_rows(keep + replacements, job_id=job_id, attempt=attempt + 1)})
    return plan, replacements, usd


def _record(ledger: Ledger, plan: GroupPlan, members: tuple[RunHandle, ...], replacements: list[InstanceHandle], *,
            decision_id: str, job_id: str, run_id: str, next_run: str, attempt: int, lost_nodes: list[int],
            reason: str) -> None:
    """The decision as carried out, and the interruption: which nodes of which group."""
    lost = [{"node": r, "instance_id": members[r].instance.instance_id} for r in lost_nodes]
    deadlines = [json.loads(row["detail"]).get("deadline") for row in ledger.rows(
        "SELECT detail FROM events WHERE run_id = ? AND kind = 'host_notice' ORDER BY ts", [run_id])]
    inputs = {"reason": plan.reason, **plan.inputs, "lost": lost, "next_run": next_run,
              "next_group": [members[r].instance.instance_id for r in plan.keep] + [i.instance_id for i in replacements]
              if plan.mode != "regroup" else None,
              "replacements": [{"instance_id": i.instance_id, "started_at": i.started_at.timestamp()}
                               for i in replacements],
              # make-before-break: the replacements were up before the reclaimed nodes' notices ran out
              "notice_deadlines": [d for d in deadlines if d is not None]}
    with ledger.write() as tx:
        tx.execute("UPDATE decisions SET chosen = ?, inputs = ? WHERE decision_id = ?",
                   [plan.mode, R.dumps(inputs), decision_id])
        tx.insert("events", [R.event("group_interrupted", job_id=job_id, run_id=run_id, group=run_id, lost=lost,
                                     size=len(members), plan=plan.mode, next_size=plan.size if plan.mode != "regroup"
                                     else None, reason=reason[:500], event_id=f"group_interrupted:{run_id}")])


def release_planned(settings: Settings, ledger: Ledger, provider: Provider, job_id: str, attempt: int) -> float:
    """The nodes kept or rented for an attempt that will not run (its job failed or was
    cancelled meanwhile): released and billed to the attempt that kept them."""
    usd = 0.0
    for row in ledger.rows("""SELECT i.handle FROM group_members g JOIN instances i ON i.instance_id = g.instance_id
                              WHERE g.run_id = ? AND i.stopped_at IS NULL""", [R.run_id_for(job_id, attempt)]):
        usd += release(settings, ledger, provider, InstanceHandle.model_validate_json(row["handle"]), job_id=job_id,
                       run_id=R.run_id_for(job_id, attempt), attempt=attempt, checkpoints=[], lost=False,
                       last_progress=None, reason="its attempt will not run")
    return usd
