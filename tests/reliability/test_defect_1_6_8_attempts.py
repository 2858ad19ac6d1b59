"""Issue 8, defects 1, 6 and 8: what an attempt trains, where it can get stuck, how its end is
classified. Real sim hosts and workloads; the control plane driven without Dagster."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import pytest

from orbit_dagster.cli.commands import main
from orbit_dagster.control.attempt import outcome_of, run_attempt
from orbit_dagster.control.liveness import process_start
from orbit_dagster.control.providers import provider_for
from orbit_dagster.control.reconcile import reconcile
from orbit_dagster.control.submit import cancel, submit
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import InstanceHandle, RunHandle, RunStatus
from orbit_dagster.providers.ssh.provider import run_status as ssh_run_status
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest, StoreError
from tests.helpers import Background, wait_for
from tests.reliability import inject
from tests.reliability.conftest import fill, queue_unvalidated, train


def cli(*argv: str) -> int:
    """`orbit ARGV` in this process: its exit code (0 when main returns)."""
    try:
        main(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


@pytest.mark.fault("defect 1: `orbit retry --from-scratch --set config.lr=0.01` after a finished job",
                   expect="attempt 2 registers its own checkpoints; best ranks them")
def test_defect_1_retry_reports_the_old_model(settings, capsys):
    """Old code (49321ab): checkpoint keys were `<job>/<step>` and store names `step-N`, so the
    retry's checkpoints collided with the first attempt's: 0 registered, the ledger and the
    store kept the old weights, and the job said SUCCEEDED with the old model."""
    job = train(settings, experiment="lr")
    ledger = settings.ledger()
    old = {r["checkpoint_key"]: r for r in R.checkpoints(ledger, job)}
    assert sorted(old) == [f"{job}/a1/4", f"{job}/a1/8"]

    assert cli("retry", job, "--from-scratch", "--set", "config.lr=0.01") == 0, capsys.readouterr().err
    out = run_attempt(settings, job, poll_s=0.1)
    assert (out.state, out.attempt) == ("SUCCEEDED", 2)

    new = {r["checkpoint_key"]: r for r in R.checkpoints(ledger, job, lineage=R.require_job(ledger, job)["lineage"])}
    assert sorted(new) == [f"{job}/a2/4", f"{job}/a2/8"]
    reported = [e for e in inject.events_of(settings.artifacts_dir / job / "attempt-2" / "events.jsonl")
                if e["type"] == "checkpoint"]
    assert {e["sha256"] for e in reported} == {r["sha256"] for r in new.values()}  # what the host wrote
    assert not {r["sha256"] for r in new.values()} & {r["sha256"] for r in old.values()}
    assert new[f"{job}/a2/8"]["weights_sha256"] != old[f"{job}/a1/8"]["weights_sha256"]  # another lr: other weights
    # The store keeps both attempts, each with its own bytes, each matching the ledger.
    store = open_store(settings.store_uri)
    for row in [*old.values(), *new.values()]:
        assert store.verify(row["uri"]).digest == row["sha256"]
    # Different bytes under an existing name are refused, never silently kept or replaced.
    with pytest.raises(StoreError, match="already exists with other content"):
        store.put(job, "step-000000008-a1", {"state.pt": b"other"},
                  CheckpointManifest(job_id=job, step=8, tier="durable", attempt=1,
                                     files={"state.pt": {"sha256": hashlib.sha256(b"other").hexdigest(),
                                                         "bytes": 5}}))
    assert store.verify(old[f"{job}/a1/8"]["uri"]).digest == old[f"{job}/a1/8"]["sha256"]
    # `orbit best` ranks the retry's weights (the job's current lineage), not the old ones.
    capsys.readouterr()
    assert cli("best", "lr", "--json") == 0
    best = json.loads(capsys.readouterr().out)
    assert best["checkpoint_key"] in new and best["candidates"] == 2


# ---- defect 6: nothing stays DISPATCHING ------------------------------------------------------

UNSERVABLE = [  # (overrides a version without today's checks accepted, the field the reason names)
    ({"launch_mode": "docker_image"}, "sim_docker_image"),
    ({"placement": "ssh_rental"}, "ssh_hosts.yaml"),
]


@pytest.mark.fault("defect 6: a job no provider here can serve reaches dispatch (docker_image on sim, "
                   "ssh_rental without hosts, checkpoint.store=s3 without S3)",
                   expect="attempt ends FAILED with the reason; nothing rented; not DISPATCHING")
@pytest.mark.parametrize("overrides,words", UNSERVABLE + [({"checkpoint.store": "s3"}, "ORBIT_S3_CHECKPOINT_STORE")],
                         ids=["docker_image-on-sim", "ssh_rental-without-hosts", "s3-store-unset-at-dispatch"])
def test_defect_6_unservable_jobs_never_stay_dispatching(settings, monkeypatch, overrides, words):
    """Old code: the job moved to DISPATCHING, dispatch raised, and nothing ever moved it on:
    it stayed DISPATCHING forever (reconcile only looked at RUNNING jobs)."""
    monkeypatch.delenv("ORBIT_SSH_HOSTS", raising=False)  # no SSH inventory: $ORBIT_HOME has none
    if "checkpoint.store" in overrides:  # configured when submitted, gone when dispatched
        monkeypatch.setenv("ORBIT_S3_CHECKPOINT_STORE", "s3://orbit-test-bucket/ckpt")
        job = submit(Settings.from_env(settings.home), "charlm-finetune", overrides)  # the settings of then
        monkeypatch.delenv("ORBIT_S3_CHECKPOINT_STORE")
    else:
        job = queue_unvalidated(settings, overrides)
    with pytest.raises(OrbitError) as err:
        run_attempt(settings, job)
    assert words in str(err.value)
    ledger = settings.ledger()
    row = R.require_job(ledger, job)
    assert row["state"] == "FAILED" and row["failure_class"] == "user_error" and words in row["reason"], row
    assert ledger.scalar("SELECT count(*) FROM instances WHERE stopped_at IS NULL") == 0
    reconcile(settings, followed=lambda *_: False)
    assert ledger.scalar("SELECT count(*) FROM jobs WHERE state = 'DISPATCHING'") == 0


DISPATCHER = """
import sys, time
from orbit_dagster.control.billing import instance_row
from orbit_dagster.control.providers import provider_for
from orbit_dagster.settings import Settings
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.ledger import records as R

