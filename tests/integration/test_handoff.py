"""Hand-off on the real sim market, without Dagster: a training run launches its attempt and
ends; the interruption sensor's decisions (`reconcile.decide`, what the sensor runs each
tick) wake a short re-attach run only when there is something to do; the attempt ends as a
followed one does: the same checkpoints, metrics, weights and bill, a reclaim recovered from
its emergency checkpoint, a cancel stopped and billed.

(Under a real daemon on PostgreSQL, 20 jobs at once: tests/e2e/test_team_scale.py.)
"""
import dataclasses
import json
import math
import time

import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.handoff import Watch
from orbit_dagster.control.providers import provider_for
from orbit_dagster.control.reconcile import decide
from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.core.host_contract import Metrics
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import RunHandle
from orbit_dagster.settings import Settings
from tests.helpers import Background, wait_for

CFG = {"config.steps": 60, "checkpoint.every_steps": 20, "checkpoint.interval_policy": "fixed"}


@pytest.fixture
def settings(orbit_home):
    return dataclasses.replace(Settings.from_env(orbit_home), follow="daemon", handoff_after_s=0.0,
                               follow_every_s=600.0)


def unfollowed(job_id, attempt):  # noqa: ARG001 - no run follows anything here but what the test starts
    return False


def until_settled(settings, job, watch, *, timeout=180.0):
    """Tick like the sensor every 0.3 s; start the re-attach run each decision asks for
    (in this process, as the run would), until the job leaves RUNNING. Returns (ticks, runs)."""
    ledger = settings.ledger()
    ticks = runs = 0
    deadline = time.time() + timeout
    while R.require_job(ledger, job)["state"] == "RUNNING":
        assert time.time() < deadline, "the handed-off attempt did not end"
        report = decide(settings, unfollowed, watch)
        ticks += 1
        for d in report.decisions:
            assert d.action == "reattach", d
            out = run_attempt(settings, d.job_id)
            runs += 1
            assert out.reattached and out.state in ("RUNNING", "SUCCEEDED", "LOST", "FAILED", "CANCELLED")
        time.sleep(0.3)
    return ticks, runs


def test_a_handed_off_attempt_ends_as_a_followed_one(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", CFG, experiment="handoff")
    launched = run_attempt(settings, job)
    assert launched.state == "RUNNING" and launched.handed_off and not launched.reattached
    row = R.run(ledger, R.run_id_for(job, 1))
    assert row["handed_off_at"] is not None and row["state"] == "RUNNING"

    ticks, runs = until_settled(settings, job, Watch())
    assert R.require_job(ledger, job)["state"] == "SUCCEEDED"
    # Woken for its checkpoints and its end, not at every tick.
    assert 1 <= runs < ticks, (runs, ticks)

    ref = submit(settings, "charlm-finetune", CFG, experiment="handoff-ref")
    assert run_attempt(settings, ref, hand_off=False).state == "SUCCEEDED"

    def facts(j):
        return {
            "checkpoints": [(r["step"], r["tier"]) for r in ledger.rows(
                "SELECT step, tier FROM checkpoints WHERE job_id = ? ORDER BY step", [j])],
            "weights": ledger.scalar("SELECT weights_sha256 FROM checkpoints WHERE job_id = ? ORDER BY step DESC "
                                     "LIMIT 1", [j]),
            "evaluations": ledger.scalar("SELECT count(*) FROM evaluations WHERE job_id = ?", [j]),
        }

    assert facts(job) == facts(ref)
    # Every metric the workload wrote (its event file, collected with the artifacts) reached the
    # ledger once, across the runs that took the attempt up in turn.
    written = [json.loads(line) for line in
               (settings.artifacts_dir / job / "attempt-1" / "events.jsonl").read_text().splitlines()]
    values = sum(len(ev["values"]) for ev in written if ev.get("type") == "metrics")
    assert values > 0 and ledger.scalar("SELECT count(*) FROM metric_points WHERE run_id = ? AND source = 'train'",
                                        [R.run_id_for(job, 1)]) == values
    # Billed once, to the second the instance lived; attributed in full.
    billed = ledger.scalar("SELECT sum(billed_usd) FROM instances WHERE job_id = ?", [job])
    assert billed > 0 and ledger.scalar("SELECT count(*) FROM instances WHERE job_id = ? AND stopped_at IS NULL",
                                        [job]) == 0
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), billed, rel_tol=1e-9)
    # A later re-attach finds the attempt ended and launches nothing.
    again = run_attempt(settings, job)
    assert again.already_ended and again.state == "SUCCEEDED"


