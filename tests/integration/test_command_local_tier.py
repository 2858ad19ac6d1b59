"""The local tier of a command workload's emergency save, with real processes: a host (its own
process group, see command_local_tier_host.py: the real agent on a real bundle of a small
script) whose checkpoint store is too slow to take the script's emergency save at once. The
script's own files are the local copy: the agent reports them (`local_checkpoint`) before its
upload begins, and the `checkpoint` record follows once the upload committed; the run following
the attempt registers only that. A host that goes mid-upload (SIGKILL of its whole group,
agent and script) leaves nothing registered for the step and the ledger saying what was lost.
The store is a filesystem or S3 (moto's server over real HTTP); the notice comes from a
metadata service on loopback, with a deadline."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orbit_dagster.control import checkpoints as C
from orbit_dagster.control.attempt import AttemptMonitor
from orbit_dagster.control.context import NullReporter
from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.runtime.agent import EXIT_PREEMPTED
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from tests.helpers import wait_for
from tests.integration.moto_fixtures import MetadataStandIn, aws_env, moto_server, s3_bucket  # noqa: F401
from tests.integration.test_command_workload import JOB, script_bundle
from tests.integration.test_local_tier import Handle, Host, follow_events, ledger_events
from tests.integration.test_local_tier import registered_steps as local_tier_steps

REPO = Path(__file__).resolve().parents[2]
RUN = f"{JOB}#1"
# 6 MB at 1.5 MB/s: 4 s of upload. Wide enough for the kill to land mid-upload on a loaded
# machine, short enough for the agent to wait for it (it joins its watcher for 10 s).
STATE_BYTES, STORE_MB_S = 6_000_000, 1.5
UPLOAD_S = STATE_BYTES / (STORE_MB_S * 1e6)
DEADLINE_S = 120  # the notice's: far enough that the script exits on its own, never killed

# A script with no orbit import: a small durable save at step 1, then, told of the notice (the
# stop file or its signal), it ends its step and saves step 2 in place of the usual cadence.
SCRIPT = f"""
import json, os, random, signal, sys, time
out = sys.argv[1]
told = []
signal.signal(signal.SIGTERM, lambda *_: told.append(1))
with open(os.path.join(out, "..", "pid"), "w") as fh:
    fh.write(str(os.getpid()))

def save(step, nbytes):
    tmp = os.path.join(out, f".ckpt_{{step}}.pt.partial")  # a name the watcher never registers
    with open(tmp, "wb") as fh:
        fh.write(random.Random(step).randbytes(nbytes))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(out, f"ckpt_{{step}}.pt"))

print(json.dumps({{"step": 1, "train/loss": 1.0}}), flush=True)
save(1, 1000)
while not told and not os.path.exists(os.environ["ORBIT_STOP_FILE"]):
    time.sleep(0.05)
time.sleep(0.3)  # the rest of the step the notice came in
print(json.dumps({{"step": 2, "train/loss": 0.5}}), flush=True)
save(2, {STATE_BYTES})
"""


@pytest.fixture(params=["fs", "s3"])
def env(request, tmp_path):
    """(tmp_path, the store's uri, the monitor, the metadata service); the host process
    inherits the test's AWS settings."""
    settings = Settings.from_env(tmp_path / "orbit-home")
    ledger = settings.ledger()
    store = (tmp_path / "store").as_uri() if request.param == "fs" else f"s3://{request.getfixturevalue('s3_bucket')}/ckpt"
    monitor = AttemptMonitor(settings, ledger, Host(), Handle(), NullReporter(), job_id=JOB, run_id=RUN,
                             store_uri=store, lineage="L1-cmd-local", experiment="local", eval_suite=None)
    metadata = MetadataStandIn()
    yield tmp_path, store, monitor, metadata
    metadata.close()
    ledger.dispose()


def start_host(tmp_path: Path, store: str, metadata: MetadataStandIn) -> subprocess.Popen:
    """The agent, as the launcher runs it on an instance: the bundle's own runtime first on the
    path (the repository after it, for the launcher), in a session of its own (its group is
    the instance: a kill of the group takes the agent and the script)."""
    bundle = script_bundle(tmp_path, SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bundle.path / "runtime"), str(REPO)]),
           "OMP_NUM_THREADS": "1"}
    (tmp_path / "w").mkdir()
    with open(tmp_path / "w" / "agent.log", "ab") as log:  # a file: a pipe nobody reads would fill and block
        return subprocess.Popen([sys.executable, "-m", "tests.integration.command_local_tier_host", str(STORE_MB_S),
                                 str(bundle.path), "--workdir", str(tmp_path / "w"), "--store", store,
                                 "--metadata-url", metadata.url, "--notice-poll", "0.1"],
                                cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)


def records(tmp_path: Path, kind: str, workdir: str = "w") -> list[dict]:
    path = tmp_path / workdir / "artifacts" / "events.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in lines if r["type"] == kind]


