"""`checkpoint.on_rebalance: migrate` on the real sim market: the market's operator has the
instance serve AWS's rebalance recommendation once the workload reaches a step
(`orbit sim rebalance --at-step`); the agent takes its early durable checkpoint, and the price
sensor's next tick asks the migration policy: a job with long to run is moved make-before-break
by a migration run (the same `rental_job` run as a move on rising risk) and finishes on the
replacement; a job whose work left is too short for the move to pay stays, with that checkpoint."""
import json
import math
import threading
from datetime import datetime, timedelta, timezone

import dagster as dg
import pytest

from orbit_dagster.cli.commands import main
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.forced_reclaim import force_rebalance
from orbit_dagster.control.observations import measured_step_seconds
from orbit_dagster.control.submit import submit
from orbit_dagster.ledger import records as R
from orbit_dagster.ops.rental import rental_job
from orbit_dagster.resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource
from orbit_dagster.sensors.prices import price_feed_sensor
from orbit_dagster.settings import Settings
from tests.helpers import wait_for
from tests.integration.replay_driver import paced_template

# every_steps past the end, the interval as written: the durable checkpoints are the
# rebalance's, the move's and the last step's.
RARE = {"checkpoint.every_steps": 100_000, "checkpoint.interval_policy": "fixed"}

LONG_STEPS = 150
# The short-left test's job: the paced workload (tests/integration/paced_workload), whose steps
# last PACE_S of wall time whatever the machine's load, so the work left at any step is known
# before the job starts and no CPU is spent training towards it (a charlm job sized for a fast
# machine trained 640 steps, over 90 s of CPU on a loaded one, to leave the same 15 s).
PACE_S, SHORT_STEPS = 0.25, 120


def seen_reclaiming(ledger, offer_id: str, scale: float) -> None:
    """Other jobs' instances on this offer, each reclaimed 2 market seconds after it started,
    250 in the last 10 market minutes (what the fleet saw): a risky offer, on the order of a
    hundred reclaims per market hour, where the move pays for itself once the work left passes
    a market minute or less (the policy's costs: a restore, a save, both instances paid
    meanwhile). Written in wall time, which is market time / `scale`."""
    now = datetime.now(timezone.utc)
    rows = {"runs": [], "run_states": [], "instances": []}
    for i in range(250):
        run, inst = f"other#{i}", f"other-{i}"
        when, up = now - timedelta(seconds=(600 - 2 * i) / scale), timedelta(seconds=2 / scale)
        rows["runs"].append({"run_id": run, "job_id": "other", "attempt": i + 1, "offer_id": offer_id,
                             "instance_id": inst, "started_at": when - up, "state": "LOST",
                             "failure_class": "reclaim", "state_at": when})
        rows["run_states"].append({"run_id": run, "state": "LOST", "failure_class": "reclaim", "ts": when})
        rows["instances"].append({"instance_id": inst, "offer_id": offer_id, "purpose": "train", "job_id": "other",
                                  "spot": 1, "usd_per_second": 0.0, "started_at": when - up,
                                  "stopped_at": when, "billed_usd": 0.0})
    ledger.commit(rows)


def last_step(ledger, run_id: str) -> int:
    return ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?", [run_id]) or 0


def start(settings: Settings, scale: float, template: str = "charlm-finetune", overrides: dict | None = None):
    """The job's first attempt, trained past step 20 (enough to measure its step time) on an
    offer the fleet saw reclaiming."""
    ledger = settings.ledger()
    job = submit(settings, template, {"checkpoint.on_rebalance": "migrate", **RARE, **(overrides or {})})
    runner = threading.Thread(target=run_attempt, args=(settings, job), daemon=True)
    runner.start()
    run_id = R.run_id_for(job, 1)
    wait_for(lambda: last_step(ledger, run_id) >= 20, timeout=240, what="training past step 20")
    first = R.run(ledger, run_id)
    seen_reclaiming(ledger, first["offer_id"], scale)
    return ledger, job, runner, first