def test_a_reclaim_while_handed_off_resumes_from_the_emergency_checkpoint(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 90, "checkpoint.every_steps": 100,
                                               "checkpoint.interval_policy": "fixed"}, experiment="handoff-reclaim")
    assert run_attempt(settings, job).handed_off
    handle = RunHandle.model_validate_json(R.run(ledger, R.run_id_for(job, 1))["handle"])
    # No run reads its metrics meanwhile: the host's own event file says how far it got.
    provider = provider_for(settings, "sim_host_process")
    wait_for(lambda: any(isinstance(ev, Metrics) and ev.step >= 15
                         for ev in provider.read_events(handle, 0)[0]), timeout=120)
    provider.inject_reclaim(handle.instance, in_seconds=6, notice_seconds=5)
    until_settled(settings, job, Watch())
    first = R.run(ledger, R.run_id_for(job, 1))
    assert (first["state"], first["failure_class"]) == ("LOST", "reclaim")
    emergency = ledger.one("SELECT checkpoint_key, step FROM checkpoints WHERE job_id = ? AND tier = 'emergency'",
                           [job])
    assert emergency is not None
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"]) == ("QUEUED", 2)
    # Nothing was lost (the emergency checkpoint is the newest step), so the wasted compute is
    # at most the time the last step took to show, as when a run follows: it is counted from
    # the last progress the re-attach run read, not from the hand-off.
    assert emergency["step"] == ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?",
                                              [R.run_id_for(job, 1)])
    wasted = ledger.scalar("SELECT coalesce(sum(seconds), 0) FROM costs WHERE job_id = ? AND kind = 'wasted'", [job])
    step_s = ledger.scalar("SELECT (max(ts) - min(ts)) / (max(step) - min(step)) FROM metric_points WHERE run_id = ?",
                           [R.run_id_for(job, 1)])
    assert wasted <= 2 * step_s + 1.2, (wasted, step_s)
    second = run_attempt(settings, job)
    assert second.handed_off
    until_settled(settings, job, Watch())
    assert R.require_job(ledger, job)["state"] == "SUCCEEDED"
    assert R.run(ledger, R.run_id_for(job, 2))["resume_from"] == emergency["checkpoint_key"]
    billed = ledger.scalar("SELECT sum(billed_usd) FROM instances WHERE job_id = ?", [job])
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), billed, rel_tol=1e-9)


def test_a_cancel_while_handed_off_stops_and_bills_the_workload(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 100000}, experiment="handoff-cancel")
    assert run_attempt(settings, job).handed_off
    # `orbit cancel` (no run to terminate: none follows it) stops the workload itself.
    assert cancel(settings, job, reason="a person changed their mind")
    assert R.run(ledger, R.run_id_for(job, 1))["state"] == "CANCELLED"
    inst = ledger.one("SELECT stopped_at, billed_usd FROM instances WHERE job_id = ?", [job])
    assert inst["stopped_at"] is not None and inst["billed_usd"] > 0
    # ... and the daemon has nothing left to do for it.
    assert not [d for d in decide(settings, unfollowed, Watch()).decisions if d.job_id == job]


def test_a_job_that_ends_within_the_grace_ends_in_its_launching_run(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 8}, experiment="handoff-short")
    out = run_attempt(dataclasses.replace(settings, handoff_after_s=120.0), job)
    assert out.state == "SUCCEEDED" and not out.handed_off
    assert R.run(ledger, R.run_id_for(job, 1))["handed_off_at"] is None


