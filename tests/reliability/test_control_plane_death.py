"""The control plane meets a full disk: the disk under the whole home fills while a job
trains through a real daemon, then space returns (docs/reliability.md, *The control plane
dies too*). Its SIGKILLs are the kill soak's (test_control_plane_soak.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.deploy.instance import Daemon
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from tests import helpers
from tests.conftest import kill_processes_under
from tests.reliability.control_plane import bill_of
from tests.security.test_cli_errors import fill

# Reconcile's promise: within one interval of the daemon being back (2 minutes), plus the
# time a loaded machine takes to start the daemon and a run.
RECONCILE_S = 120.0


def _running(ledger, job_id: str, attempt: int = 1):
    row = R.run(ledger, R.run_id_for(job_id, attempt))
    return row if row and row["state"] == "RUNNING" else None


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


# Minutes of daemon, training and retry on a tmpfs: `make test-all`. In `make test` the agent's exit 74 on a
# full disk is test_defect_1_6_8_attempts.py::test_defect_8_*, the daemon on a full disk test_daemon_faults.py.
@pytest.mark.slow
@pytest.mark.timeout(1200)
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
