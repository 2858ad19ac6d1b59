"""AWS's rebalance recommendation, end to end on a real agent: a fake IMDS (v2) on loopback serves it, the
agent records it in the event stream and, with `checkpoint.on_rebalance: checkpoint`, takes an early durable
checkpoint before the spot notice; the control plane reads the record and notes it in the ledger."""
import json
import time
from pathlib import Path

import pytest

from orbit_dagster.core import host_contract as H
from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.submission import TaskSubmission
from orbit_dagster.core.templates import load_template
from orbit_dagster.runtime.exits import EXIT_PREEMPTED
from orbit_dagster.runtime.notices import NoticeWatcher
from tests.helpers import wait_for
from tests.integration.moto_fixtures import MetadataStandIn
from tests.unit.runtime.test_agent import agent, events

EVERY = 100_000  # no periodic durable checkpoint within the test: any durable one is the rebalance's


@pytest.fixture
def imds():
    server = MetadataStandIn()
    yield server
    server.close()


def bundle(root: Path, on_rebalance: str):
    t = load_template("charlm-finetune")
    cfg = {**t.config, "steps": 1_000_000, "d_model": 32, "n_heads": 2, "n_layers": 1, "seq_len": 32,
           "micro_batch": 4, "grad_accum": 1}
    ck = t.checkpoint.model_copy(update={"every_steps": EVERY, "memory_every_steps": EVERY,
                                         "on_rebalance": on_rebalance})
    t = t.model_copy(update={"config": cfg, "checkpoint": ck})
    return build_bundle(t, TaskSubmission(template=t.name), "job-rebalance", root / "bundles")


def kinds(workdir: Path) -> list[dict]:
    """The records this test orders; a notice's second record (an SDK emergency save's plan,
    runtime/emergency.py) is checked and left out."""
    seen = [e for e in events(workdir) if e["type"] in ("rebalance", "checkpoint", "notice")]
    plans = [e for e in seen if e["type"] == "notice" and "plan" in e]
    assert len(plans) <= 1 and all(p["contract"] == 2 for p in plans), plans
    return [e for e in seen if e not in plans]


def last_step(workdir: Path) -> int:
    return max((e["step"] for e in events(workdir) if e["type"] == "metrics"), default=-1)