def test_a_run_killed_while_it_follows_then_hand_off_loses_and_repeats_nothing(settings, orbit_home, tmp_path):
    """kill -9 of the launching run mid-follow (before it handed off); the re-attach run hands
    the attempt off from offset 0 and the daemon's runs finish it: each checkpoint and metric
    once, one instance billed once."""
    from tests.reliability import inject
    from tests.reliability.test_kills_and_disks import RUN_WORKER

    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 24, "checkpoint.every_steps": 4,
                                               "checkpoint.interval_policy": "fixed"}, experiment="handoff-kill")
    log = tmp_path / "worker.log"
    # The launching run follows for its grace period (600 s here): it is killed inside it.
    proc = inject.spawn(RUN_WORKER, str(orbit_home), job, log=log,
                        env={"ORBIT_FOLLOW": "daemon", "ORBIT_HANDOFF_AFTER_S": "600"})
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job]) >= 2
             or proc.poll() is not None, 180, 0.05, what="checkpoints registered by the launching run")
    assert proc.poll() is None, log.read_text()[-2000:]
    inject.sigkill(proc)
    assert R.run(ledger, R.run_id_for(job, 1))["handed_off_at"] is None  # killed before it handed off
    report = decide(settings, unfollowed, Watch())
    assert [(d.action, d.job_id) for d in report.decisions] == [("reattach", job)]  # not handed off: re-attach
    out = run_attempt(settings, job)
    assert out.reattached and (out.handed_off or out.state == "SUCCEEDED")
    until_settled(settings, job, Watch())
    assert R.require_job(ledger, job)["state"] == "SUCCEEDED"
    keys = [r["checkpoint_key"] for r in ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE job_id = ?", [job])]
    assert sorted(keys) == sorted(f"{job}/a1/{s}" for s in (4, 8, 12, 16, 20, 24))
    assert ledger.scalar("""SELECT count(*) FROM (SELECT run_id, source, name, step FROM metric_points
                            WHERE job_id = ? GROUP BY 1, 2, 3, 4 HAVING count(*) > 1)""", [job]) == 0
    instances = ledger.rows("SELECT * FROM instances WHERE job_id = ? AND purpose = 'train'", [job])
    assert len(instances) == 1 and instances[0]["stopped_at"] is not None
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]),
                        instances[0]["billed_usd"], rel_tol=1e-9)


def test_two_runs_taking_up_the_same_attempt_at_once_close_it_once(settings):
    """The same request twice: two re-attach runs (a sensor's and a retried one) take up one
    handed-off attempt that has ended. One closes it; the other finds it closed."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 16}, experiment="handoff-twice")
    assert run_attempt(settings, job).handed_off
    handle = RunHandle.model_validate_json(R.run(ledger, R.run_id_for(job, 1))["handle"])
    provider = provider_for(settings, "sim_host_process")
    wait_for(lambda: provider.status(handle).state == "exited", timeout=120)
    runs = [Background(lambda: run_attempt(settings, job)) for _ in range(2)]
    outs = [r.join() for r in runs]
    assert sorted(o.state for o in outs) == ["SUCCEEDED", "SUCCEEDED"]
    assert R.require_job(ledger, job)["state"] == "SUCCEEDED"
    assert ledger.scalar("SELECT count(*) FROM job_states WHERE job_id = ? AND state = 'SUCCEEDED'", [job]) == 1
    inst = ledger.rows("SELECT billed_usd, stopped_at FROM instances WHERE job_id = ? AND purpose = 'train'", [job])
    assert len(inst) == 1 and inst[0]["stopped_at"] is not None
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), inst[0]["billed_usd"],
                        rel_tol=1e-9)
    assert ledger.scalar("""SELECT count(*) FROM (SELECT run_id, source, name, step FROM metric_points
                            WHERE job_id = ? GROUP BY 1, 2, 3, 4 HAVING count(*) > 1)""", [job]) == 0
