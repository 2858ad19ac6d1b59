"""A group of nodes followed as one run (control/group.py): when it ends, what its status says,
which nodes were lost; and a group's handle stored beside a single instance's."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from orbit_dagster.control.group import GroupWatch, combine
from orbit_dagster.core.offers import Offer
from orbit_dagster.providers.base import InstanceHandle, RunHandle, RunStatus

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
OFFER = Offer(offer_id="sim:x:z", provider="sim", instance_type="x", gpu="L4", gpu_count=1)


def handle(n: int) -> RunHandle:
    runs = [RunHandle(provider="sim", instance=InstanceHandle(provider="sim", instance_id=f"i{k}", offer=OFFER,
                                                              started_at=NOW), run_ref=f"r{k}", launched_at=NOW)
            for k in range(n)]
    return runs[0].model_copy(update={"nodes": tuple(runs[1:])})


RUNNING = RunStatus(state="running")
OK = RunStatus(state="exited", exit_code=0, reason="completed", last_step=40)
NOTICED = RunStatus(state="exited", exit_code=75, failure_class="reclaim", reason="reclaim notice", last_step=40)
GONE = RunStatus(state="lost", failure_class="reclaim", reason="host lost (no heartbeat)")
FAILED = RunStatus(state="exited", exit_code=1, failure_class="user_error", reason="the script's exit 1")


class Scripted:
    """Each node's status, as the test sets it."""

    def __init__(self, statuses: dict[str, RunStatus]):
        self.statuses = statuses

    def status(self, run: RunHandle) -> RunStatus:
        return self.statuses[run.run_ref]


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_single_instance_handle_is_stored_as_before_and_a_group_round_trips():
    one = handle(1)
    assert "nodes" not in one.model_dump_json() and one.members == (one,)
    group = handle(3)
    back = RunHandle.model_validate_json(group.model_dump_json())
    assert back == group and [m.run_ref for m in back.members] == ["r0", "r1", "r2"]
    assert back.members[0].nodes == () and back.instance.instance_id == "i0"


def test_a_noticed_node_ends_the_group_once_the_others_stopped_at_its_step():
    provider, clock = Scripted({"r0": RUNNING, "r1": NOTICED}), Clock()
    watch = GroupWatch(provider, handle(2), clock=clock)
    assert watch.status().state == "running"  # node 0 is still saving with it
    provider.statuses["r0"] = OK
    provider.statuses["r1"] = GONE  # later reclaimed for good: how it ended first is what counts
    status = watch.status()
    assert (status.state, status.exit_code, status.failure_class) == ("exited", 75, "reclaim")
    assert status.reason.startswith("node 1: reclaim notice") and watch.lost_nodes == [1]


def test_a_node_gone_without_notice_ends_the_group_at_once():
    watch = GroupWatch(Scripted({"r0": RUNNING, "r1": RUNNING, "r2": GONE}), handle(3), clock=Clock())
    status = watch.status()
    assert (status.state, status.failure_class) == ("lost", "reclaim")
    assert "node 2" in status.reason and "nodes [0, 1] stopped with it" in status.reason
    assert watch.lost_nodes == [2]


def test_a_node_that_failed_ends_the_group_after_the_grace_with_its_class():
    provider, clock = Scripted({"r0": RUNNING, "r1": FAILED}), Clock()
    watch = GroupWatch(provider, handle(2), grace_s=60, clock=clock)
    assert watch.status().state == "running"  # node 1 seen ended at 0: node 0 may still be saving
    clock.t = 59
    assert watch.status().state == "running"
    clock.t = 61
    status = watch.status()
    assert (status.state, status.exit_code, status.failure_class) == ("exited", 1, "user_error")
    assert "node 1: the script's exit 1" in status.reason and "had not ended in time" in status.reason
    assert watch.lost_nodes == []


def test_every_node_done_is_success():
    status = GroupWatch(Scripted({"r0": OK, "r1": OK}), handle(2), clock=Clock()).status()
    assert (status.state, status.exit_code, status.last_step) == ("exited", 0, 40)


@pytest.mark.parametrize("ended, words", [({0: OK}, "did not end"), ({0: FAILED, 1: NOTICED}, "node 1")])
def test_combine_names_the_node_that_stopped_the_group(ended, words):
    assert words in combine(ended, 2, stopped=[1] if len(ended) == 1 else []).reason
