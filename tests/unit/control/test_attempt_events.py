"""The run following an attempt acts on host-contract records and records every refused line
(the monitor on a real SQLite ledger; the provider's side is a stand-in)."""
from __future__ import annotations

import json

import pytest

from orbit_dagster.control.attempt import AttemptMonitor
from orbit_dagster.control.context import NullReporter
from orbit_dagster.core.host_contract import read_chunk
from orbit_dagster.settings import Settings


class Host:
    def localize_checkpoint(self, handle, ev, store_uri):  # noqa: ARG002
        return ev


class Handle:
    nodes = ()  # a single instance (a group's other nodes: RunHandle.nodes)

    class instance:
        instance_id = "sim-unit"

    @property
    def members(self):
        return (self,)


@pytest.fixture
def monitor(tmp_path):
    settings = Settings.from_env(tmp_path / "orbit-home")
    ledger = settings.ledger()
    yield AttemptMonitor(settings, ledger, Host(), Handle(), NullReporter(), job_id="job-u", run_id="job-u#1",
                         store_uri=settings.store_uri, lineage="L1-u", experiment="u", eval_suite=None)
    ledger.dispose()


def test_lines_of_an_unknown_version_or_kind_and_garbage_are_recorded_as_rejected_and_the_run_goes_on(monitor):
    """Before the contract: a line of another version was read as if it were this one (its
    metrics stored), and a line that was not JSON vanished without a trace."""
    lines = [
        {"seq": 1, "ts": 1790000000.0, "type": "metrics", "step": 2, "values": {"train/loss": 3.0}},  # no version: v1
        {"seq": 2, "ts": 1790000001.0, "type": "metrics", "step": 3, "values": {"train/loss": 9.0}, "contract": 4},
        {"seq": 3, "ts": 1790000002.0, "type": "heartbeat"},
    ]
    chunk = ("".join(json.dumps(line) + "\n" for line in lines) + "not json\n").encode()
    chunk += json.dumps({"seq": 4, "type": "progress", "step": 5, "contract": 1}).encode() + b"\n"
    entries, _ = read_chunk(chunk, 0)
    monitor._on_events(entries)
    monitor.flush_metrics()
    ledger = monitor.ledger
    assert [(r["step"], r["value"]) for r in ledger.rows("SELECT step, value FROM metric_points")] == [(2, 3.0)]
    rejected = [json.loads(r["detail"]) for r in
                ledger.rows("SELECT detail FROM events WHERE kind = 'event_rejected' ORDER BY ts")]
    reasons = sorted(d["reason"] for d in rejected)
    assert any(r.startswith("metrics: contract version 4 is not one this control plane reads") for r in reasons)
    assert any(r.startswith("unknown kind 'heartbeat'") for r in reasons)
    assert "not a JSON line (JSONDecodeError)" in reasons and len(rejected) == 3
    assert all(isinstance(d["offset"], int) and d["line"] for d in rejected)
    assert monitor.last_step == 5  # the line after the refused ones was acted on


def test_a_refused_line_read_again_after_a_re_attach_is_recorded_once(monitor):
    """Before: each read of a malformed line (a re-attaching run reads from the start) added a row."""
    chunk = b'{"seq": 1, "type": "metrics", "step": "x", "values": {}}\n'
    monitor._on_events(read_chunk(chunk, 0)[0])
    monitor._on_events(read_chunk(chunk, 0)[0])
    assert monitor.ledger.scalar("SELECT count(*) FROM events WHERE kind = 'event_rejected'") == 1


def test_a_nan_metric_and_a_host_notice_reach_the_ledger_as_before(monitor):
    chunk = (json.dumps({"seq": 1, "ts": 1790000000.0, "type": "metrics", "step": 4,
                         "values": {"train/loss": "nan", "lr": 0.1}}) + "\n"
             + json.dumps({"seq": 2, "ts": 1790000001.0, "type": "notice", "source": "sigterm", "deadline": None,
                           "received_at": 1790000001.0}) + "\n").encode()
    monitor._on_events(read_chunk(chunk, 0)[0])
    monitor.flush_metrics()
    ledger = monitor.ledger
    assert [(r["name"], r["value"]) for r in ledger.rows("SELECT name, value FROM metric_points")] == [("lr", 0.1)]
    (notice,) = ledger.rows("SELECT detail, instance_id FROM events WHERE kind = 'host_notice'")
    assert json.loads(notice["detail"])["source"] == "sigterm" and notice["instance_id"] == "sim-unit"


def test_a_notice_the_emergency_save_cannot_meet_is_in_the_ledger(monitor):
    """The agent announces its emergency plan as a second record of the notice, before the
    write: the ledger says the notice could not be met even when no checkpoint follows."""
    lines = [
        {"seq": 1, "ts": 1790000000.0, "type": "notice", "contract": 1, "source": "metadata",
         "deadline": 1790000030.0, "received_at": 1790000000.0},
        {"seq": 2, "ts": 1790000001.0, "type": "notice", "contract": 2, "source": "metadata",
         "deadline": 1790000030.0, "received_at": 1790000000.0, "step": 40, "plan": "full", "plan_fits": False,
         "plan_reason": "estimated 45.0 s, 29.0 s left: expected to miss the deadline", "estimate_s": 45.0,
         "time_left_s": 29.0},
    ]
    entries, _ = read_chunk("".join(json.dumps(line) + "\n" for line in lines).encode(), 0)
    monitor._on_events(entries)
    monitor._on_events(entries)  # read again (a re-attach reads from the start): recorded once

    def detail(kind):
        return [json.loads(r["detail"]) for r in monitor.ledger.rows("SELECT detail FROM events WHERE kind = ?", [kind])]

    assert len(detail("host_notice")) >= 1 and all(d.get("plan") is None for d in detail("host_notice"))
    (plan,) = detail("emergency_plan")
    assert plan["plan_fits"] is False and plan["step"] == 40 and "expected to miss" in plan["plan_reason"]
