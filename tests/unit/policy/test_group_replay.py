"""The simulator's group of nodes (policy.group_replay): an N-node trace's drops are reclaims of
some of the group's nodes, decided by the group policy production runs."""
from __future__ import annotations

import json

import pytest

from orbit_dagster.cli.commands import main
from orbit_dagster.policy.checkpointing import FixedInterval
from orbit_dagster.policy.group_recovery import GroupPlan, fall_back, plan_group_recovery, settle
from orbit_dagster.policy.group_replay import replay_group
from orbit_dagster.policy.simulate import replay
from tests.unit.policy.helpers import GROUP_GAP, GROUP_RUNS, group_job, group_trace

GAP, RUNS = GROUP_GAP, GROUP_RUNS
trace, job = group_trace, group_job


def decisions(res) -> list[tuple]:
    return [(d["at_s"], d["size"], tuple(d["lost"]), d["planned"], d["mode"], d["next_size"])
            for d in res.extra["group_decisions"]]


def test_elastic_shrinks_on_a_partial_reclaim_and_regroups_below_the_floor():
    res = replay_group(trace(), FixedInterval(1800.0, uses_notice=True), job(), min_nodes=2)
    assert res.finished
    assert decisions(res) == [
        (7200.0, 3, (2,), "shrink", "shrink", 2),  # 3 -> 2: go on at once on the two survivors
        (10800.0, 2, (1,), "replace", "regroup", 3),  # 2 -> 1: below the floor, no room: a group anew
        (19800.0, 3, (2,), "shrink", "shrink", 2),
    ]
    d = res.extra["group_decisions"]
    assert all(x["emergency_checkpoint"] and x["released_at"] <= x["at_s"] for x in d)  # within the notice
    # named by the first node it cannot rent (node rank 1, the second), as the embedded market names it
    assert "the zone holds 1 node(s) after the reclaim, not 2" in d[1]["reason"]
    # the accounts add up, seconds counted as a share of the whole group
    parts = res.useful_s + res.checkpoint_s + res.restart_s + res.wasted_s + res.in_flight_s
    assert res.paid_s == pytest.approx(parts) and res.useful_s == pytest.approx(6 * 3600.0)


def test_a_shrunk_group_trains_at_its_share_of_the_pace_and_pays_for_its_nodes_only():
    """One drop 3 -> 2 and nothing else: the survivors need 3/2 of the remaining work's seconds,
    and are billed for 2 nodes."""
    t = trace(((3, 60), (2, 1000)))
    res = replay_group(t, FixedInterval(10.0 ** 9, uses_notice=True), job(work_s=7200.0), min_nodes=2)
    (d,) = res.extra["group_decisions"]
    left = 7200.0 - d["durable_s"]
    assert d["mode"] == "shrink" and res.finished
    assert res.wall_s == pytest.approx(d["released_at"] + 300.0 + left * 3 / 2 + 60.0)  # restore, work, final save
    assert res.cost_usd == pytest.approx((3 * d["released_at"] + 2 * (res.wall_s - d["released_at"])) / 3600.0)


def test_every_completed_save_is_listed_with_the_work_it_holds_on_the_trace_clock():
    """The saves `extra["group_checkpoints"]` lists (what the end-to-end comparison reads): the
    periodic ones every interval of session time, the emergency one at the notice (when its save
    fits between the notice and the reclaim at the 1.5 margin), then the shrunk group's, its
    work counted at 2/3 of the pace."""
    t = trace(((3, 10), (2, 1000)))  # 3 nodes for 600 s, then 2
    params = job(work_s=900.0, save_s=0.0, emergency_save_s=80.0, restore_s=0.0)
    res = replay_group(t, FixedInterval(220.0, uses_notice=True), params, min_nodes=2)
    saves = [(c["at_s"], round(c["work_s"], 6), c["tier"], c["size"]) for c in res.extra["group_checkpoints"]]
    # 480 s: the notice (600 - 120), the emergency save 80 s long; the survivors go on at 560 s,
    # 420 s of the group's work left at 2/3 of the pace (630 s), saving every 220 s of their time
    assert saves == [(220.0, 220.0, "durable", 3), (440.0, 440.0, "durable", 3), (480.0, 480.0, "emergency", 3),
                     (780.0, round(480.0 + 220.0 * 2 / 3, 6), "durable", 2),
                     (1000.0, round(480.0 + 440.0 * 2 / 3, 6), "durable", 2), (1190.0, 900.0, "durable", 2)]
    assert res.finished and res.checkpoints + res.emergency_checkpoints == len(saves)


def test_not_elastic_on_a_count_trace_is_the_gang_replay():
    """No replacement is ever there at the reclaim (the count just fell), so a group that is not
    elastic is rented anew each time: exactly the gang replay behind `orbit simulate`."""
    group = replay_group(trace(), FixedInterval(1800.0, uses_notice=True), job(), min_nodes=None)
    gang = replay(trace(), FixedInterval(1800.0, uses_notice=True), job())
    assert {d["mode"] for d in group.extra["group_decisions"]} == {"regroup"}
    assert {d["planned"] for d in group.extra["group_decisions"]} == {"replace"}
    for k in ("finished", "wall_s", "paid_s", "useful_s", "wasted_s", "cost_usd", "reclaims", "checkpoints"):
        assert getattr(group, k) == pytest.approx(getattr(gang, k)), k


def test_without_a_notice_the_survivors_were_stuck_and_the_group_is_rented_anew():
    res = replay_group(trace(), FixedInterval(1800.0, uses_notice=True), job(notice_s=0.0), min_nodes=2)
    first = res.extra["group_decisions"][0]
    assert (first["lost"], first["stuck"], first["mode"]) == ([2], [0, 1], "regroup")
    assert "were still running when the group ended" in first["reason"]


def test_settle_falls_back_when_the_market_cannot_carry_the_plan_out():
    plan = plan_group_recovery(nodes=3, size=3, lost=[1], min_nodes=None, can_keep=True)
    asked = []
    assert settle(plan, nodes=3, min_nodes=None, survivors_up=True, rent=lambda n: asked.append(n)) == plan
    assert asked == [1]
    gone = settle(plan, nodes=3, min_nodes=None, survivors_up=False, rent=lambda n: None)
    assert (gone.mode, gone.size) == ("regroup", 3) and "a survivor was gone" in gone.reason
    short = settle(plan, nodes=3, min_nodes=None, survivors_up=True, rent=lambda n: "no capacity")
    assert short.mode == "regroup" and "no replacement could be rented (no capacity)" in short.reason
    kept = fall_back(GroupPlan("replace", (0, 2), 1, "r"), nodes=3, min_nodes=2, why="w", shrink=True)
    assert (kept.mode, kept.keep) == ("shrink", (0, 2))


def test_orbit_simulate_group_prints_each_decision(tmp_path, capsys):
    path = tmp_path / "three.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": GAP, "cloud": "aws", "nodes": 3},
                                "data": [v for v, n in RUNS for _ in range(n)]}))
    main(["simulate", "--trace", str(path), "--group", "--min-nodes", "2", "--job-hours", "6", "--starts", "1"])
    out = capsys.readouterr().out
    assert "a group of 3 node(s), elastic down to 2" in out and "orbit, group policy" in out
    assert "3 -> lost [2]: shrink, next 2 node(s)" in out
    main(["simulate", "--trace", str(path), "--group", "--job-hours", "6", "--starts", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "group" and doc["min_nodes"] is None
    assert {d["mode"] for d in doc["decisions"]} == {"regroup"}