def run_until_notice(tmp_path: Path, imds: MetadataStandIn, on_rebalance: str) -> tuple[Path, list[dict]]:
    b = bundle(tmp_path, on_rebalance)
    work = tmp_path / "w"
    proc = agent(b.path, work, tmp_path / "s", "--metadata-url", imds.url, "--notice-poll", "0.05", wait=False)
    try:
        wait_for(lambda: (work / "artifacts" / "events.jsonl").exists() and last_step(work) >= 20, timeout=120,
                 what="training past step 20")
        imds.rebalance = {"noticeTime": imds.at(0)}
        wait_for(lambda: any(e["type"] == "rebalance" for e in events(work)), timeout=30, what="the rebalance record")
        if on_rebalance == "checkpoint":
            wait_for(lambda: any(e["type"] == "checkpoint" for e in events(work)), timeout=30,
                     what="the early durable checkpoint")
        else:
            seen = last_step(work)
            wait_for(lambda: last_step(work) >= seen + 30, timeout=30, what="training going on")
        imds.notice = {"action": "terminate", "time": imds.at(120)}
        assert proc.wait(120) == EXIT_PREEMPTED, (work / "agent.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    return work, kinds(work)


def test_a_rebalance_recommendation_brings_an_early_durable_checkpoint_before_the_notice(tmp_path, imds):
    work, seen = run_until_notice(tmp_path, imds, "checkpoint")
    order = [(e["type"], e.get("tier")) for e in seen]
    assert order == [("rebalance", None), ("checkpoint", "durable"), ("notice", None), ("checkpoint", "emergency")]
    rebalance, early, notice, emergency = seen
    assert rebalance["action"] == "checkpoint" and rebalance["source"] == "metadata" and rebalance["contract"] == 2
    assert rebalance["notice_time"] is not None
    assert 20 <= early["step"] < emergency["step"] and early["step"] % EVERY != 0  # not the schedule's
    assert early["ts"] < notice["ts"]
    # The control plane reads it as the contract's record, not a refusal.
    records, _ = H.read_file(work / "artifacts" / "events.jsonl", 0)
    assert not [r for r in records if isinstance(r, H.Rejected)]
    [rec] = [r for r in records if isinstance(r, H.Rebalance)]
    assert rec.action == "checkpoint" and rec.contract == 2


def test_with_the_policy_off_it_is_recorded_and_no_early_checkpoint_is_taken(tmp_path, imds):
    _, seen = run_until_notice(tmp_path, imds, "record")
    assert [(e["type"], e.get("tier")) for e in seen] == [
        ("rebalance", None), ("notice", None), ("checkpoint", "emergency")]
    assert seen[0]["action"] == "record"


def test_the_watcher_reports_one_rebalance_and_still_sees_the_notice(imds):
    got = []
    w = NoticeWatcher(imds.url, poll_s=0.02, on_rebalance=got.append)
    assert w.poll_once() is False and got == []
    imds.rebalance = {"noticeTime": "2030-01-01T00:00:00Z"}
    assert w.poll_once() is False and w.poll_once() is False  # not a notice; reported once
    assert [(g["source"], g["notice_time"]) for g in got] == [("metadata", 1893456000.0)]
    imds.notice = {"action": "terminate", "time": "2030-01-01T00:02:00Z"}
    assert w.poll_once() is True and w.notice["deadline"] == 1893456120.0


def test_the_control_plane_notes_the_record_in_the_ledger(tmp_path):
    from orbit_dagster.control.attempt import AttemptMonitor
    from orbit_dagster.control.context import NullReporter
    from orbit_dagster.settings import Settings
    from tests.unit.control.test_attempt_events import Handle, Host

    settings = Settings.from_env(tmp_path / "orbit-home")
    ledger = settings.ledger()
    monitor = AttemptMonitor(settings, ledger, Host(), Handle(), NullReporter(), job_id="job-r", run_id="job-r#1",
                             store_uri=settings.store_uri, lineage="L1-r", experiment="r", eval_suite=None)
    line = H.encode(H.stamp(H.Rebalance(source="metadata", notice_time=1.0, received_at=time.time(),
                                        action="checkpoint"), seq=1, ts=time.time()))
    entries, _ = H.read_chunk(line.encode(), 0)
    monitor._on_events(entries)
    [row] = ledger.rows("SELECT kind, detail FROM events WHERE job_id = 'job-r'")
    assert row["kind"] == "host_rebalance" and json.loads(row["detail"])["action"] == "checkpoint"
    ledger.dispose()


ASKING = """
import json, os, sys, time
from orbit_dagster.integrations import env
out = sys.argv[1]
for step in range(1, 301):
    time.sleep(0.02)
    print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    if env.checkpoint_due(step):
        with open(os.path.join(out, f"ckpt_{step}.pt"), "wb") as fh:
            fh.write(b"x" * 100)
"""


def test_a_command_workload_is_asked_through_its_published_schedule(tmp_path, imds):
    from tests.integration.test_command_workload import agent as command_agent
    from tests.integration.test_command_workload import script_bundle

    b = script_bundle(tmp_path, ASKING)
    work = tmp_path / "w"
    proc = command_agent(b, work, tmp_path / "s", "--checkpoint-every", str(EVERY), "--metadata-url", imds.url,
                         "--notice-poll", "0.05", wait=False)
    try:
        wait_for(lambda: (work / "artifacts" / "events.jsonl").exists() and last_step(work) >= 20, timeout=120,
                 what="the script past step 20")
        imds.rebalance = {"noticeTime": imds.at(0)}
        assert proc.wait(120) == 0, (work / "agent.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    seen = kinds(work)
    assert [(e["type"], e.get("tier")) for e in seen] == [("rebalance", None), ("checkpoint", "durable")]
    assert seen[0]["action"] == "schedule" and 20 < seen[1]["step"] < 300
