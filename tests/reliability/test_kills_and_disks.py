"""Crashes mid-write and a full disk: a workload SIGKILLed while it writes a checkpoint, a
run worker SIGKILLed while it registers checkpoints, an event line torn in half, the
ledger's and the store's disk full. Nothing torn is ever used; nothing committed is lost."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.reconcile import reconcile
from orbit_dagster.control.submit import submit
from orbit_dagster.core.host_contract import Checkpoint, Progress, Rejected
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.common import read_event_file
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest
from orbit_dagster.storage.fs import TEMP_MAX_AGE_S, sweep_temp_dirs
from tests.helpers import wait_for
from tests.reliability import inject
from tests.reliability.conftest import fill, opened


@pytest.mark.fault("SIGKILL of the workload (agent) while it writes a checkpoint every step",
                   expect="only complete, verified checkpoints listed; its temp dirs swept; torn event ignored")
def test_sigkill_of_the_workload_mid_checkpoint_write(tmp_path):
    """A checkpoint is visible only once whole (files, then manifest, then a rename): a kill at
    any instant leaves complete checkpoints and invisible temp directories, which the next
    write into the same job removes once they are old."""
    from tests.unit.runtime.test_agent import agent, small_bundle

    b = small_bundle(tmp_path, **{"config.steps": 100000, "checkpoint.every_steps": 1})
    store_root, work = tmp_path / "store", tmp_path / "w"
    proc = agent(b.path, work, store_root, wait=False)
    job_dir = store_root / "job-agent"
    wait_for(lambda: len(list(job_dir.glob("step-*"))) >= 3 or proc.poll() is not None, 120, 0.05,
             what="three checkpoints written")
    # Aim for the middle of a write: a temp directory being filled.
    deadline = time.time() + 30
    while time.time() < deadline and not list(job_dir.glob(".tmp-*")):
        time.sleep(0.002)
    proc.kill()
    proc.wait(30)
    store = open_store(store_root.as_uri())
    listed = list(store.list("job-agent"))
    assert len(listed) >= 3
    for uri in listed:
        store.verify(uri)  # every listed checkpoint is whole
    for d in job_dir.iterdir():
        assert d.name.startswith(".tmp-") or (d / "manifest.json").is_file(), d.name
    events, offset = read_event_file(work / "artifacts" / "events.jsonl", 0)
    reported = {e.uri for e in events if isinstance(e, Checkpoint)}
    assert reported <= set(listed)  # an event is written only after its checkpoint is whole
    # The killed writer's temp dirs: invisible now, and swept once older than a live write can be.
    leftovers = list(job_dir.glob(".tmp-*"))
    for d in leftovers:
        os.utime(d, (time.time() - TEMP_MAX_AGE_S - 60,) * 2)
    blob = b"x"
    store.put("job-agent", "step-999999999-a9", {"state.pt": blob},
              CheckpointManifest(job_id="job-agent", step=999999999, tier="durable", attempt=9,
                                 files={"state.pt": {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": 1}}))
    assert not list(job_dir.glob(".tmp-*"))
    assert sweep_temp_dirs(job_dir, max_age_s=0) == 0


@pytest.mark.fault("an events.jsonl line torn mid-way (the host died writing it), garbage lines, then the rest",
                   expect="a torn line is not read until whole, then once; garbage refused by name and skipped")
def test_a_torn_event_line_is_read_once_and_only_when_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = '{"seq": 1, "type": "metrics", "step": 1, "values": {"train/loss": 3.0}}\n'
    torn = '{"seq": 2, "type": "checkpoint", "step": 4, "tier": "durable", "attempt": 1, "bytes": 3, "uri": "file:///x", "sha2'
    path.write_text(whole + torn)
    events, offset = read_event_file(path, 0)
    assert [e.seq for e in events] == [1] and offset == len(whole)
    assert read_event_file(path, offset) == ([], offset)  # still torn: nothing, the offset stays
    with open(path, "a") as fh:
        fh.write('56": "ab"}\n' + "\x00\x01 not json\n" + '{"seq": 3, "type": "progress", "step": 5}\n')
    events, offset = read_event_file(path, offset)
    assert [type(e) for e in events] == [Checkpoint, Rejected, Progress]
    assert [events[0].seq, events[2].seq] == [2, 3] and events[0].sha256 == "ab"
    assert events[1].reason == "not a JSON line (JSONDecodeError)"  # the follower records it (event_rejected)
    assert offset == path.stat().st_size and read_event_file(path, offset) == ([], offset)


RUN_WORKER = """
import sys
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.settings import Settings