def price_sensor_tick(orbit_home) -> list[dg.RunRequest]:
    """One tick of the price-feed sensor, as the daemon runs it: the run requests it makes."""
    resources = {"orbit": OrbitResource(home=str(orbit_home)), "sim_market": SimMarketResource(),
                 "ssh_rental": SshRentalResource(), "aws_spot": AwsSpotResource()}
    with dg.build_sensor_context(resources=resources) as context:
        return list(price_feed_sensor.evaluate_tick(context).run_requests or [])


def recommended(ledger, run_id: str) -> None:
    """Wait until the host's `rebalance` record is in the ledger (what the sensor reads): the
    workload has to train to the armed step first, minutes on a loaded machine."""
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM events WHERE run_id = ? AND kind = 'host_rebalance'",
                                   [run_id]), timeout=600, every=0.05, what="the rebalance record in the ledger")


def decision(ledger, job: str) -> dict:
    [row] = ledger.rows("SELECT * FROM decisions WHERE job_id = ? AND decision_id LIKE 'rebalance:%'", [job])
    return {**row, "inputs": json.loads(row["inputs"])}


def billed_in_full(ledger, job: str, instances: int) -> None:
    """Every instance of the job released and billed, to the second it lived; attributed = billed."""
    inst = ledger.one("""SELECT count(*) AS n, count(stopped_at) AS stopped, min(billed_usd) AS least,
                                sum((stopped_at - started_at) * usd_per_second) AS lived,
                                sum(billed_usd) AS billed FROM instances WHERE job_id = ?""", [job])
    assert (inst["n"], inst["stopped"]) == (instances, instances) and inst["least"] > 0, inst
    assert ledger.scalar("SELECT count(*) FROM instance_usage WHERE job_id = ? AND running", [job]) == 0
    assert math.isclose(inst["billed"], inst["lived"], rel_tol=1e-6)
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), inst["billed"],
                        rel_tol=1e-9)


def test_a_rebalance_moves_a_long_job_make_before_break(orbit_home, monkeypatch):
    # A compressed market, as `orbit demo` runs it: the policy weighs the work left in market
    # seconds (steps left x the measured step time x 60), so the job's 120-odd steps left are
    # many market minutes, far more than the move costs, on a fast machine or a slow one,
    # while the test trains them in well under a minute.
    scale = 60.0
    monkeypatch.setenv("ORBIT_SIM_SCALE", str(scale))
    settings = Settings.from_env(orbit_home)
    ledger, job, runner, first = start(settings, scale, overrides={"config.steps": LONG_STEPS})
    run1 = first["run_id"]
    at = last_step(ledger, run1) + 5
    force_rebalance(settings, job, at_step=at)
    recommended(ledger, run1)

    [request] = price_sensor_tick(orbit_home)
    assert request.tags["orbit/action"] == "migrate" and request.tags["orbit/trigger"] == "rebalance", request.tags
    d = decision(ledger, job)
    assert d["kind"] == "migration" and d["inputs"]["action"] == "migrate", json.dumps(d["inputs"])
    assert d["inputs"]["trigger"] == "rebalance" and d["inputs"]["inputs"]["remaining_work_s"] > 0
    assert request.tags["orbit/offer"] == d["chosen"] != first["offer_id"]
    # The move is a run of its own, as the daemon would launch it from the request.
    resources = {"orbit": OrbitResource(home=str(orbit_home)), "sim_market": SimMarketResource(),
                 "ssh_rental": SshRentalResource(), "aws_spot": AwsSpotResource()}
    moved = rental_job.execute_in_process(run_config=request.run_config, resources=resources, tags=request.tags)
    assert moved.success and "moving" in moved.output_for_node("rental_op"), moved.output_for_node("rental_op")
    runner.join(120)
    assert not runner.is_alive()
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"], row["failure_class"]) == ("QUEUED", 2, "migration"), row
    assert R.interruptions(ledger, job) == 0  # a chosen move is not an interruption
    [started] = ledger.rows("SELECT detail FROM events WHERE job_id = ? AND kind = 'migration_started'", [job])
    replacement = json.loads(started["detail"])["replacement"]
    assert ledger.scalar("SELECT count(*) FROM events WHERE job_id = ? AND kind = 'host_rebalance'", [job]) == 1

    # The replacement takes the job to its end.
    assert run_attempt(settings, job).state == "SUCCEEDED"
    assert R.require_job(ledger, job)["state"] == "SUCCEEDED"
    run2 = R.run(ledger, R.run_id_for(job, 2))
    assert run2["instance_id"] == replacement and run2["offer_id"] == d["chosen"]
    # On the old host: the agent's early durable checkpoint at the recommendation's step or
    # just after, then the move's save of the newest state, which the replacement resumed
    # from: 0 steps lost.
    ckpts = ledger.rows("SELECT checkpoint_key, tier, step FROM checkpoints WHERE run_id = ? ORDER BY step", [run1])
    assert [c["tier"] for c in ckpts] == ["durable", "emergency"] and ckpts[0]["step"] >= at, ckpts
    assert run2["resume_from"] == ckpts[-1]["checkpoint_key"] and ckpts[-1]["step"] == last_step(ledger, run1)
    assert last_step(ledger, run2["run_id"]) == LONG_STEPS
    # Make before break: the replacement was up before the old instance was released.
    usage = {r["instance_id"]: r for r in ledger.rows("SELECT * FROM instance_usage WHERE job_id = ?", [job])}
    assert usage[replacement]["started_at"] < usage[first["instance_id"]]["stopped_at"]
    billed_in_full(ledger, job, 2)


