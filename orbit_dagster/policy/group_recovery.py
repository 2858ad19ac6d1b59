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
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
                        can_keep: bool) -> GroupPlan:
    """`nodes`: the template's group size; `size`: the ended group's; `lost`: its ranks reclaimed
    or gone; `min_nodes`: the template's elastic floor (None: not elastic); `can_keep`: whether
    the provider's instances take another workload."""
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