def log_of(tmp_path: Path) -> str:
    return (tmp_path / "w" / "agent.log").read_text(errors="replace")


def notice_after_the_durable_save(host: subprocess.Popen, tmp_path: Path, metadata: MetadataStandIn) -> None:
    wait_for(lambda: records(tmp_path, "checkpoint") or host.poll() is not None, timeout=60, every=0.05,
             what="the durable save of step 1")
    assert host.poll() is None, log_of(tmp_path)
    assert [(c["step"], c["tier"]) for c in records(tmp_path, "checkpoint")] == [(1, "durable")]
    metadata.schedule(in_seconds=DEADLINE_S)


def follow(monitor: AttemptMonitor, tmp_path: Path) -> None:
    follow_events(monitor, tmp_path / "w" / "artifacts" / "events.jsonl", JOB, RUN)


def registered_steps(monitor: AttemptMonitor) -> list[int]:
    return local_tier_steps(monitor, JOB)


def test_a_scripts_emergency_save_is_reported_on_the_local_disk_then_uploaded_and_registered(env):
    tmp_path, store, monitor, metadata = env
    host = start_host(tmp_path, store, metadata)
    try:
        notice_after_the_durable_save(host, tmp_path, metadata)
        assert host.wait(60) == EXIT_PREEMPTED, log_of(tmp_path)
    finally:
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)
            host.wait(30)
    (notice,) = records(tmp_path, "notice")
    (local,) = records(tmp_path, "local_checkpoint")
    (ev,) = [c for c in records(tmp_path, "checkpoint") if c["step"] == 2]
    path = tmp_path / "w" / "command" / "train-a1" / "checkpoints" / "ckpt_2.pt"
    assert local["contract"] == 3 and (local["step"], local["attempt"]) == (2, 1)
    assert local["uri"] == path.as_uri() and local["bytes"] == STATE_BYTES
    assert "sha256" not in local  # not hashed before the upload: the digest comes with the checkpoint
    # `seconds`: from the notice to the newest file's mtime (the end of the step, then the save);
    # the script sleeps 0.3 s first, its mtime may trail the clock by a tick.
    assert 0.25 <= local["seconds"] <= path.stat().st_mtime - notice["received_at"] + 0.05
    assert DEADLINE_S - 60 < local["time_left_s"] <= DEADLINE_S
    assert (ev["tier"], ev["source"], ev["plan_tier"]) == ("emergency", "metadata", "local")
    assert ev["local_seconds"] == local["seconds"] and ev["bytes"] == local["bytes"]
    assert ev["upload_seconds"] >= UPLOAD_S * 0.9  # through the slow store, after the local record
    assert ev["seq"] > local["seq"]

    follow(monitor, tmp_path)
    assert registered_steps(monitor) == [1, 2]
    (row,) = monitor.ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? AND step = 2", [JOB])
    assert row["tier"] == "emergency" and row["uri"] == ev["uri"] and row["uri"].startswith(store)
    assert ledger_events(monitor, "emergency_upload_missed") == []
    _, directory = open_store(store).checkout(row["uri"], tmp_path / "scratch")  # every part verified
    stored = (directory / "ckpt_2.pt").read_bytes()
    assert hashlib.sha256(stored).digest() == hashlib.sha256(random.Random(2).randbytes(STATE_BYTES)).digest()


