"""Surviving reclaims on the real sim market, without Dagster: the control plane's recovery path.

(The same path under a real Dagster daemon, restarts included, is tests/e2e/test_recovery_e2e.py.)
"""
import json
import math
import time

import pytest

from orbit_dagster.cli.commands import main
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.providers import provider_for
from orbit_dagster.control.recovery import recover_lost
from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import RunHandle
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from tests.helpers import Background, wait_for
from tests.integration.replay_driver import paced_template

CFG = {"config.steps": 60, "checkpoint.every_steps": 10}


@pytest.fixture
def settings(orbit_home):
    return Settings.from_env(orbit_home)


def handle_of(settings, job, attempt):
    return RunHandle.model_validate_json(R.run(settings.ledger(), R.run_id_for(job, attempt))["handle"])


def running(ledger, job, attempt=1) -> bool:
    row = R.run(ledger, R.run_id_for(job, attempt))
    return bool(row) and row["state"] == "RUNNING"


def last_step(ledger, job, attempt):
    return ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?", [R.run_id_for(job, attempt)])


def final_weights(ledger, job):
    return ledger.scalar("SELECT weights_sha256 FROM checkpoints WHERE job_id = ? ORDER BY step DESC LIMIT 1", [job])


def test_sigkill_without_notice_resumes_from_the_last_durable_checkpoint(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", CFG, experiment="kill")
    bg = Background(lambda: run_attempt(settings, job))
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job]) >= 2)
    time.sleep(0.7)  # somewhere between two checkpoints
    provider_for(settings, "sim_host_process").kill(handle_of(settings, job, 1).instance)
    first = bg.join()
    assert first.state == "LOST" and first.failure_class == "reclaim"
    # The run that saw the loss queued the next attempt itself; the sensor's pass is a no-op.
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"], row["failure_class"]) == ("QUEUED", 2, "reclaim")
    assert recover_lost(settings, job)["action"] == "none"
    second = run_attempt(settings, job)
    assert second.state == "SUCCEEDED" and second.attempt == 2
    resumed = ledger.rows("SELECT resume_from FROM runs WHERE run_id = ?", [R.run_id_for(job, 2)])[0]["resume_from"]
    ckpts_1 = ledger.rows("SELECT step, checkpoint_key FROM checkpoints WHERE run_id = ? ORDER BY step", [R.run_id_for(job, 1)])
    assert resumed == ckpts_1[-1]["checkpoint_key"]  # the newest durable one
    lost_steps = last_step(ledger, job, 1) - ckpts_1[-1]["step"]
    assert 0 <= lost_steps <= CFG["checkpoint.every_steps"]
    # Nothing half-written was ever registered: every registered checkpoint verifies.
    store = open_store(settings.store_uri)
    for row in ledger.rows("SELECT uri FROM checkpoints WHERE job_id = ?", [job]):
        store.verify(row["uri"])
    # The chain crosses the attempt boundary.
    first_of_2 = ledger.rows("SELECT parent_key FROM checkpoints WHERE run_id = ? ORDER BY step LIMIT 1", [R.run_id_for(job, 2)])
    assert first_of_2[0]["parent_key"] == resumed
    # Wasted GPU-seconds are the lost steps' time; the bill adds up across attempts. The step
    # time is the lost attempt's own: a loaded machine may run the two attempts at other speeds.
    wasted = ledger.scalar("SELECT coalesce(sum(seconds), 0) FROM costs WHERE job_id = ? AND kind = 'wasted'", [job])
    step_s = ledger.scalar(
        "SELECT (max(ts) - min(ts)) / (max(step) - min(step)) FROM metric_points WHERE run_id = ?",
        [R.run_id_for(job, 1)])
    assert abs(wasted - lost_steps * step_s) <= 2 * step_s + 1.2
    # The waste begins where training went on past the last checkpoint (its async save's call
    # returned), not where that save became durable a little later.
    last = ledger.one("SELECT created_at, trained_at FROM checkpoints WHERE run_id = ? ORDER BY step DESC LIMIT 1",
                      [R.run_id_for(job, 1)])
    assert last["trained_at"] is not None and last["trained_at"] < last["created_at"], last
    # (No wasted line at all when no progress was seen after it.)
    waste_from = ledger.scalar("SELECT min(start_at) FROM costs WHERE job_id = ? AND kind = 'wasted'", [job])
    assert waste_from is None or math.isclose(waste_from, last["trained_at"], abs_tol=1e-4), (waste_from, last)
    billed = ledger.scalar("SELECT sum(billed_usd) FROM instances WHERE job_id = ?", [job])
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), billed, rel_tol=1e-9)
    # And the weights are those of an uninterrupted run.
    ref = submit(settings, "charlm-finetune", CFG, experiment="kill-ref")
    assert run_attempt(settings, ref).state == "SUCCEEDED"
    assert final_weights(ledger, job) == final_weights(ledger, ref)


