"""The plain-script template (a command workload) under a real Dagster daemon: its sensors
launch training, a reclaim at a step (the market operator's override) ends the first attempt
with an emergency checkpoint, the next resumes from it and finishes, every checkpoint is
evaluated, and the bill adds up."""
import functools
import math

import pytest

from orbit_dagster.control.providers import provider_for
from orbit_dagster.control.submit import submit
from orbit_dagster.deploy.instance import Daemon
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import RunHandle
from orbit_dagster.settings import Settings
from tests import helpers

pytestmark = pytest.mark.e2e
wait_for = functools.partial(helpers.wait_for, timeout=300, every=0.5)
CFG = {"config.steps": 3000, "checkpoint.every_steps": 1000}  # see tests/integration/test_command_on_sim.py


# Four minutes of a loaded machine (two training runs and four evaluation runs through the
# daemon): opt-in. `make test` runs the same story without the daemon in
# tests/integration/test_command_on_sim.py.
@pytest.mark.slow
def test_a_plain_script_job_survives_a_reclaim_under_the_daemon(orbit_home):
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    daemon = Daemon(settings).start()
    try:
        job = submit(settings, "plain-script", CFG, experiment="plain-e2e")

        def running(attempt):
            row = R.run(ledger, R.run_id_for(job, attempt))
            return row if row and row["state"] == "RUNNING" else None

        first = wait_for(lambda: running(1), what="attempt 1 running")
        provider_for(settings, "sim_host_process").inject_reclaim(
            RunHandle.model_validate_json(first["handle"]).instance, at_step=100, notice_seconds=5)
        second = wait_for(lambda: running(2), what="attempt 2 running")
        wait_for(lambda: R.require_job(ledger, job)["state"] == "SUCCEEDED", what="the job to succeed")
        ckpts = ledger.rows("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY attempt, step", [job])
        wait_for(lambda: ledger.scalar("SELECT count(*) FROM evaluations WHERE job_id = ? AND state = 'SUCCEEDED'",
                                       [job]) == len(ckpts), what="every checkpoint evaluated")
    finally:
        daemon.stop()

    (emergency,) = [c for c in ckpts if c["tier"] == "emergency"]
    last_1 = ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?", [R.run_id_for(job, 1)])
    assert emergency["attempt"] == 1 and emergency["step"] == last_1  # 0 lost steps
    assert second["resume_from"] == emergency["checkpoint_key"]
    assert [(c["attempt"], c["step"]) for c in ckpts] == [(1, last_1), (2, 1000), (2, 2000), (2, 3000)]
    assert ledger.scalar("SELECT count(*) FROM events WHERE job_id = ? AND kind IN "
                         "('checkpoint_conflict', 'checkpoint_rejected', 'event_rejected')", [job]) == 0
    assert ledger.scalar("SELECT count(*) FROM evaluations WHERE job_id = ?", [job]) == len(ckpts)  # once each
    billed = ledger.scalar("SELECT sum(billed_usd) FROM instances WHERE job_id = ?", [job])
    assert math.isclose(ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]), billed, rel_tol=1e-9)