def test_a_host_gone_mid_upload_of_a_scripts_emergency_save_registers_nothing_and_the_ledger_says_what_was_lost(env):
    tmp_path, store, monitor, metadata = env
    host = start_host(tmp_path, store, metadata)
    try:
        notice_after_the_durable_save(host, tmp_path, metadata)
        wait_for(lambda: records(tmp_path, "local_checkpoint") or host.poll() is not None, timeout=60, every=0.05,
                 what="the local copy reported")
        assert host.poll() is None, log_of(tmp_path)  # still uploading: 4 s through the slow store
        os.killpg(host.pid, signal.SIGKILL)  # the instance goes: the agent and the script with it
    finally:
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)
        host.wait(30)
    script = int((tmp_path / "w" / "command" / "train-a1" / "pid").read_text())
    wait_for(lambda: not _alive(script), timeout=30, what="the script gone with its host")
    assert not [c for c in records(tmp_path, "checkpoint") if c["step"] == 2]
    durable = open_store(store)
    assert not [u for u in durable.list(JOB) if u.rstrip("/").endswith("step-000000002-a1")]
    if store.startswith("file:"):  # nor any manifest of step 2 anywhere in the store's tree
        assert not [p for p in Path(store.removeprefix("file://")).rglob("manifest.json") if "000000002" in str(p)]

    follow(monitor, tmp_path)
    follow(monitor, tmp_path)  # a second reading (a re-attach, a retried finish) records it once
    assert C.record_missed_uploads(monitor.ledger, JOB, RUN) == []  # and says nothing new
    assert registered_steps(monitor) == [1]  # the durable one; never the torn upload
    (missed,) = ledger_events(monitor, "emergency_upload_missed")
    assert missed["step"] == 2 and missed["bytes"] == STATE_BYTES and missed["local_sha256"] is None
    assert "never committed before the host went" in missed["reason"]
    assert "the checkpoint of step 1 stands" in missed["reason"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie until its (dead) parent's reaper collects it: dead all the same
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# A group of two nodes (one rank each), every host's store writing at GROUP_KB_S: node 1's part
# (~40 KB of DCP shards) takes ~5 s, node 0's upload of the union (~80 KB) ~10 s, the window
# in which the test kills the group.
GROUP_KB_S = 8


def start_group_host(tmp_path: Path, bundle, rank: int, store: str, endpoint: str) -> subprocess.Popen:
    """Node `rank`'s agent, as on its instance: its own session (the group of the instance)."""
    work = tmp_path / f"host{rank}"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bundle.path / "runtime"), str(REPO)]),
           "OMP_NUM_THREADS": "1"}
    with open(work / "agent.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.integration.command_local_tier_host", str(GROUP_KB_S / 1000),
             str(bundle.path), "--workdir", str(work), "--store", store, "--checkpoint-every", "100000",
             "--notice-grace", "60", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
             "--rdzv-id", RUN], cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)


@pytest.mark.timeout(300)
def test_a_group_gone_while_node_0_uploads_the_union_leaves_the_ledger_saying_what_was_lost(tmp_path):
    """A notice on node 1: both ranks stop at one step and save their shards; node 1 stores its
    part, node 0 fetches it, reports the union on its own disk (`local_checkpoint`) and begins
    the upload; the group goes then (both hosts SIGKILLed). Nothing is registered for the step,
    and the attempt's end records `emergency_upload_missed` with the union's bytes."""
    t = apply_overrides(load_template("fsdp-multinode"), {"config.steps": 100_000, "checkpoint.every_steps": 100_000})
    bundle = build_bundle(t, TaskSubmission(template=t.name), JOB, tmp_path / "bundle")
    store = (tmp_path / "store").as_uri()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    hosts = [start_group_host(tmp_path, bundle, rank, store, endpoint) for rank in (0, 1)]
    node0 = tmp_path / "host0"

    def logs() -> str:
        return "\n".join((tmp_path / f"host{k}" / "agent.log").read_text(errors="replace") for k in (0, 1))

    def found(kind: str, rank: int = 0) -> list[dict]:
        return records(tmp_path, kind, workdir=f"host{rank}")

    try:
        wait_for(lambda: [m for k in (0, 1) for m in found("metrics", k) if m["step"] >= 20]
                 or any(h.poll() is not None for h in hosts), timeout=180, what="the group training")
        assert all(h.poll() is None for h in hosts), logs()
        os.kill(hosts[1].pid, signal.SIGTERM)  # node 1's notice: its agent is the session's leader
        wait_for(lambda: found("local_checkpoint") or hosts[0].poll() is not None, timeout=120, every=0.05,
                 what="node 0 reporting the union on its disk")
        assert hosts[0].poll() is None, logs()  # still uploading the union through the slow store
        for h in hosts:
            os.killpg(h.pid, signal.SIGKILL)  # the group goes: every agent and rank with it
    finally:
        for h in hosts:
            if h.poll() is None:
                os.killpg(h.pid, signal.SIGKILL)
            h.wait(30)
    (local,) = found("local_checkpoint")
    assert not [c for c in found("checkpoint") if c["step"] == local["step"]], logs()
    assert local["uri"] == (node0 / "command" / "train-a1" / "checkpoints").as_uri() + f"/{Path(local['uri']).name}"
    assert local["bytes"] > 0 and local["seconds"] > 0 and "time_left_s" not in local  # a SIGTERM has no deadline
    assert not [u for u in open_store(store).list(JOB)], "no checkpoint of the group in the store"

    settings = Settings.from_env(tmp_path / "orbit-home")
    monitor = AttemptMonitor(settings, settings.ledger(), Host(), Handle(), NullReporter(), job_id=JOB, run_id=RUN,
                             store_uri=store, lineage="L1-group-local", experiment="local", eval_suite=None)
    try:
        follow_events(monitor, node0 / "artifacts" / "events.jsonl", JOB, RUN)
        assert registered_steps(monitor) == []
        (missed,) = ledger_events(monitor, "emergency_upload_missed")
        assert missed["step"] == local["step"] and missed["bytes"] == local["bytes"]
        assert "never committed before the host went" in missed["reason"] and "no checkpoint stands" in missed["reason"]
    finally:
        monitor.ledger.dispose()
