"""The control plane dies too: every process of ours SIGKILLed while a job trains, then
`orbit daemon` again. Reconcile takes up what the dead processes left (docs/reliability.md).

A real Dagster daemon, its code server and run workers, on the embedded market; the hosts
(the execution plane) keep training through the outage."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import dagster as dg
import pytest

from orbit_dagster.settings import Settings
from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.deploy.instance import Daemon, dagster_instance
from orbit_dagster.ledger import records as R
from tests import helpers
from tests.conftest import kill_processes_under
from tests.reliability.control_plane import (bill_of, checkpoints_on_disk, control_plane, materializations,
                                             processes_of, sigkill, wait_gone)
from tests.security.test_cli_errors import fill

# Reconcile's promise: within one interval of the daemon being back (2 minutes), plus the
# time a loaded machine takes to start the daemon and a run.
RECONCILE_S = 120.0


def _running(ledger, job_id: str, attempt: int = 1):
    row = R.run(ledger, R.run_id_for(job_id, attempt))
    return row if row and row["state"] == "RUNNING" else None


@pytest.mark.fault("SIGKILL of every control-plane process at once (the daemon's process group, its code server, "
                   "the run worker following the job) mid-training, then `orbit daemon` again",
                   expect="the dead run failed in Dagster; the attempt re-attached, never relaunched; SUCCEEDED within "
                          "the reconcile interval; every checkpoint on disk registered and reported once; attributed "
                          "= billed; no instance left running")
def test_sigkill_of_the_whole_control_plane_mid_training_then_restart_finishes_the_job_once(orbit_home):
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    daemon = Daemon(settings).start()
    try:
        job = submit(settings, "charlm-finetune", {"config.steps": 200, "checkpoint.every_steps": 20},
                     experiment="cp-death")
        helpers.wait_for(lambda: _running(ledger, job), timeout=240, every=0.5, what="attempt 1 running")
        helpers.wait_for(lambda: ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job]) >= 1,
                         timeout=240, every=0.5, what="a first checkpoint registered")
        victims = control_plane(orbit_home)
        kinds = {p.kind for p in victims}
        assert {"supervisor", "daemon", "run_worker"} <= kinds, victims
        # The daemon's whole process group and the run worker following the job, at once.
        wait_gone(sigkill(victims, orbit_home))
        daemon.proc.wait()
        assert not control_plane(orbit_home)
        assert any(p.kind == "host" for p in processes_of(orbit_home)), "the host trains on"
        time.sleep(3.0)  # the operator notices, then starts the daemon again
        daemon = Daemon(settings).start()
        # Training goes on on the host meanwhile; its end comes while (or after) the daemon is back.
        helpers.wait_for(lambda: R.require_job(ledger, job)["state"] != "RUNNING", timeout=600, every=1.0,
                         what="the attempt taken up and ended")
        ended = R.require_job(ledger, job)
        assert ended["state"] == "SUCCEEDED", ended
        assert int(ended["attempt"]) == 1  # taken up, never launched again
        exit_at = ledger.scalar("SELECT max(ts) FROM metric_points WHERE job_id = ?", [job])
        assert float(ended["state_at"]) - float(exit_at) < RECONCILE_S + 60
        with dagster_instance(settings) as instance:
            helpers.wait_for(lambda: not instance.get_run_records(dg.RunsFilter(
                statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING], tags={"orbit/job": job})),
                timeout=120, every=1.0, what="no run of the job left STARTED")
            dead = [r for r in instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": job}))
                    if r.dagster_run.status == dg.DagsterRunStatus.FAILURE]
            assert dead, "the killed run is failed in Dagster, not left STARTED"
            materialized = materializations(instance, "checkpoint")
    finally:
        daemon.stop()
    on_disk = checkpoints_on_disk(settings, job)
    registered = {r["checkpoint_key"]: r for r in R.checkpoints(ledger, job, live_only=False)}
    live = {k for k, r in registered.items() if r["deleted_at"] is None}  # retention may have deleted some
    assert on_disk and on_disk <= set(registered) and live <= on_disk, (on_disk, sorted(registered))
    assert len(materialized) == len(registered) and all(n == 1 for n in materialized.values()), materialized
    attributed, billed = bill_of(ledger, job)
    assert round(attributed, 2) == round(billed, 2) and abs(attributed - billed) < 1e-9
    assert ledger.scalar("SELECT count(*) FROM instances WHERE job_id = ? AND stopped_at IS NULL", [job]) == 0
    assert not [p for p in processes_of(orbit_home) if p.kind in ("host", "agent")]


@pytest.fixture
def disk_home(tmp_path, monkeypatch):
    """$ORBIT_HOME on a 128 MiB tmpfs: ledger, Dagster storage, the market's hosts and the store."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a size-limited tmpfs (simulating a full disk)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", f"orbit-test-{uuid.uuid4().hex[:8]}", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"this machine does not allow mounting a tmpfs: {proc.stderr.strip()}")
    home = mnt / "home"
    monkeypatch.setenv("ORBIT_HOME", str(home))
    try:
        yield home
    finally:
        kill_processes_under(home)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.fault("the disk under the whole home (ledger, Dagster storage, hosts, store; a 128 MiB tmpfs) fills "
                   "while a job trains through the daemon; space returns a minute later",
                   expect="the agent exits `infrastructure`; once space returns the attempt is closed LOST "
                          "(infrastructure), its instance released and billed, and the job retried; attributed = "
                          "billed")
def test_a_full_disk_under_the_home_ends_the_attempt_and_retries_it_once_space_returns(disk_home):
    settings = Settings.from_env(disk_home)
    ledger = settings.ledger()
    daemon = Daemon(settings).start()
    try:
        job = submit(settings, "charlm-finetune", {"config.steps": 4000, "checkpoint.every_steps": 10},
                     experiment="disk")
        helpers.wait_for(lambda: ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job]) >= 1,
                         timeout=300, every=0.5, what="a first checkpoint registered")
        filler = fill(disk_home.parent)
        exit_file = next((settings.sim_dir / "instances").glob("*/child_exit.json"), None)
        deadline = time.time() + 120
        while exit_file is None and time.time() < deadline:  # the next save fails: the agent exits
            time.sleep(0.5)
            exit_file = next((settings.sim_dir / "instances").glob("*/child_exit.json"), None)
        time.sleep(30.0)  # the control plane meets the full disk too, for a while
        filler.unlink()
        helpers.wait_for(lambda: int(R.require_job(ledger, job)["attempt"]) >= 2, timeout=RECONCILE_S + 120,
                         every=1.0, what="the attempt closed and the job retried")
        first = R.run(ledger, R.run_id_for(job, 1))
        assert (first["state"], first["failure_class"]) == ("LOST", "infrastructure"), first
        helpers.wait_for(lambda: _running(ledger, job, 2), timeout=240, every=1.0, what="attempt 2 running")
        cancel(settings, job)
        helpers.wait_for(lambda: not ledger.scalar(
            "SELECT count(*) FROM instances WHERE job_id = ? AND stopped_at IS NULL", [job]), timeout=120, every=1.0,
            what="every instance released")
    finally:
        daemon.stop()
    assert exit_file is not None
    attributed, billed = bill_of(ledger, job)
    assert abs(attributed - billed) < 1e-9
