"""The control plane without Dagster, on the real sim market: submit -> train -> evaluate -> best -> cost."""
import json
import math

import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.best import compute_best
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.control.submit import retry, submit
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.settings import Settings

FAST = {"config.steps": 24, "checkpoint.every_steps": 8}


@pytest.fixture
def settings(orbit_home):
    return Settings.from_env(orbit_home)


def test_a_job_trains_checkpoints_evaluates_ranks_and_bills(settings):
    job = submit(settings, "charlm-finetune", FAST, experiment="exp")
    out = run_attempt(settings, job)
    assert out.state == "SUCCEEDED" and out.last_step == 24
    ledger = settings.ledger()
    ckpts = ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    assert [c["step"] for c in ckpts] == [8, 16, 24]
    assert [c["checkpoint_key"] for c in ckpts] == [f"{job}/a1/8", f"{job}/a1/16", f"{job}/a1/24"]
    assert [c["parent_key"] for c in ckpts] == [None, f"{job}/a1/8", f"{job}/a1/16"]
    assert all(c["tier"] == "durable" and c["bytes"] > 0 and len(c["sha256"]) == 64 for c in ckpts)

    results = [evaluate_checkpoint(settings, c["checkpoint_key"]) for c in ckpts]
    assert all({"eval/loss", "eval/accuracy"} <= set(r["metrics"]) for r in results)
    best = compute_best(settings, "exp")
    losses = {r["checkpoint_key"]: r["metrics"]["eval/loss"] for r in results}
    assert best["checkpoint_key"] == min(losses, key=losses.get)
    assert best["metric_name"] == "eval/loss" and best["resolved_from"] == "template"
    assert [c["checkpoint_key"] for c in best["lineage"]][-1] == f"{job}/a1/8"

    # The bill adds up: every instance's (stop - start) x price, and every cost view sums to it.
    usage = ledger.one("""SELECT sum((stopped_at - started_at) * usd_per_second) AS billed, sum(billed_usd) AS recorded
                          FROM instances WHERE job_id = ?""", [job])
    attributed = ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job])
    assert math.isclose(attributed, usage["recorded"], rel_tol=1e-9)  # the lines sum to the bill
    assert math.isclose(usage["recorded"], usage["billed"], rel_tol=1e-6)  # (times stored to the microsecond)
    per_ckpt = ledger.rows("SELECT * FROM cost_by_checkpoint WHERE job_id = ?", [job])
    assert math.isclose(sum(r["usd"] for r in per_ckpt), usage["recorded"], rel_tol=1e-9)
    lines = {r["line"]: r for r in per_ckpt}
    assert {c["checkpoint_key"] for c in ckpts} <= set(lines) and set(lines) - {c["checkpoint_key"] for c in ckpts} \
        <= {"(overhead)", "(wasted)"}
    assert all(lines[c["checkpoint_key"]]["eval_usd"] > 0 and lines[c["checkpoint_key"]]["train_usd"] > 0
               for c in ckpts)
    # `orbit logs JOB`: the workload's log, collected from the host.
    from orbit_dagster.control.logs import attempt_log

    log = attempt_log(settings, job)
    assert "checkpoint step=24" in log and "exit code=0" in log
    assert "train/loss=" in log  # metric values, not only their step
    assert "RUNNING" in log and "SUCCEEDED" in log  # the control plane's account of the attempt


