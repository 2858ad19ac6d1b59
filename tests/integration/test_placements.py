"""The example template on every provider, changing only the placement override: the sim
market, an SSH rental host (a real sshd on loopback), AWS EC2 spot (moto's server)."""
import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.evaluate import evaluate_checkpoint
from orbit_dagster.control.submit import submit
from orbit_dagster.settings import Settings
from orbit_dagster.storage import store_of
from tests.integration.moto_fixtures import REGION, ami, aws_env, ec2_host, moto_ami, moto_server, s3_bucket  # noqa: F401

SMALL = {"config.steps": 8, "checkpoint.every_steps": 4}


def run_the_example(settings: Settings, placement: str) -> str:
    job = submit(settings, "charlm-finetune", {**SMALL, "placement": placement}, experiment=placement)
    out = run_attempt(settings, job, poll_s=0.1)
    assert (out.state, out.last_step) == ("SUCCEEDED", 8), out.reason
    ledger = settings.ledger()
    ckpts = ledger.rows("SELECT checkpoint_key, uri, sha256 FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    assert len(ckpts) == 2 and all(store_of(c["uri"]).verify(c["uri"]).digest == c["sha256"] for c in ckpts)
    metrics = evaluate_checkpoint(settings, ckpts[-1]["checkpoint_key"])["metrics"]
    assert metrics["eval/loss"] > 0
    assert ledger.scalar("SELECT sum(usd) FROM costs WHERE job_id = ?", [job]) > 0
    return job


def test_sim(orbit_home):
    settings = Settings.from_env(orbit_home)
    job = run_the_example(settings, "sim")
    assert settings.ledger().scalar("SELECT provider FROM runs WHERE job_id = ?", [job]) == "sim"


def test_ssh_rental_host_on_loopback(orbit_home, ssh_inventory, monkeypatch):
    monkeypatch.setenv("ORBIT_SSH_HOSTS", str(ssh_inventory()))
    settings = Settings.from_env(orbit_home)
    job = run_the_example(settings, "ssh_rental")
    ledger = settings.ledger()
    assert ledger.scalar("SELECT provider FROM runs WHERE job_id = ?", [job]) == "ssh"
    # The host wrote to its own disk; the control plane copied each checkpoint into its store.
    assert all(c["uri"].startswith(settings.store_uri) for c in ledger.rows(
        "SELECT uri FROM checkpoints WHERE job_id = ?", [job]))
    assert ledger.scalar("SELECT gpu_slots FROM instances WHERE job_id = ? AND purpose = 'train'", [job]) is not None


@pytest.mark.slow  # the AWS path end to end is tests/integration/test_aws_provider.py; this adds the placement table
def test_aws_spot_through_moto(orbit_home, aws_env, ami, s3_bucket, ec2_host, monkeypatch):
    orbit_home.mkdir(parents=True, exist_ok=True)
    (orbit_home / "aws_spot_prices.tsv").write_text("use1-az1\tg6.xlarge\tLinux/UNIX\t0.35\t2026-01-01T00:00:00Z\n")
    monkeypatch.setenv("ORBIT_AWS_ENDPOINT_URL", aws_env)
    monkeypatch.setenv("ORBIT_AWS_IMAGE_ID", ami)
    for k, v in ec2_host.environment().items():  # the instances' SSH stands in on loopback
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ORBIT_CHECKPOINT_STORE", f"s3://{s3_bucket}/ckpt")  # hosts on EC2 write to S3
    settings = Settings.from_env(orbit_home)
    job = run_the_example(settings, "aws_spot")
    ledger = settings.ledger()
    assert ledger.scalar("SELECT provider FROM runs WHERE job_id = ?", [job]) == "aws"
    assert all(c["uri"].startswith(f"s3://{s3_bucket}/ckpt/") for c in ledger.rows(
        "SELECT uri FROM checkpoints WHERE job_id = ?", [job]))


def test_a_workload_killed_on_the_ssh_host_is_recovered_by_the_reclaim_path(orbit_home, ssh_inventory, monkeypatch):
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    from orbit_dagster.ledger import records as R

    monkeypatch.setenv("ORBIT_SSH_HOSTS", str(ssh_inventory()))
    settings = Settings.from_env(orbit_home)
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"placement": "ssh_rental", "config.steps": 60,
                                               "checkpoint.every_steps": 10})
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(first=run_attempt(settings, job, poll_s=0.1)), daemon=True)
    runner.start()
    deadline = time.time() + 120
    while time.time() < deadline and ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job]) < 2:
        time.sleep(0.2)
    # Kill the remote agent from outside (no exit file, no notice): the host is still there.
    remote = str(orbit_home.parent / "remote")  # the fixture host's workdir
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_train_agent_under(p, remote)]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    runner.join(120)
    assert (outcome["first"].state, outcome["first"].failure_class) == ("LOST", "reclaim")
    row = R.require_job(ledger, job)
    assert (row["state"], row["attempt"]) == ("QUEUED", 2)
    second = run_attempt(settings, job, poll_s=0.1)
    assert second.state == "SUCCEEDED"
    last_durable = ledger.rows("SELECT checkpoint_key FROM checkpoints WHERE run_id = ? ORDER BY step DESC LIMIT 1",
                               [R.run_id_for(job, 1)])[0]["checkpoint_key"]
    assert R.run(ledger, R.run_id_for(job, 2))["resume_from"] == last_durable


def _is_train_agent_under(proc, root: str) -> bool:
    try:
        cmd = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return b"orbit_dagster.runtime.agent" in cmd and b"--task\x00train" in cmd and root.encode() in cmd
