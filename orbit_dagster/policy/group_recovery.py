"""What a group of nodes does after a reclaim of some of them (pure; docs/multi-node.md).

SkyPilot re-provisions a whole cluster when one node is preempted; the surviving nodes here
are kept instead (their instances take the next attempt's workload), and the policy chooses
between two ways on:

- `shrink` (the template is `elastic` and at least `min_nodes` survive): go on at once on the
  survivors, no instance to wait for. The checkpoint is resharded onto the smaller world
  (torch.distributed.checkpoint) and the script keeps the global batch by accumulating more
  micro-batches per rank, so it is the same optimisation problem, run more slowly;
- `replace` (not elastic, or too few survive): rent replacements for the lost nodes (while the
  reclaimed ones are still in their notice, before they go: make-before-break) and go on with
  `nodes` again, the checkpoint loaded into the same world size;
- `regroup` (nothing survives, or the provider's instances cannot take another workload): a
  whole group is rented anew by the next attempt's dispatch.

Two drivers ask it the same questions in the same order: production (`control/group_recovery.py`,
after a group's attempt ended) and the simulator (`policy/group_replay.py`, at each drop of an
N-node trace): `plan_group_recovery` from the template's size and floor, the ended group's size
and its lost and stuck ranks; then `settle`, which carries the plan out as far as the market
allows (survivors still up, replacements to be had) and falls back when it cannot.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable


@dataclass(frozen=True)
class GroupPlan:
    mode: str  # shrink | replace | regroup
    keep: tuple[int, ...]  # node ranks of the ended group kept, in their order: the next group's first ranks
    rent: int  # new nodes to rent now (replace) or by the next dispatch (regroup)
    reason: str
    inputs: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        """The next attempt's group size."""
        return len(self.keep) + self.rent


def plan_group_recovery(*, nodes: int, size: int, lost: list[int], min_nodes: int | None,
                        can_keep: bool, stuck: list[int] = ()) -> GroupPlan:
    """`nodes`: the template's group size; `size`: the ended group's; `lost`: its ranks reclaimed
    or gone; `stuck`: ranks still running when the group ended (blocked in a collective for a
    peer that vanished: they are released, never kept, so they count as lost); `min_nodes`: the
    template's elastic floor (None: not elastic); `can_keep`: whether the provider's instances
    take another workload."""
    plan = _plan(nodes=nodes, size=size, lost=sorted({*lost, *stuck}), min_nodes=min_nodes, can_keep=can_keep)
    if not stuck:
        return plan
    return replace(plan, reason=f"nodes {sorted(stuck)} were still running when the group ended (they are "
                                f"released); " + plan.reason,
                   inputs={**plan.inputs, "lost": sorted(lost), "stuck": sorted(stuck)})


def _plan(*, nodes: int, size: int, lost: list[int], min_nodes: int | None, can_keep: bool) -> GroupPlan:
    survivors = tuple(r for r in range(size) if r not in set(lost))
    inputs = {"nodes": nodes, "size": size, "lost": sorted(lost), "survivors": list(survivors),
              "min_nodes": min_nodes, "can_keep": can_keep}
    if not survivors or not can_keep:
        why = ("no node of the group survived" if not survivors else
               "this provider's instances take one workload each, so the survivors cannot go on")
        return GroupPlan("regroup", (), nodes, f"{why}: a group of {nodes} is rented anew", inputs)
    if min_nodes is not None and len(survivors) >= min_nodes:
        return GroupPlan("shrink", survivors, 0,
                         f"elastic: go on at once on the {len(survivors)} surviving node(s) (min_nodes {min_nodes}), "
                         "the checkpoint resharded onto the smaller world and the global batch kept by gradient "
                         "accumulation", inputs)
    why = (f"only {len(survivors)} node(s) survive, fewer than elastic.min_nodes {min_nodes}" if min_nodes is not None
           else "the template is not elastic")
    rent = max(nodes - len(survivors), 0)
    return GroupPlan("replace", survivors, rent,
                     f"{why}: {rent} replacement(s) rented before the reclaimed node(s) go, the {len(survivors)} "
                     f"survivor(s) kept, and the job goes on with {len(survivors) + rent} nodes", inputs)


def settle(plan: GroupPlan, *, nodes: int, min_nodes: int | None, survivors_up: bool,
           rent: Callable[[int], str | None]) -> GroupPlan:
    """The plan as the market lets it be carried out. `survivors_up`: every node the plan keeps is
    still up; `rent(n)` rents the plan's n replacements (all or none) and returns None, or why it
    could not. A survivor gone: regroup. No replacement to be had: shrink if the elastic floor
    allows, else regroup. Production rents from its provider; the simulator asks its trace."""
    if plan.keep and not survivors_up:
        return fall_back(plan, nodes=nodes, min_nodes=min_nodes, why="a survivor was gone before it could be kept",
                         shrink=False)
    if plan.mode == "replace" and plan.rent:
        failed = rent(plan.rent)
        if failed is not None:
            return fall_back(plan, nodes=nodes, min_nodes=min_nodes,
                             why=f"no replacement could be rented ({failed})", shrink=True)
    return plan


def fall_back(plan: GroupPlan, *, nodes: int, min_nodes: int | None, why: str, shrink: bool) -> GroupPlan:
    """The plan when its own cannot be had: the survivors alone if the elastic floor allows
    (`shrink`: they are all up), else a group rented anew."""
    if shrink and plan.mode == "replace" and min_nodes is not None and len(plan.keep) >= min_nodes:
        return GroupPlan("shrink", plan.keep, 0, f"{why}: elastic, so it goes on on the {len(plan.keep)} survivor(s)",
                         plan.inputs)
    return GroupPlan("regroup", (), nodes, f"{why}: a group is rented anew", plan.inputs)