def test_rerunning_a_finished_bundle_reproduces_the_weights(settings):
    job = submit(settings, "charlm-finetune", FAST, experiment="repro")
    run_attempt(settings, job)
    assert retry(settings, job, from_scratch=True) == 2
    out = run_attempt(settings, job)
    assert out.state == "SUCCEEDED" and out.attempt == 2

    def final(attempt):
        lines = (settings.artifacts_dir / job / f"attempt-{attempt}" / "events.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if '"checkpoint"' in x][-1]["weights_sha256"]

    assert final(1) == final(2)


def test_retry_changes_config_only_through_the_whitelist(settings):
    job = submit(settings, "charlm-finetune", FAST)
    run_attempt(settings, job)
    with pytest.raises(OrbitError) as err:
        retry(settings, job, {"config.d_model": 16})
    assert "config.d_model" in str(err.value)
    assert settings.ledger().scalar("SELECT max(attempt) FROM job_states WHERE job_id = ?", [job]) == 1
    assert retry(settings, job, {"config.steps": 32}) == 2
    out = run_attempt(settings, job)
    assert out.last_step == 32 and out.state == "SUCCEEDED"
    ledger = settings.ledger()
    # `config.steps` is resume-compatible: training longer continues the same lineage.
    assert ledger.rows("SELECT resume_from FROM runs WHERE run_id = ?", [f"{job}#2"]) == [{"resume_from": f"{job}/a1/24"}]
    assert ledger.scalar("SELECT count(*) FROM bundles WHERE job_id = ?", [job]) == 2


def test_a_job_that_is_not_queued_is_not_launched_again(settings):
    job = submit(settings, "charlm-finetune", FAST)
    first = run_attempt(settings, job)
    again = run_attempt(settings, job)  # the same attempt: reported, not relaunched
    assert again.reattached and again.state == first.state
    assert settings.ledger().scalar("SELECT count(*) FROM instances WHERE purpose = 'train' AND job_id = ?", [job]) == 1


@pytest.mark.slow  # the same defect is tests/reliability/test_defect_1_6_8_attempts.py::test_defect_1_*
def test_retry_from_scratch_with_another_lr_never_reports_the_old_weights(settings):
    """Issue 8, defect 1: a retry used to register none of its checkpoints and keep the old ones."""
    job = submit(settings, "charlm-finetune", FAST, experiment="lr")
    run_attempt(settings, job)
    ledger = settings.ledger()
    old = {r["sha256"] for r in ledger.rows("SELECT sha256 FROM checkpoints WHERE job_id = ?", [job])}
    for c in ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE job_id = ?", [job]):
        evaluate_checkpoint(settings, c["checkpoint_key"])
    assert retry(settings, job, {"config.lr": 0.01}, from_scratch=True) == 2
    out = run_attempt(settings, job)
    assert out.state == "SUCCEEDED" and out.attempt == 2
    new = ledger.rows("SELECT checkpoint_key, sha256, weights_sha256, lineage FROM checkpoints WHERE run_id = ?",
                      [f"{job}#2"])
    assert [r["checkpoint_key"] for r in new] == [f"{job}/a2/8", f"{job}/a2/16", f"{job}/a2/24"]
    events = [json.loads(x) for x in (settings.artifacts_dir / job / "attempt-2" / "events.jsonl").read_text().splitlines()]
    written = {e["sha256"] for e in events if e["type"] == "checkpoint"}
    assert {r["sha256"] for r in new} == written and not written & old  # what attempt 2 wrote, nothing else
    assert ledger.one("SELECT lineage FROM jobs WHERE job_id = ?", [job])["lineage"] == new[0]["lineage"]
    assert ledger.one("SELECT resume_from FROM runs WHERE run_id = ?", [f"{job}#2"])["resume_from"] is None
    for r in new:
        evaluate_checkpoint(settings, r["checkpoint_key"])
    best = compute_best(settings, "lr")
    assert best["checkpoint_key"].startswith(f"{job}/a2/")  # only the new lineage is ranked ...
    assert best["candidates"] == 3
    every = compute_best(settings, "lr", lineage="all")  # ... unless a person asks for the old one too
    assert every["candidates"] == 6


def test_a_deadline_the_spot_market_cannot_meet_rents_on_demand(settings):
    """The spot/on-demand switch is the deadline policy `orbit simulate` replays, asked at dispatch."""
    job = submit(settings, "charlm-finetune", {**FAST, "deadline_hours": 0.001}, experiment="deadline")
    out = run_attempt(settings, job)
    assert out.state == "SUCCEEDED"
    ledger = settings.ledger()
    decision = ledger.one("SELECT chosen, inputs FROM decisions WHERE job_id = ? AND kind = 'spot_or_on_demand'", [job])
    assert decision["chosen"] == "on_demand" and "deadline" in json.loads(decision["inputs"])["reason"]
    inst = ledger.one("SELECT spot, offer_id, usd_per_second FROM instances WHERE job_id = ? AND purpose = 'train'", [job])
    assert inst["spot"] == 0 and inst["offer_id"].endswith(":on-demand")


def test_without_a_deadline_the_job_rents_spot_and_records_no_switch(settings):
    job = submit(settings, "charlm-finetune", FAST, experiment="nodeadline")
    assert run_attempt(settings, job).state == "SUCCEEDED"
    ledger = settings.ledger()
    assert ledger.scalar("SELECT count(*) FROM decisions WHERE job_id = ? AND kind = 'spot_or_on_demand'", [job]) == 0
    assert ledger.scalar("SELECT spot FROM instances WHERE job_id = ? AND purpose = 'train'", [job]) == 1
