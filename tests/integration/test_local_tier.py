"""The local-disk tier of an emergency save, with real files: a host (its own process, see
local_tier_host.py) whose checkpoint store is too slow for the notice writes to its own disk
first and uploads after; the run following it registers the checkpoint only from the store,
once the upload's manifest committed. A host that goes before that (SIGKILL) leaves no
checkpoint registered and the ledger saying what was lost; so does a notice too short even
for the local disk. The store is a filesystem or S3 (moto's server over real HTTP)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbit_dagster.control import checkpoints as C
from orbit_dagster.control.attempt import AttemptMonitor
from orbit_dagster.control.context import NullReporter
from orbit_dagster.core.host_contract import read_chunk
from orbit_dagster.runtime.local_tier import local_store_for
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.fs import FsStore
from tests.helpers import wait_for
from tests.integration.local_tier_host import JOB
from tests.integration.moto_fixtures import aws_env, moto_server, s3_bucket  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
RUN = f"{JOB}#1"
# 8 MB at 4 MB/s: 2 s to the store; a notice 1.5 s away (1.2 s usable) fits a disk of 6.7 MB/s or more.
NOTICE_S = 1.5
STATE_MB, STORE_MB_S = 8, 4


class Host:
    def localize_checkpoint(self, handle, ev, store_uri):  # noqa: ARG002
        return ev  # the store is this machine's: nothing to copy


class Handle:
    nodes = ()

    class instance:
        instance_id = "sim-local-tier"

    @property
    def members(self):
        return (self,)


@pytest.fixture(params=["fs", "s3"])
def env(request, tmp_path):
    """(tmp_path, the store's uri, the monitor); the host process inherits the test's AWS settings."""
    settings = Settings.from_env(tmp_path / "orbit-home")
    ledger = settings.ledger()
    store = (tmp_path / "store").as_uri() if request.param == "fs" else f"s3://{request.getfixturevalue('s3_bucket')}/ckpt"
    monitor = AttemptMonitor(settings, ledger, Host(), Handle(), NullReporter(), job_id=JOB, run_id=RUN,
                             store_uri=store, lineage="L1-local", experiment="local", eval_suite=None)
    yield tmp_path, store, monitor
    ledger.dispose()


def start_host(tmp_path: Path, store: str, notice_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.integration.local_tier_host", store,
                             str(tmp_path / "local-disk"), str(tmp_path / "events.jsonl"), str(STORE_MB_S),
                             str(STATE_MB), str(notice_s)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def of_type(tmp_path: Path, kind: str) -> list[dict]:
    return [r for r in records(tmp_path) if r["type"] == kind]


def follow_events(monitor: AttemptMonitor, events: Path, job: str, run: str) -> None:
    """What the run following the attempt does with the host's events file, then at the attempt's end."""
    entries, _ = read_chunk(events.read_bytes(), 0)
    monitor._on_events(entries)
    C.record_missed_uploads(monitor.ledger, job, run)


def follow(monitor: AttemptMonitor, tmp_path: Path) -> None:
    follow_events(monitor, tmp_path / "events.jsonl", JOB, RUN)


def ledger_events(monitor: AttemptMonitor, kind: str) -> list[dict]:
    return [json.loads(r["detail"]) for r in monitor.ledger.rows("SELECT detail FROM events WHERE kind = ?", [kind])]


def registered_steps(monitor: AttemptMonitor, job: str = JOB) -> list[int]:
    return [r["step"] for r in monitor.ledger.rows("SELECT step FROM checkpoints WHERE job_id = ? ORDER BY step", [job])]


def test_a_slow_store_and_a_short_notice_go_to_the_local_disk_first_and_end_durable_and_verified(env):
    tmp_path, store, monitor = env
    host = start_host(tmp_path, store, notice_s=NOTICE_S)
    out, _ = host.communicate(timeout=120)
    assert host.returncode == 0, out
    (plan,) = [n for n in of_type(tmp_path, "notice") if n.get("plan")]
    assert plan["plan_tier"] == "local" and plan["plan_fits"] is True and plan["contract"] == 3
    assert "the store does not fit the notice, the instance's disk does" in plan["plan_reason"]
    (local,) = of_type(tmp_path, "local_checkpoint")
    emergency = [c for c in of_type(tmp_path, "checkpoint") if c["tier"] == "emergency"]
    assert len(emergency) == 1 and emergency[0]["step"] == 2
    ev = emergency[0]
    assert ev["plan_tier"] == "local" and ev["sha256"] == local["sha256"]  # the same parts, uploaded
    assert ev["upload_seconds"] >= STATE_MB / STORE_MB_S * 0.9  # through the slow store, after the local copy
    assert ev["local_seconds"] < ev["upload_seconds"]
    assert not Path(local["uri"][len("file://"):]).exists()  # the local copy is gone once the upload committed

    follow(monitor, tmp_path)
    assert registered_steps(monitor) == [1, 2]
    (row,) = monitor.ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? AND step = 2", [JOB])
    assert row["tier"] == "emergency" and row["uri"].startswith(store)
    assert ledger_events(monitor, "emergency_upload_missed") == []
    (plan_row,) = ledger_events(monitor, "emergency_plan")
    assert plan_row["plan_tier"] == "local"
    durable = open_store(store)
    _, directory = durable.checkout(row["uri"], tmp_path / "scratch")  # every part verified against the manifest
    state = torch.load(directory / "state.pt", weights_only=True)
    torch.manual_seed(0)
    expected = torch.randn(int(STATE_MB * 1e6) // 4).mul_(0.5).add_(1.0)
    assert state["step"] == 2 and torch.equal(state["model"]["w"], expected)


def test_a_host_gone_before_the_upload_commits_registers_nothing_and_the_ledger_says_what_was_lost(env):
    tmp_path, store, monitor = env
    host = start_host(tmp_path, store, notice_s=NOTICE_S)
    try:
        wait_for(lambda: of_type(tmp_path, "local_checkpoint") or host.poll() is not None, timeout=120,
                 every=0.05, what="the local copy")
        assert host.poll() is None, host.communicate()[0]  # still uploading: 2 s through the slow store
        host.send_signal(signal.SIGKILL)  # the instance goes
    finally:
        host.wait(timeout=30)
    assert not [c for c in of_type(tmp_path, "checkpoint") if c["step"] == 2]
    assert not [u for u in open_store(store).list(JOB) if u.rstrip("/").endswith("step-000000002-a1")]

    follow(monitor, tmp_path)
    follow(monitor, tmp_path)  # a second reading (a re-attach, a retried finish) records it once
    assert C.record_missed_uploads(monitor.ledger, JOB, RUN) == []  # and says nothing new
    assert registered_steps(monitor) == [1]  # the durable one; never the torn upload
    (missed,) = ledger_events(monitor, "emergency_upload_missed")
    assert missed["step"] == 2 and missed["bytes"] > STATE_MB * 1e6
    assert "never committed before the host went" in missed["reason"]
    assert "the checkpoint of step 1 stands" in missed["reason"]


def test_a_notice_too_short_even_for_the_local_disk_is_recorded_as_missed_and_nothing_is_registered(env):
    tmp_path, store, monitor = env
    host = start_host(tmp_path, store, notice_s=0.0)  # the deadline is now: nothing fits
    try:
        wait_for(lambda: [n for n in of_type(tmp_path, "notice") if n.get("plan")] or host.poll() is not None,
                 timeout=120, every=0.05, what="the emergency plan")
        assert host.poll() is None, host.communicate()[0]  # writing: 2 s through the slow store
        host.send_signal(signal.SIGKILL)
    finally:
        host.wait(timeout=30)
    (plan,) = [n for n in of_type(tmp_path, "notice") if n.get("plan")]
    assert plan["plan_fits"] is False and "plan_tier" not in plan  # straight to the store, expected to miss
    assert not of_type(tmp_path, "local_checkpoint")

    follow(monitor, tmp_path)
    assert registered_steps(monitor) == [1]
    (plan_row,) = ledger_events(monitor, "emergency_plan")
    assert plan_row["plan_fits"] is False and "expected to miss the deadline" in plan_row["plan_reason"]
    assert "the last durable checkpoint (step 1) stands" in plan_row["plan_reason"]


def test_the_local_tier_exists_only_where_the_store_is_not_the_instances_disk(tmp_path, s3_bucket):
    work = tmp_path / "work"
    work.mkdir()
    assert local_store_for(open_store((tmp_path / "store").as_uri()), work) is None  # the same disk: no gain
    local = local_store_for(open_store(f"s3://{s3_bucket}/ckpt"), work)
    assert isinstance(local, FsStore) and local.root == (work / "local-checkpoints").resolve()