def test_a_notice_becomes_an_emergency_checkpoint_and_no_step_is_lost(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 90, "checkpoint.every_steps": 100}, experiment="notice")
    bg = Background(lambda: run_attempt(settings, job))
    wait_for(lambda: (last_step(ledger, job, 1) or 0) >= 15)
    provider = provider_for(settings, "sim_host_process")
    # A wide window (notice 1 s from now, reclaim in 10 s) so that a loaded machine's slow save
    # cannot make the early release look like a release at the deadline.
    reclaim_at = time.time() + 10
    provider.inject_reclaim(handle_of(settings, job, 1).instance, in_seconds=10, notice_seconds=9)
    first = bg.join()
    assert first.state == "LOST"
    emergency = ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? AND tier = 'emergency'", [job])
    assert len(emergency) == 1
    assert emergency[0]["step"] == last_step(ledger, job, 1)  # the newest state, nothing lost
    # The instance was released as soon as the emergency checkpoint was safe, not at the deadline.
    usage = ledger.rows("SELECT * FROM instance_usage WHERE run_id = ?", [R.run_id_for(job, 1)])[0]
    assert emergency[0]["created_at"] <= usage["stopped_at"] < reclaim_at - 1
    notices = ledger.rows("SELECT detail FROM events WHERE job_id = ? AND kind = 'host_notice'", [job])
    assert len(notices) == 1
    # The emergency save was planned against the notice's deadline, and said so before it was written.
    (plan,) = [json.loads(r["detail"]) for r in ledger.rows(
        "SELECT detail FROM events WHERE job_id = ? AND kind = 'emergency_plan'", [job])]
    assert plan["step"] == emergency[0]["step"] and plan["plan_fits"] is True and plan["time_left_s"] > 0
    second = run_attempt(settings, job)
    assert second.state == "SUCCEEDED"
    assert ledger.rows("SELECT resume_from FROM runs WHERE run_id = ?", [R.run_id_for(job, 2)])[0]["resume_from"] \
        == emergency[0]["checkpoint_key"]


def test_a_reclaim_set_by_training_progress_comes_at_that_step_on_any_machine(settings):
    """The market operator's override by progress (the demo's two reclaims): the notice comes
    when the workload reports the step, whatever the machine's speed, and no step is lost."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 400, "checkpoint.every_steps": 500},
                 experiment="at-step")
    bg = Background(lambda: run_attempt(settings, job))
    wait_for(lambda: running(ledger, job))
    provider_for(settings, "sim_host_process").inject_reclaim(handle_of(settings, job, 1).instance, at_step=30,
                                                              notice_seconds=5)
    first = bg.join()
    assert (first.state, first.failure_class) == ("LOST", "reclaim")
    emergency = ledger.rows("SELECT step FROM checkpoints WHERE job_id = ? AND tier = 'emergency'", [job])
    # The notice at step 30 (the agent polls for it every second at most), never before.
    assert len(emergency) == 1 and 30 <= emergency[0]["step"] < 400
    assert emergency[0]["step"] == last_step(ledger, job, 1)
    cancel(settings, job)


def test_orbit_sim_reclaim_at_a_step_then_orbit_logs_shows_every_attempt_and_how_it_ended(settings, capsys):
    """The two commands a user tries recovery with: `orbit sim reclaim JOB --at-step N` on the
    embedded market, and `orbit logs JOB` with each attempt headed by how it ended."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 120, "checkpoint.every_steps": 500},
                 experiment="cli-reclaim")
    with pytest.raises(SystemExit) as refused:  # not running yet: refused, naming the state and the fix
        main(["sim", "reclaim", job])
    assert refused.value.code == 2 and "only a job running on an instance" in capsys.readouterr().err
    bg = Background(lambda: run_attempt(settings, job))
    wait_for(lambda: running(ledger, job))
    main(["sim", "reclaim", job, "--at-step", "30", "--notice-seconds", "5"])
    assert "reclaimed when it reports step 30" in capsys.readouterr().out
    first = bg.join()
    assert (first.state, first.failure_class) == ("LOST", "reclaim")
    emergency = ledger.rows("SELECT step, checkpoint_key FROM checkpoints WHERE job_id = ? AND tier = 'emergency'", [job])
    assert len(emergency) == 1 and 30 <= emergency[0]["step"] < 120
    assert run_attempt(settings, job).state == "SUCCEEDED"
    assert ledger.rows("SELECT resume_from FROM runs WHERE run_id = ?", [R.run_id_for(job, 2)])[0]["resume_from"] \
        == emergency[0]["checkpoint_key"]
    main(["logs", job, "--tail", "5"])
    log = capsys.readouterr().out
    first_head, second_head = (line for line in log.splitlines() if " of 2: " in line)
    assert first_head.startswith(f"== {job} attempt 1 of 2: LOST (reclaim)")
    assert second_head.startswith(f"== {job} attempt 2 of 2: SUCCEEDED")
    assert log.index(first_head) < log.index(second_head)
    with pytest.raises(SystemExit) as ended:
        main(["sim", "reclaim", job, "--at-step", "-3"])
    assert ended.value.code == 2 and "--at-step" in capsys.readouterr().err


