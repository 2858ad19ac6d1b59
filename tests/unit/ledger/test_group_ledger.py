"""The ledger's record of a group of nodes (migration 9): which instance is which node, each
node's bill per attempt (a node kept after another's reclaim is billed per attempt), and the
per-node cost view summing to the bill."""
from __future__ import annotations

import math
import sqlite3
import time
from datetime import datetime, timedelta, timezone

from orbit_dagster.control.billing import carry_over, instance_row, release
from orbit_dagster.control.group import member_rows
from orbit_dagster.core.offers import Offer
from orbit_dagster.ledger import Ledger
from orbit_dagster.ledger.migrations import LATEST, current_version, upgrade_schema
from orbit_dagster.providers.base import InstanceHandle, InstanceTimes
from orbit_dagster.settings import Settings

OFFER = Offer(offer_id="sim:x:z", provider="sim", instance_type="x", gpu="L4", gpu_count=1,
              usd_per_gpu_second_spot=0.001)


class Meter:
    """A provider's meter: started when made, stopped by terminate."""

    def __init__(self):
        self.stopped: dict[str, datetime] = {}

    def instance_alive(self, instance):
        return instance.instance_id not in self.stopped

    def terminate(self, instance, reason):  # noqa: ARG002
        self.stopped[instance.instance_id] = datetime.now(timezone.utc)
        return self.instance_times(instance)

    def instance_times(self, instance):
        return InstanceTimes(started_at=instance.started_at, stopped_at=self.stopped.get(instance.instance_id))


def test_migration_9_gives_an_older_ledger_the_group_table_and_the_node_view(tmp_path):
    url = f"sqlite:///{tmp_path / 'l' / 'ledger.sqlite'}"
    upgrade_schema(Ledger(url))
    con = sqlite3.connect(tmp_path / "l" / "ledger.sqlite")  # as version 8 left it
    con.execute("DROP VIEW cost_by_node")
    con.execute("DROP TABLE group_members")
    con.execute("DELETE FROM schema_migrations WHERE version >= 9")
    con.commit()
    con.close()
    reopened = Ledger(url)
    assert upgrade_schema(reopened) == 8 and current_version(reopened) == LATEST
    assert reopened.scalar("SELECT count(*) FROM group_members") == 0
    assert reopened.scalar("SELECT count(*) FROM cost_by_node") == 0


def test_a_kept_node_is_billed_per_attempt_and_the_node_lines_sum_to_the_bill(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    settings, meter = Settings.from_env(orbit_home), Meter()
    start = datetime.now(timezone.utc) - timedelta(seconds=30)
    nodes = [InstanceHandle(provider="sim", instance_id=f"i{k}", offer=OFFER, started_at=start) for k in range(2)]
    ledger.commit({"instances": [instance_row(i, "train", "j", "j#1") for i in nodes],
                   "group_members": member_rows(nodes, job_id="j", attempt=1),
                   "checkpoints": [{"checkpoint_key": "j/a1/40", "job_id": "j", "run_id": "j#1", "attempt": 1,
                                    "step": 40, "created_at": start + timedelta(seconds=20)}]})
    ckpts = [(start + timedelta(seconds=20), "j/a1/40")]
    # Node 1 reclaimed: released (lost); node 0 goes on into attempt 2, as node 0 again.
    release(settings, ledger, meter, nodes[1], job_id="j", run_id="j#1", attempt=1, checkpoints=ckpts, lost=True,
            last_progress=start + timedelta(seconds=20), reason="reclaimed")
    first = carry_over(ledger, nodes[0], job_id="j", run_id="j#1", attempt=1, next_run="j#2", checkpoints=ckpts,
                       lost=True, last_progress=start + timedelta(seconds=25))
    assert first > 0 and carry_over(ledger, nodes[0], job_id="j", run_id="j#1", attempt=1, next_run="j#2",
                                    checkpoints=ckpts, lost=True, last_progress=None) == 0.0  # once
    assert ledger.scalar("SELECT run_id FROM instances WHERE instance_id = 'i0'") == "j#2"
    ledger.commit({"group_members": member_rows([nodes[0]], job_id="j", attempt=2)})
    time.sleep(0.05)
    release(settings, ledger, meter, nodes[0], job_id="j", run_id="j#2", attempt=2, checkpoints=[], lost=False,
            last_progress=None, reason="attempt ended")
    lines = ledger.rows("SELECT * FROM cost_by_node ORDER BY attempt, node_rank")
    assert [(r["attempt"], r["node_rank"], r["instance_id"]) for r in lines] == [(1, 0, "i0"), (1, 1, "i1"),
                                                                                  (2, 0, "i0")]
    billed = ledger.scalar("SELECT sum(billed_usd) FROM instances")
    assert math.isclose(sum(r["usd"] for r in lines), billed, rel_tol=1e-9)
    assert math.isclose(ledger.scalar("SELECT billed_usd FROM instances WHERE instance_id = 'i0'"),
                        (meter.stopped["i0"] - start).total_seconds() * OFFER.usd_per_second, rel_tol=1e-9)
    node1 = lines[1]  # its work after the checkpoint, to its last step, was lost with the group
    assert node1["wasted_seconds"] == 0 and lines[0]["wasted_seconds"] > 4  # 20 s -> 25 s on node 0
    segments = ledger.rows("SELECT start_at, end_at FROM costs WHERE instance_id = 'i0' ORDER BY start_at")
    assert all(math.isclose(a["end_at"], b["start_at"]) for a, b in zip(segments, segments[1:]))  # no gap, no overlap
