"""Proactive migration on the real sim market: make-before-break when an offer's risk keeps rising."""
import json
import threading
from datetime import datetime, timedelta, timezone

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.migration import consider_migrations, risk_history
from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import RunHandle
from orbit_dagster.settings import Settings
from tests.helpers import wait_for


def reclaims_seen_on(ledger, offer_id: str, times: list[datetime]) -> None:
    """Other jobs' attempts on this offer, reclaimed at these times (what the fleet saw)."""
    rows = {"runs": [], "run_states": [], "instances": []}
    for i, when in enumerate(times):
        run, inst = f"other#{i}", f"other-{i}"
        rows["runs"].append({"run_id": run, "job_id": "other", "attempt": i + 1, "offer_id": offer_id,
                             "instance_id": inst, "started_at": when - timedelta(seconds=20), "state": "LOST",
                             "failure_class": "reclaim", "state_at": when})
        rows["run_states"].append({"run_id": run, "state": "LOST", "failure_class": "reclaim", "ts": when})
        rows["instances"].append({"instance_id": inst, "offer_id": offer_id, "purpose": "train", "job_id": "other",
                                  "spot": 1, "usd_per_second": 0.0, "started_at": when - timedelta(seconds=20),
                                  "stopped_at": when, "billed_usd": 0.0})
    ledger.commit(rows)


def test_rising_risk_moves_the_job_make_before_break(orbit_home, monkeypatch):
    # A market without notices (an SSH box, a GCP zone that skips them): each reclaim then
    # costs work, which is when leaving a zone that keeps reclaiming pays for itself.
    monkeypatch.setenv("ORBIT_SIM_NOTICE_SECONDS", "0")
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    # Long enough that moving pays for itself (the policy weighs the work left).
    job = submit(settings, "charlm-finetune", {"config.steps": 6000, "checkpoint.every_steps": 2000})
    runner = threading.Thread(target=run_attempt, args=(settings, job), daemon=True)
    runner.start()
    wait_for(lambda: (ledger.scalar("SELECT max(step) FROM metric_points WHERE job_id = ?", [job]) or 0) >= 20,
             what="some training")
    first = R.run(ledger, R.run_id_for(job, 1))
    offer = RunHandle.model_validate_json(first["handle"]).instance.offer
    now = datetime.now(timezone.utc)
    # The fleet saw this zone reclaim 6, then 10, then 14 instances in the last three minutes.
    reclaims_seen_on(ledger, offer.offer_id, [now - timedelta(seconds=s) for s in [150] * 6 + [90] * 10 + [30] * 14])
    history = risk_history(ledger, offer, now, 60.0)
    assert all(b > a for a, b in zip(history, history[1:]))  # three rises in four windows

    moves = consider_migrations(settings, now=now, window_s=60.0)
    assert len(moves) == 1 and moves[0]["from"] == offer.offer_id and moves[0]["to"] != offer.offer_id
    runner.join(120)
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"], row["failure_class"]) == ("QUEUED", 2, "migration")
    assert R.interruptions(ledger, job) == 0  # a chosen move is not an interruption
    decision = ledger.rows("SELECT * FROM decisions WHERE job_id = ? AND kind = 'migration'", [job])[0]
    assert json.loads(decision["inputs"])["migrate"] is True and decision["chosen"] == moves[0]["to"]

    runner = threading.Thread(target=run_attempt, args=(settings, job), daemon=True)
    runner.start()
    wait_for(lambda: ledger.scalar("SELECT count(*) FROM metric_points WHERE run_id = ?", [R.run_id_for(job, 2)]),
             what="attempt 2 training")
    cancel(settings, job)
    runner.join(60)
    run2 = R.run(ledger, R.run_id_for(job, 2))
    assert run2["instance_id"] == moves[0]["replacement"] and run2["offer_id"] == moves[0]["to"]
    emergency = ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE run_id = ? AND tier = 'emergency'",
                            [R.run_id_for(job, 1)])
    assert len(emergency) == 1 and run2["resume_from"] == emergency[0]["checkpoint_key"]
    # Make before break: the replacement was up before the old instance was released.
    times = {r["instance_id"]: r for r in ledger.rows("SELECT * FROM instance_usage WHERE job_id = ?", [job])}
    assert times[moves[0]["replacement"]]["started_at"] < times[first["instance_id"]]["stopped_at"]
    assert ledger.scalar("SELECT count(*) FROM instances WHERE job_id = ? AND purpose = 'train'", [job]) == 2