run_attempt(Settings.from_env(sys.argv[1]), sys.argv[2], dagster_run_id="worker-killed", poll_s=0.05)
"""


@pytest.mark.fault("SIGKILL of the run worker following an attempt, while it registers checkpoints; "
                   "a new run re-attaches",
                   expect="the attempt finishes; each checkpoint and metric once; one instance, billed once")
def test_sigkill_of_the_run_worker_mid_follow_then_reattach(settings, orbit_home, tmp_path):
    """The stand-in for a Dagster run worker (or the daemon that launched it) killed mid-write:
    the process that follows the attempt and writes its checkpoints and metrics to the ledger."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 24, "checkpoint.every_steps": 4})
    log = tmp_path / "worker.log"
    proc = inject.spawn(RUN_WORKER, str(orbit_home), job, log=log)
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job]) >= 2
             or proc.poll() is not None, 180, 0.05, what="checkpoints registered by the run worker")
    assert proc.poll() is None, log.read_text()[-2000:]
    inject.sigkill(proc)
    assert R.require_job(ledger, job)["state"] == "RUNNING"
    assert inject.integrity(inject.sqlite_path(orbit_home)) == "ok"

    report = reconcile(settings, followed=lambda *_: False)
    assert [(d.job_id, d.attempt) for d in report.reattach] == [(job, 1)]
    out = run_attempt(settings, job, poll_s=0.1)  # what the interruption sensor's re-attach run does
    assert out.reattached and out.state == "SUCCEEDED"
    keys = [r["checkpoint_key"] for r in ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE job_id = ?", [job])]
    assert sorted(keys) == sorted(f"{job}/a1/{s}" for s in (4, 8, 12, 16, 20, 24))
    dup = ledger.scalar("""SELECT count(*) FROM (SELECT run_id, source, name, step FROM metric_points
                           WHERE job_id = ? GROUP BY 1, 2, 3, 4 HAVING count(*) > 1)""", [job])
    assert dup == 0
    instances = ledger.rows("SELECT * FROM instances WHERE job_id = ? AND purpose = 'train'", [job])
    assert len(instances) == 1 and instances[0]["stopped_at"] is not None
    assert ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]) == \
        pytest.approx(instances[0]["billed_usd"], rel=1e-9)
    assert ledger.scalar("SELECT count(*) FROM runs WHERE job_id = ?", [job]) == 1


@pytest.mark.fault("the disk under the ledger and the checkpoint store fills up (16 MiB tmpfs)",
                   expect="the write is refused whole; nothing committed is lost; writes resume once freed")
def test_a_full_disk_under_the_ledger_and_the_store_loses_nothing(small_disk, monkeypatch):
    """The CLI's one-line answer to a full disk is tests/security/test_cli_errors.py; this is
    what the ledger and the store hold afterwards."""
    home = small_disk / "home"
    monkeypatch.setenv("ORBIT_HOME", str(home))
    settings = opened(Settings.from_env(home))
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 8})
    db = inject.sqlite_path(home)
    before = inject.snapshot(db)
    filler = fill(small_disk)

    big = [R.event("bulk", job_id=job, blob="x" * 4096, n=i) for i in range(2000)]  # ~8 MiB: cannot fit
    with pytest.raises(Exception, match="full|No space"):
        ledger.commit({"events": big})
    store = open_store(settings.store_uri)
    blob = os.urandom(1 << 20)
    with pytest.raises(OSError, match="No space"):
        store.put(job, "step-000000004-a1", {"state.pt": blob},
                  CheckpointManifest(job_id=job, step=4, tier="durable", attempt=1,
                                     files={"state.pt": {"sha256": hashlib.sha256(blob).hexdigest(),
                                                         "bytes": len(blob)}}))
    assert list(store.list(job)) == [] and not list((home / "checkpoints" / job).glob(".tmp-*"))

    filler.unlink()
    assert inject.integrity(db) == "ok"
    assert inject.snapshot(db) == before  # the refused transaction left no row
    ledger.commit({"events": big[:10]})
    assert ledger.scalar("SELECT count(*) FROM events WHERE kind = 'bulk'") == 10
    assert R.require_job(ledger, job)["state"] == "QUEUED"