def test_a_job_with_too_little_left_for_the_move_to_pay_takes_the_early_checkpoint_only(orbit_home, tmp_path, capsys):
    # The market's own pace (scale 1), so the work left is wall seconds: the recommendation is
    # served at the step that leaves 15 s of training at the step time measured (the paced
    # job's PACE_S). That is a few times what the agent's poll (1 s), its early save and the
    # sensor's tick take (about 3 s), so the job still runs when the policy is asked, and about
    # half the half minute or so from which the move pays on this offer (`seen_reclaiming`).
    settings = Settings.from_env(orbit_home)
    template = paced_template(tmp_path, name="paced-rebalance", steps=SHORT_STEPS, step_seconds=PACE_S,
                              checkpoint="every_steps: 100000, memory_every_steps: 10000000, interval_policy: fixed",
                              allow_overrides="checkpoint.on_rebalance, checkpoint.every_steps, "
                                              "checkpoint.interval_policy")
    ledger, job, runner, first = start(settings, 1.0, template)
    run1 = first["run_id"]
    at = max(SHORT_STEPS - math.ceil(15.0 / measured_step_seconds(ledger, "paced-rebalance")),
             last_step(ledger, run1) + 10)
    main(["sim", "rebalance", job, "--at-step", str(at)])  # the operator's command
    assert f"recommended to rebalance when it reports step {at}" in capsys.readouterr().out
    recommended(ledger, run1)

    assert price_sensor_tick(orbit_home) == []
    d = decision(ledger, job)
    assert d["inputs"]["action"] == "checkpoint" and d["inputs"]["migrate"] is False, json.dumps(d["inputs"])
    assert "too short" in d["inputs"]["reason"] and d["chosen"] == first["offer_id"]
    runner.join(120)
    assert not runner.is_alive()
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"]) == ("SUCCEEDED", 1), row
    assert not ledger.scalar("SELECT count(*) FROM events WHERE job_id = ? AND kind = 'migration_started'", [job])
    steps = [r["step"] for r in ledger.rows(
        "SELECT step FROM checkpoints WHERE job_id = ? AND tier = 'durable' ORDER BY step", [job])]
    assert len(steps) == 2 and at <= steps[0] < SHORT_STEPS and steps[-1] == SHORT_STEPS, steps  # the early one, the last step's
    billed_in_full(ledger, job, 1)
    with pytest.raises(SystemExit) as refused:  # a finished job has no instance to recommend leaving
        main(["sim", "rebalance", job])
    assert refused.value.code == 2 and "only a job running on an instance" in capsys.readouterr().err
