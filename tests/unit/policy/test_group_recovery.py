"""After a reclaim of some nodes of a group: shrink, replace or regroup (policy.group_recovery)."""
import pytest

from orbit_dagster.policy.group_recovery import plan_group_recovery


@pytest.mark.parametrize("kw, mode, keep, rent", [
    # elastic down to 1: the survivor goes on alone, nothing rented
    ({"nodes": 2, "size": 2, "lost": [1], "min_nodes": 1, "can_keep": True}, "shrink", (0,), 0),
    ({"nodes": 4, "size": 4, "lost": [0, 2], "min_nodes": 2, "can_keep": True}, "shrink", (1, 3), 0),
    # too few survive for the floor, or not elastic: the lost ones are replaced
    ({"nodes": 4, "size": 4, "lost": [0, 2], "min_nodes": 3, "can_keep": True}, "replace", (1, 3), 2),
    ({"nodes": 2, "size": 2, "lost": [0], "min_nodes": None, "can_keep": True}, "replace", (1,), 1),
    # a group that had shrunk grows back to the template's size when it is replaced
    ({"nodes": 3, "size": 2, "lost": [1], "min_nodes": 2, "can_keep": True}, "replace", (0,), 2),
    # nothing survives, or the provider's instances take one workload: a group anew
    ({"nodes": 2, "size": 2, "lost": [0, 1], "min_nodes": 1, "can_keep": True}, "regroup", (), 2),
    ({"nodes": 2, "size": 2, "lost": [1], "min_nodes": 1, "can_keep": False}, "regroup", (), 2),
])
def test_the_plan_follows_the_elastic_floor_and_what_survives(kw, mode, keep, rent):
    plan = plan_group_recovery(**kw)
    assert (plan.mode, plan.keep, plan.rent) == (mode, keep, rent)
    assert plan.size == len(keep) + rent and plan.reason
    assert plan.inputs["lost"] == sorted(kw["lost"]) and plan.inputs["survivors"] == [
        r for r in range(kw["size"]) if r not in kw["lost"]]


def test_each_reason_says_why():
    assert "min_nodes 1" in plan_group_recovery(nodes=2, size=2, lost=[1], min_nodes=1, can_keep=True).reason
    assert "fewer than elastic.min_nodes 2" in plan_group_recovery(nodes=2, size=2, lost=[1], min_nodes=2,
                                                                   can_keep=True).reason
    assert "not elastic" in plan_group_recovery(nodes=2, size=2, lost=[1], min_nodes=None, can_keep=True).reason
    assert "one workload each" in plan_group_recovery(nodes=2, size=2, lost=[1], min_nodes=1, can_keep=False).reason
