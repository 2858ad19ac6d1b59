"""One node of a group on its host (runtime/group.py): torchrun's rendezvous arguments, the agent's
group options, and node 0 putting a checkpoint together from every node's part."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from orbit_dagster.core.process_tree import children
from orbit_dagster.runtime import group
from orbit_dagster.runtime.agent import node_group, parse_args
from orbit_dagster.runtime.command import torchrun_argv
from orbit_dagster.runtime.watcher import Found
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest

NODE1 = group.NodeGroup(nnodes=2, node_rank=1, endpoint="10.0.0.5:29400", rdzv_id="job#3", wait_s=1.0)


def test_a_node_meets_the_others_at_node_0s_c10d_rendezvous():
    argv = torchrun_argv(["python", "train.py", "--x"], 1, NODE1)
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "10.0.0.5:29400", "--rdzv-id", "job#3", "--rdzv-conf", "is_host=false",
                    "--nproc-per-node", "1", "train.py", "--x"]
    assert "is_host=true" in torchrun_argv(["python", "t.py"], 2, group.NodeGroup(2, 0, "h:1", "r"))


def test_the_agent_takes_the_group_from_its_argv_and_refuses_half_of_one(capsys):
    args = parse_args(["b", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.5:29400",
                       "--rdzv-id", "job#3", "--group-wait", "1"])
    assert node_group(args) == NODE1
    assert node_group(parse_args(["b"])) is None
    for bad in (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "r"],
                ["--nnodes", "2", "--node-rank", "1", "--rdzv-id", "r"]):
        with pytest.raises(SystemExit):
            parse_args(["b", *bad])
    assert "--nnodes > 1 needs" in capsys.readouterr().err


def test_the_ranks_are_torchruns_children():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                               "print(c.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert children(parent.pid) == [child]
        assert children(child) == []
    finally:
        os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()


def part(tmp_path, store, rank: int, tier: str, files: dict[str, bytes], nodes: int = 2,
         notice: tuple = (None, None)) -> None:
    d = tmp_path / f"host{rank}" / "ckpt_40"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    node = group.NodeGroup(nodes, rank, "h:1", "r")
    group.store_part(store, "job", 1, node, Found(d, 40, "dir"), {n: d / n for n in files}, tier,
                     "metadata" if tier == "emergency" else None, notice)


def test_node_0_puts_every_nodes_part_together_and_a_missing_part_leaves_the_step_unregistered(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    part(tmp_path, store, 1, "emergency", {"__1_0.distcp": b"rank 1"})
    node0 = group.NodeGroup(2, 0, "h:1", "r", wait_s=1.0)
    parts = group.gather(store, "job", 1, 40, node0, tmp_path / "staging")
    own = tmp_path / "host0" / "ckpt_40"
    own.mkdir(parents=True)
    (own / ".metadata").write_bytes(b"plan")
    (own / "__0_0.distcp").write_bytes(b"rank 0")
    files, tier, source = group.union({n: own / n for n in (".metadata", "__0_0.distcp")}, parts, "durable", None)
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert files["__1_0.distcp"].read_bytes() == b"rank 1"
    assert (tier, source) == ("emergency", "metadata")  # node 1's notice stopped the group
    group.drop_parts(store, "job", 1, 40, node0)
    assert not (tmp_path / "store" / "job" / "step-000000040-a1.node1").exists()
    assert list(store.list("job")) == []  # a part is never listed as a checkpoint
    began = time.monotonic()
    assert group.gather(store, "job", 1, 40, node0, tmp_path / "staging") is None  # its part is gone
    assert time.monotonic() - began >= 1.0


def test_a_part_is_stored_with_what_node_0_needs(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    part(tmp_path, store, 1, "durable", {"__1_0.distcp": b"rank 1"})
    m = store.read_manifest(store.uri_for("job", group.part_name(40, 1, 1)))
    assert isinstance(m, CheckpointManifest) and (m.step, m.tier, m.attempt) == (40, "durable", 1)
    assert m.meta["group_part"] == 1 and m.meta["name"] == "ckpt_40" and set(m.files) == {"__1_0.distcp"}


def test_the_group_s_notice_is_its_first_node_s_and_its_deadline_the_earliest(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    part(tmp_path, store, 1, "emergency", {"__1_0.distcp": b"1"}, nodes=3, notice=(1000.0, 1120.0))
    part(tmp_path, store, 2, "emergency", {"__2_0.distcp": b"2"}, nodes=3, notice=(999.5, None))  # a SIGTERM: no deadline
    parts = group.gather(store, "job", 1, 40, group.NodeGroup(3, 0, "h:1", "r", wait_s=1.0), tmp_path / "staging")
    assert group.earliest_notice(parts, (None, None)) == (999.5, 1120.0)
    assert group.earliest_notice(parts, (1001.0, 1100.0)) == (999.5, 1100.0)  # node 0's own deadline is sooner
    assert group.earliest_notice([], (None, None)) == (None, None)  # no node had one
    for m, _ in parts:  # a part's manifest from elsewhere: no number, no notice taken from it
        m.meta.update(notice_at="soon", deadline=float("nan"))
    assert group.earliest_notice(parts, (None, None)) == (None, None)