settings = Settings.from_env(sys.argv[1])
ledger, job = settings.ledger(), sys.argv[2]
# What dispatch() does up to the launch: win QUEUED -> DISPATCHING, rent, record the rental ...
assert R.transition(ledger, job, JobState.DISPATCHING, attempt=1, only_from={JobState.QUEUED},
                    deadline_at=time.time() + 1200, reason="dagster run (killed below)")
provider = provider_for(settings, "sim_host_process")
instance = provider.provision(provider.list_offers()[0], tags={"orbit/job": job})
ledger.commit({"instances": [instance_row(instance, "train", job, R.run_id_for(job, 1))]})
print("provisioned", instance.instance_id, flush=True)
time.sleep(600)  # ... and the run worker is SIGKILLed here, before it launches anything
"""


@pytest.mark.fault("defect 6: the run worker dispatching a job is SIGKILLed after renting, before launching; "
                   "another dispatch outlives its deadline",
                   expect="reconcile releases and bills the rental; attempt LOST, next one QUEUED")
def test_defect_6_a_dispatch_whose_run_died_or_overran_is_ended_and_retried(settings, orbit_home, tmp_path):
    """Old code: reconcile looked at RUNNING jobs only; a DISPATCHING job whose run died kept
    its instance metered and stayed DISPATCHING for good."""
    ledger = settings.ledger()
    killed = submit(settings, "charlm-finetune", {"config.steps": 8})
    late = submit(settings, "charlm-finetune", {"config.steps": 8})
    log = tmp_path / "dispatcher.log"
    proc = inject.spawn(DISPATCHER, str(orbit_home), killed, log=log)
    wait_for(lambda: "provisioned" in log.read_text() or proc.poll() is not None, 60, what="the rental")
    assert proc.poll() is None, log.read_text()
    inject.sigkill(proc)
    R.transition(ledger, late, JobState.DISPATCHING, attempt=1, only_from={JobState.QUEUED},
                 deadline_at=time.time() - 1)  # its run still claims to follow it, but too late

    report = reconcile(settings, followed=lambda job_id, attempt: job_id == late)
    assert sorted(d.job_id for d in report.decisions if d.action == "abandon_dispatch") == sorted([killed, late])
    rental = ledger.one("SELECT * FROM instances WHERE job_id = ?", [killed])
    assert rental["stopped_at"] is not None and rental["billed_usd"] > 0 and rental["stop_reason"]
    assert not provider_for(settings, "sim_host_process").instance_alive(InstanceHandle.model_validate_json(rental["handle"]))
    assert ledger.scalar("SELECT sum(usd) FROM costs WHERE instance_id = ?", [rental["instance_id"]]) == \
        pytest.approx(rental["billed_usd"], rel=1e-9)
    for job in (killed, late):
        row = R.require_job(ledger, job)
        assert (row["state"], row["attempt"]) == ("QUEUED", 2), row
        lost = ledger.one("SELECT * FROM job_states WHERE job_id = ? AND state = 'LOST'", [job])
        assert lost["failure_class"] == "infrastructure" and "dispatch abandoned" in lost["reason"]


# ---- defect 8: one failure taxonomy -------------------------------------------------------------

def _running(settings, job, attempt) -> dict:
    ledger = settings.ledger()
    wait_for(lambda: (R.run(ledger, R.run_id_for(job, attempt)) or {}).get("state") == "RUNNING", 120,
             what=f"attempt {attempt} running")
    wait_for(lambda: ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?",
                                   [R.run_id_for(job, attempt)]), 120, what=f"attempt {attempt} training")
    return R.run(ledger, R.run_id_for(job, attempt))


@pytest.mark.fault("defect 8: SIGKILL of the workload alone, then of the whole sim host, mid-training",
                   expect="both `reclaim` (retried), as SSH classifies the same facts")
def test_defect_8_a_sigkilled_sim_host_is_a_reclaim_as_on_ssh(settings):
    """Old code: a workload killed by a signal on sim was `crash` (never retried) while the
    SSH provider called the same event `reclaim`."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 400, "max_interruptions": 5})
    provider = provider_for(settings, "sim_host_process")

    bg = Background(lambda: run_attempt(settings, job, poll_s=0.1))
    run = _running(settings, job, 1)
    instance = RunHandle.model_validate_json(run["handle"]).instance
    child = json.loads((settings.sim_dir / "instances" / instance.instance_id / "child.json").read_text())
    os.kill(int(child["pid"]), signal.SIGKILL)  # the workload only; the host lives on
    first = bg.join()
    assert (first.state, first.failure_class) == ("LOST", "reclaim"), first

    bg = Background(lambda: run_attempt(settings, job, poll_s=0.1))
    run = _running(settings, job, 2)
    provider.kill(RunHandle.model_validate_json(run["handle"]).instance)  # the whole machine
    second = bg.join()
    assert (second.state, second.failure_class) == ("LOST", "reclaim"), second
    assert R.require_job(ledger, job)["attempt"] == 3  # both retried automatically
    cancel(settings, job)
    # The SSH provider reads the same facts the same way.
    assert ssh_run_status({"launched": True, "wrapper_exit": {"returncode": -9}}).failure_class == "reclaim"
    assert ssh_run_status({"launched": True}).failure_class == "reclaim"
    assert ledger.scalar("SELECT count(*) FROM instances WHERE job_id = ? AND stopped_at IS NULL", [job]) == 0


