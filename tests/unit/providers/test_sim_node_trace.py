"""The embedded market replaying an N-node trace node by node (providers/sim/node_trace.py): node
i follows the count trace's "above i" series, as `orbit simulate --group` reads the same file."""
import pytest

from orbit_dagster.catalog.traces import trace_from_dict
from orbit_dagster.core.errors import NoCapacity
from orbit_dagster.core.offers import Offer
from orbit_dagster.policy.group_replay import reclaim_at
from orbit_dagster.providers.sim.node_trace import NodeTrace, NodeTraceReclaims, StepClock, WallClock

OFFER = Offer(offer_id="sim:g1:zone-a", provider="sim", instance_type="g1", gpu="L4", gpu_count=1,
              usd_per_gpu_second_spot=0.0003)
# 60 s ticks: 3 nodes for 10 min, 2 for 10, 1 for 5, then 3
TRACE = trace_from_dict({"metadata": {"gap_seconds": 60, "cloud": "aws", "nodes": 3},
                         "data": [3] * 10 + [2] * 10 + [1] * 5 + [3] * 30}, name="three")


def test_node_i_is_up_while_the_count_is_above_i_and_a_drop_takes_the_highest_ranks():
    nodes = NodeTrace(TRACE)
    assert nodes.nodes == 3
    assert [nodes.up(r, 0.0) for r in range(3)] == [True, True, True]
    assert [nodes.up(r, 600.0) for r in range(3)] == [True, True, False]
    assert [nodes.next_down(r, 0.0) for r in range(3)] == [None, 1200.0, 600.0]
    assert nodes.next_reclaim(3, 0.0) == (600.0, (2,))
    assert nodes.next_reclaim(2, 600.0) == (1200.0, (1,))
    assert nodes.next_held(3, 600.0) == 1500.0 and nodes.next_held(2, 600.0) == 600.0
    # the lost ranks are the simulator's (policy.group_replay.reclaim_at reads the same count)
    for size, t in ((3, 0.0), (2, 600.0)):
        e, lost = nodes.next_reclaim(size, t)
        assert lost == reclaim_at(TRACE, e, size, True).lost


def test_a_node_the_zone_reclaims_within_the_notice_is_not_rented():
    nodes = NodeTrace(TRACE)
    assert nodes.refusal(2, 0.0, 120.0) is None
    # during the notice of the drop at 600 s, the zone is as it will be after it
    assert nodes.refusal(2, 480.0, 120.0) == "the zone holds 2 node(s) after the reclaim, not 3"
    assert nodes.refusal(1, 480.0, 120.0) is None
    assert nodes.refusal(2, 700.0, 120.0) == "the zone holds 2 node(s) now, not 3"


def test_the_schedule_rents_each_node_by_its_series_on_the_wall_clock():
    """On the market's clock (2 trace seconds a wall second from trace second 0 at wall 1000):
    node 2 is reclaimed when its series goes down; node 0 never in this pass; a node down is refused."""
    clock = WallClock(epoch_wall=1000.0, at_s=0.0, scale=2.0)
    schedule = NodeTraceReclaims(NodeTrace(TRACE), clock, notice_s=120.0)
    assert schedule.reclaim_at(OFFER, 1000.0, node=2) == 1300.0  # trace 600 s
    assert schedule.reclaim_at(OFFER, 1000.0, node=1) == 1600.0  # trace 1200 s
    assert schedule.reclaim_at(OFFER, 1000.0, node=0) is None
    with pytest.raises(NoCapacity, match="holds 2 node"):
        schedule.reclaim_at(OFFER, 1250.0, node=2)  # trace 500 s: inside the notice of 600 s
    assert schedule.reclaim_at(OFFER.model_copy(update={"spot": False}), 1250.0, node=2) is None


def test_the_step_clock_counts_trace_time_by_steps_at_the_group_s_pace():
    clock = StepClock(step_s=1.0, nodes=3)
    clock.session(0.0, 0, 3)
    assert clock.step_at(480.0) == 480 and clock.time_of(220) == 220.0
    clock.session(560.0, 487, 2)  # 2 of 3 nodes: 1.5 trace seconds a step
    assert clock.time_of(600) == pytest.approx(560.0 + 113 * 1.5)
    assert clock.step_at(600.0) == 487 + 27  # 26.67 steps: the next boundary
    schedule = NodeTraceReclaims(NodeTrace(TRACE), clock, notice_s=120.0)
    clock.at(480.0)  # its keeper set it at a notice: node 2 is not rented, nor reclaimed by wall time
    with pytest.raises(NoCapacity):
        schedule.reclaim_at(OFFER, 0.0, node=2)
    assert schedule.reclaim_at(OFFER, 0.0, node=1) is None