def test_oom_retries_once_with_the_whitelisted_change(settings):
    ledger = settings.ledger()
    # 16 MB of device memory: micro_batch 16 needs ~22 MB of activations, 8 needs ~11 MB.
    job = submit(settings, "charlm-finetune", {"config.steps": 6, "config.device_memory_mb": 16})
    out = run_attempt(settings, job)
    assert (out.state, out.failure_class) == ("FAILED", "oom")
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"], row["failure_class"]) == ("QUEUED", 2, "oom")
    bundle = R.bundle_for(ledger, job, 2)
    assert '"micro_batch": 8' in open(f"{bundle['path']}/job.json").read()
    assert run_attempt(settings, job).state == "SUCCEEDED"


def raising_template(root) -> str:
    """A template whose workload raises at run time: a user error the submission checks cannot see
    (an invalid config such as lr=-1 is refused at submission now)."""
    import shutil
    from pathlib import Path

    import orbit_dagster.workloads as shipped

    wl = root / "raising"
    wl.mkdir()
    shutil.copy(Path(shipped.__file__).parent / "charlm" / "config.py", wl / "config.py")
    (wl / "train.py").write_text("def main(ctx):\n    raise ValueError('the workload refuses its input')\n")
    (root / "raising.yaml").write_text(f"name: raising\nworkload: {wl}\neval: null\n")
    return str(root / "raising.yaml")


def test_a_second_oom_and_a_user_error_are_not_retried(settings, tmp_path):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 6, "config.device_memory_mb": 1})
    assert run_attempt(settings, job).failure_class == "oom"
    assert run_attempt(settings, job).failure_class == "oom"  # attempt 2, halved, still too big
    assert R.require_job(ledger, job)["state"] == "FAILED"
    bad = submit(settings, raising_template(tmp_path), {})
    out = run_attempt(settings, bad)
    assert (out.state, out.failure_class, out.exit_code) == ("FAILED", "user_error", 1)
    row = R.require_job(ledger, bad)
    assert (row["state"], row["attempt"], row["failure_class"]) == ("FAILED", 1, "user_error")


def test_too_many_interruptions_fail_the_job_with_a_readable_reason(settings):
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 400, "max_interruptions": 1})
    provider = provider_for(settings, "sim_host_process")
    for attempt in (1, 2):
        bg = Background(lambda: run_attempt(settings, job))
        wait_for(lambda: R.run(ledger, R.run_id_for(job, attempt)) is not None)
        provider.kill(handle_of(settings, job, attempt).instance)
        assert bg.join().state == "LOST"
        recover_lost(settings, job)
    row = R.require_job(ledger, job)
    assert row["state"] == "FAILED" and row["failure_class"] == "reclaim"
    assert "interrupted 2 times" in row["reason"] and "max_interruptions=1" in row["reason"]


def test_a_reclaim_after_the_last_step_resumes_from_the_final_checkpoint_and_trains_nothing_again(settings, tmp_path):
    """The notice comes after the last step and its durable checkpoint, while the script still
    does work that is not a step (an export, an upload): nothing is left to save, so no
    emergency checkpoint is made; the next attempt resumes from the final one, trains no step
    again, and the job ends with the weights of an uninterrupted run."""
    template = paced_template(tmp_path, name="paced-tail", steps=20, step_seconds=0.05, tail_seconds=10,
                              checkpoint="every_steps: 10, memory_every_steps: 10000000, interval_policy: fixed",
                              allow_overrides="config.tail_seconds")
    ledger = settings.ledger()
    job = submit(settings, template, experiment="after-the-last-step")
    bg = Background(lambda: run_attempt(settings, job))
    wait_for(lambda: running(ledger, job))
    # The host reads step 20 from the workload's events, then the notice comes; the reclaim 2 s
    # later, inside the script's 10 s tail.
    provider_for(settings, "sim_host_process").inject_reclaim(handle_of(settings, job, 1).instance, at_step=20,
                                                              notice_seconds=2)
    first = bg.join()
    assert (first.state, first.failure_class) == ("LOST", "reclaim")
    ckpts = ledger.rows("SELECT step, tier, checkpoint_key FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    assert [(c["step"], c["tier"]) for c in ckpts] == [(10, "durable"), (20, "durable")], ckpts
    assert len(ledger.rows("SELECT 1 FROM events WHERE job_id = ? AND kind = 'host_notice'", [job])) == 1
    second = run_attempt(settings, job)
    assert (second.state, second.attempt) == ("SUCCEEDED", 2)
    run2 = R.run_id_for(job, 2)
    assert R.run(ledger, run2)["resume_from"] == ckpts[-1]["checkpoint_key"]
    assert ledger.scalar("SELECT count(*) FROM metric_points WHERE run_id = ?", [run2]) == 0  # no step again
    billed = ledger.scalar("SELECT sum(billed_usd) FROM instances WHERE job_id = ?", [job])
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), billed, rel_tol=1e-9)
    ref = submit(settings, template, {"config.tail_seconds": 0.0}, experiment="after-the-last-step-ref")
    assert run_attempt(settings, ref).state == "SUCCEEDED"
    assert final_weights(ledger, job) == final_weights(ledger, ref)