@pytest.mark.fault("SIGKILL of a sim host's process alone (not its process group) mid-training",
                   expect="a reclaim: the attempt ends LOST; the workload it left is ended with it, so nothing more "
                          "lands in the store for the ended attempt; every checkpoint in the store registered")
def test_a_host_killed_without_its_process_group_leaves_no_workload_training(settings):
    """Old code: the agent kept training after the attempt was closed, writing checkpoints of
    an ended attempt into the store that nothing registered."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 400, "checkpoint.every_steps": 8})
    bg = Background(lambda: run_attempt(settings, job, poll_s=0.1))
    run = _running(settings, job, 1)
    instance = RunHandle.model_validate_json(run["handle"]).instance
    d = settings.sim_dir / "instances" / instance.instance_id
    host_pid = json.loads((d / "state.json").read_text())["pid"]
    agent_pid = int(json.loads((d / "child.json").read_text())["pid"])
    os.kill(host_pid, signal.SIGKILL)  # the host process only: its workload would live on
    first = bg.join()
    assert (first.state, first.failure_class) == ("LOST", "reclaim"), first
    wait_for(lambda: process_start(agent_pid) is None, 30, what="the left-behind workload ended")
    stored = {uri.rstrip("/").rsplit("/", 1)[-1] for uri in open_store(settings.store_uri).list(job)}
    time.sleep(2.0)  # a live workload would write its next checkpoint (every 8 steps) meanwhile
    assert {uri.rstrip("/").rsplit("/", 1)[-1] for uri in open_store(settings.store_uri).list(job)} == stored
    registered = {r["uri"].rstrip("/").rsplit("/", 1)[-1] for r in R.checkpoints(ledger, job, live_only=False)}
    assert stored == registered
    cancel(settings, job)


@pytest.mark.fault("defect 8: the host's disk fills up under the checkpoint store (16 MiB tmpfs)",
                   expect="agent exits 74 `infrastructure`; the attempt is retried, not a user error")
def test_defect_8_a_full_disk_on_the_host_is_infrastructure(tmp_path, small_disk):
    """Old code: the agent reported ENOSPC as a failing workload: `user_error`, never retried."""
    from tests.unit.runtime.test_agent import agent, small_bundle

    b = small_bundle(tmp_path, **{"config.steps": 100000, "checkpoint.every_steps": 2})
    fill(small_disk)
    proc = agent(b.path, tmp_path / "w", small_disk / "store")
    info = json.loads((tmp_path / "w" / "artifacts" / "exit.json").read_text())
    assert (proc.returncode, info["failure_class"]) == (74, "infrastructure"), info
    assert "No space left on device" in info["reason"]
    status = RunStatus(state="exited", exit_code=74, failure_class=info["failure_class"], reason=info["reason"])
    assert outcome_of(status, migrated=False) == (JobState.LOST, "infrastructure")  # a new attempt, not FAILED
