"""Two hosts' agents, 2 ranks each, meeting at a c10d rendezvous on loopback (runtime/group.py),
without the control plane: a SIGTERM to node 1's agent (a notice) stops all 4 ranks at one step,
every rank saves its shard, node 0 reports the union of every node's shards on its disk, then
stores it as the one checkpoint (emergency), and nothing is left running on either host."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.process_tree import RUN_TAG
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.storage import open_store
from tests.helpers import wait_for

JOB = "job-group"


def events(workdir: Path) -> list[dict]:
    path = workdir / "artifacts" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_tags() -> set[str]:
    """The run tags of this job's runs in the environment of any live process."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found |= {e.split(b"=", 1)[1].decode() for e in env if e.startswith(RUN_TAG.encode() + b"=" + JOB.encode())}
    return found


@pytest.mark.timeout(300)
def test_a_notice_on_one_node_stops_all_four_ranks_at_one_sharded_emergency_checkpoint(orbit_home):
    tmp_path = orbit_home / "hosts"  # under the test's home: whatever a failure leaves is killed with it
    tmp_path.mkdir(parents=True)
    t = apply_overrides(load_template("fsdp-multinode"), {"config.steps": 5000, "checkpoint.every_steps": 1000,
                                                         "resources.processes": 2})
    bundle = build_bundle(t, TaskSubmission(template=t.name), JOB, tmp_path / "bundle")
    store = tmp_path / "store"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    agents = []
    for rank in (0, 1):
        work = tmp_path / f"host{rank}"
        work.mkdir()
        env = {**os.environ, "PYTHONPATH": str(bundle.path / "runtime"), "OMP_NUM_THREADS": "1"}
        with open(work / "agent.log", "wb") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "orbit_dagster.runtime.agent", str(bundle.path), "--workdir", str(work),
                 "--store", store.as_uri(), "--checkpoint-every", "1000", "--notice-grace", "60", "--nnodes", "2",
                 "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", f"{JOB}#1"],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        wait_for(lambda: any(e["type"] == "metrics" and e["step"] >= 20 for rank in (0, 1)
                             for e in events(tmp_path / f"host{rank}")), timeout=180, what="4 ranks training")
        agents[1].send_signal(signal.SIGTERM)  # node 1's notice (the agent's SIGTERM is one)
        codes = [a.wait(timeout=120) for a in agents]
    finally:
        for a in agents:
            a.kill()
    logs = [(tmp_path / f"host{rank}" / "agent.log").read_text() for rank in (0, 1)]
    assert codes == [0, 75], logs  # node 1 was reclaimed; node 0's script ended with the group
    (saved,) = [e for e in events(tmp_path / "host0") if e["type"] == "checkpoint"]
    last = max(e["step"] for rank in (0, 1) for e in events(tmp_path / f"host{rank}") if e["type"] == "metrics")
    assert saved["tier"] == "emergency" and saved["step"] == last  # no step lost
    manifest = open_store(store.as_uri()).verify(saved["uri"])
    assert manifest.format == "dcp"
    assert set(manifest.files) == {".metadata", *(f"__{r}_0.distcp" for r in range(4))}  # every rank its shard
    assert not [e for e in events(tmp_path / "host1") if e["type"] == "checkpoint"]  # node 0 reports it, once
    # Before its upload, node 0 reported the union on its own disk (every node's part fetched).
    (local,) = [e for e in events(tmp_path / "host0") if e["type"] == "local_checkpoint"]
    assert (local["step"], local["bytes"]) == (saved["step"], saved["bytes"]) and local["seq"] < saved["seq"]
    assert saved["plan_tier"] == "local" and saved["local_seconds"] == local["seconds"] > 0
    assert sorted(p.name for p in (store / JOB).iterdir()) == [Path(saved["uri"]).name]  # the parts are gone
    time.sleep(0.5)
    assert run_tags() == set(), "a rank outlived its agent"
