"""Bring your own training (docs/bring-your-own.md): an unmodified plain script, a Hugging Face
`Trainer`, a Lightning script and a 2-process DDP script under torchrun, each through the real
control plane on the sim market the way a user tries it: `orbit submit`, a reclaim forced
mid-training with `orbit sim reclaim`, the job resumed from the checkpoint the notice produced
(no step lost) and SUCCEEDED, every checkpoint registered once and evaluated, `orbit best`
the best by the primary metric and `orbit cost` adding up to the bill. No Dagster: the path
its runs take (tests/e2e covers the daemon). Bit-identical resume is checked per route in
test_command_workload.py, test_hf_route.py, test_lightning_route.py, test_torchrun_route.py.
"""
import json
import math

import pytest

from orbit_dagster.cli.commands import main
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from tests.helpers import Background, wait_for

# Long enough that the notice (the step reported, the market's tick, the agent's poll, up to a
# second; the framework's next step end) lands mid-run on an idle machine too: the plain
# script's step takes about a millisecond there, so it runs a thousand steps or more before
# its signal comes. Periodic checkpoints on both sides of the notice.
ROUTES = {
    "plain-script": {"config.steps": 6000, "checkpoint.every_steps": 2000},
    "hf-tiny-gpt2": {"config.steps": 1000, "checkpoint.every_steps": 500},
    "lightning-tiny": {"config.steps": 2000, "checkpoint.every_steps": 1000},
    "ddp-script": {"config.steps": 1500, "checkpoint.every_steps": 500},
}
RECLAIM_AT = 20


@pytest.fixture
def settings(orbit_home):
    return Settings.from_env(orbit_home)


def cli(capsys, *argv: str) -> str:
    main(list(argv))
    return capsys.readouterr().out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("template", list(ROUTES))
def test_a_reclaim_forced_mid_training_loses_no_step_and_the_job_ends_evaluated_ranked_and_billed(
        settings, capsys, template):
    ledger = settings.ledger()
    sets = [arg for key, value in ROUTES[template].items() for arg in ("--set", f"{key}={value}")]
    job = cli(capsys, "submit", template, *sets, "--experiment", f"byo-{template}").strip()
    bg = Background(lambda: run_attempt(settings, job))
    run_1 = R.run_id_for(job, 1)
    wait_for(lambda: (R.run(ledger, run_1) or {}).get("state") == "RUNNING", what="attempt 1 running", timeout=300)
    assert f"reclaimed when it reports step {RECLAIM_AT}" in cli(capsys, "sim", "reclaim", job, "--at-step",
                                                                 str(RECLAIM_AT), "--notice-seconds", "20")
    first = bg.join()
    assert (first.state, first.failure_class) == ("LOST", "reclaim")
    emergency = ledger.rows("SELECT * FROM checkpoints WHERE run_id = ? AND tier = 'emergency'", [run_1])
    last_1 = ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?", [run_1])
    steps = ROUTES[template]["config.steps"]
    assert len(emergency) == 1 and RECLAIM_AT <= emergency[0]["step"] < steps
    assert emergency[0]["step"] == last_1  # no step lost: the save came where the training stopped

    second = run_attempt(settings, job)
    assert (second.state, second.attempt) == ("SUCCEEDED", 2)
    assert R.run(ledger, R.run_id_for(job, 2))["resume_from"] == emergency[0]["checkpoint_key"]
    ckpts = ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY attempt, step", [job])
    every = ROUTES[template]["checkpoint.every_steps"]
    stopped = emergency[0]["step"]
    # A fast script may pass a periodic save before the notice reaches it (how far it runs
    # between the step the market watches for and the signal depends on the machine): those
    # are attempt 1's durable checkpoints; the one the notice produced is the emergency one.
    before = [s for s in range(every, steps + 1, every) if s < stopped]
    later = [s for s in range(every, steps + 1, every) if s > stopped]
    assert [(c["attempt"], c["step"], c["tier"]) for c in ckpts] == (
        [(1, s, "durable") for s in before] + [(1, stopped, "emergency")] + [(2, s, "durable") for s in later])
    assert all(c["train_loss"] is not None and c["bytes"] > 0 for c in ckpts)
    for attempt in (1, 2):  # each checkpoint a host reported is registered once
        lines = (settings.artifacts_dir / job / f"attempt-{attempt}" / "events.jsonl").read_text().splitlines()
        reported = [json.loads(x)["step"] for x in lines if '"type": "checkpoint"' in x]
        assert reported == [c["step"] for c in ckpts if c["attempt"] == attempt]
    assert ledger.scalar("SELECT count(*) FROM events WHERE job_id = ? AND kind IN "
                         "('checkpoint_conflict', 'checkpoint_rejected', 'event_rejected')", [job]) == 0

    # Every checkpoint evaluated, on one shared instance.
    evaluate_checkpoint(settings, ckpts[0]["checkpoint_key"], share=len(ckpts))
    evals = ledger.rows("SELECT checkpoint_key, state, metrics FROM evaluations WHERE job_id = ?", [job])
    assert sorted(e["checkpoint_key"] for e in evals) == sorted(c["checkpoint_key"] for c in ckpts)
    assert all(e["state"] == "SUCCEEDED" for e in evals)
    losses = {e["checkpoint_key"]: json.loads(e["metrics"])["eval/loss"] for e in evals}
    best = json.loads(cli(capsys, "best", f"byo-{template}", "--json"))
    assert best["checkpoint_key"] == min(losses, key=losses.get)
    assert math.isclose(best["metric_value"], min(losses.values()), rel_tol=1e-9)

    lines = json.loads(cli(capsys, "cost", "--by", "checkpoint", "--job", job, "--json").splitlines()[0])
    usage = ledger.one("SELECT sum((stopped_at - started_at) * usd_per_second) AS billed, sum(billed_usd) AS recorded "
                       "FROM instances WHERE job_id = ?", [job])
    assert math.isclose(sum(line["usd"] for line in lines), usage["recorded"], rel_tol=1e-6)
    assert math.isclose(usage["recorded"], usage["billed"], rel_tol=1e-6)
    log = cli(capsys, "logs", job, "--tail", "3")
    assert f"{job} attempt 1 of 2: LOST (reclaim)" in log and f"{job} attempt 2 of 2: SUCCEEDED" in log
