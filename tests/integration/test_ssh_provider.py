"""The ssh provider against a real sshd on 127.0.0.1, running the real runtime agent.

The "remote" host is this machine over loopback: its files are on this disk, so a test may
look at (or damage) them directly, and count the agent's processes with pgrep.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orbit_dagster.core.errors import (
    AuthError,
    HostKeyMismatch,
    NetworkError,
    NoCapacity,
    ResourceNotFound,
    Throttled,
)
from orbit_dagster.core.execution import Resources
from orbit_dagster.core.host_contract import Checkpoint, Exit, Metrics, Notice, Rejected, Resumed, Started
from orbit_dagster.providers.base import InstanceHandle, LaunchSpec, RunHandle
from orbit_dagster.providers.ssh.provider import SshProvider
from orbit_dagster.storage.fs import FsStore
from tests.helpers import wait_for
from tests.unit.runtime.test_agent import small_bundle

from .sshd import free_port, keygen

pytestmark = pytest.mark.integration
LONG = {"config.steps": 100000, "checkpoint.every_steps": 1000}
SECRET = "tok-6f1d2a-not-for-logs"


def provider(inventory: Path, tmp_path: Path, **kw) -> SshProvider:
    return SshProvider(inventory, state_dir=tmp_path / f"state-{len(list(tmp_path.glob('state-*')))}", **kw)


def wait_ended(p: SshProvider, run: RunHandle, timeout=90.0):
    return wait_for(lambda: (st := p.status(run)).state in ("exited", "lost") and st, timeout, what="the run to end")


def agent_pids(bundle_dir: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"orbit_dagster.runtime.agent {bundle_dir}"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def one_gpu(p: SshProvider):
    return p.list_offers(Resources(gpu="any", gpu_count=1))[0]


# ---- host keys ------------------------------------------------------------------------
def test_a_changed_host_key_is_refused(ssh_inventory, sshd, tmp_path):
    p = provider(ssh_inventory(), tmp_path)
    other = keygen(tmp_path / "impostor", "impostor").split()
    ssh_inventory.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    with pytest.raises(HostKeyMismatch) as err:
        p.provision(one_gpu(p), tags={})
    assert err.value.retryable is False and "known_hosts" in str(err.value)
    assert "(a changed key can mean a man in the middle)" in str(err.value)


def test_an_unknown_host_key_is_refused_unless_trust_on_first_use_is_enabled(ssh_inventory, sshd, tmp_path):
    inv = ssh_inventory()
    ssh_inventory.known_hosts.write_text("")
    with pytest.raises(HostKeyMismatch, match="unknown host key"):
        provider(inv, tmp_path).provision(one_gpu(provider(inv, tmp_path)), tags={})
    ssh_inventory.known_hosts.unlink()
    with pytest.raises(HostKeyMismatch, match="does not exist"):
        provider(inv, tmp_path).provision(one_gpu(provider(inv, tmp_path)), tags={})
    assert not ssh_inventory.known_hosts.exists()

    p = provider(ssh_inventory(trust_on_first_use=True), tmp_path)
    inst = p.provision(one_gpu(p), tags={})
    assert ssh_inventory.known_hosts.read_text() == sshd.known_hosts_line()  # the key was written
    p.terminate(inst, "done")
    # Trusted once: a different key is now refused even with TOFU on.
    other = keygen(tmp_path / "impostor", "impostor").split()
    ssh_inventory.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    with pytest.raises(HostKeyMismatch):
        provider(ssh_inventory(trust_on_first_use=True), tmp_path).provision(one_gpu(p), tags={})


# ---- the whole life cycle --------------------------------------------------------------
def test_life_cycle_stage_resumably_run_localize_resume_collect_terminate(ssh_inventory, tmp_path):
    p = provider(ssh_inventory(), tmp_path)
    bundle = small_bundle(tmp_path)
    store = FsStore((tmp_path / "store").as_uri())
    inst = p.provision(one_gpu(p), tags={"orbit/job": "job-agent"})
    assert inst.gpu_slots == (0,) and inst.offer.usd_per_second == pytest.approx(1.8 / 2 / 3600)

    first = p.stage_bundle(inst, bundle.path)
    assert first.skipped == [] and "manifest.json" in first.sent and first.bytes_sent > 0
    remote_bundle = Path(inst.address["run_root"]) / "bundle"
    victim = "scripts/train.py"
    size = (remote_bundle / victim).stat().st_size
    with open(remote_bundle / victim, "r+b") as fh:  # an upload cut short
        fh.truncate(size // 2)
    again = p.stage_bundle(inst, bundle.path)
    assert again.sent == [victim] and again.bytes_sent == size and len(again.skipped) == len(first.sent) - 1

    spec = LaunchSpec(store_uri=p.host_store_uri(inst, store.root_uri), extra_args=("--stop-after-step", "6"))
    assert spec.store_uri == (Path(inst.address["run_root"]) / "checkpoints").as_uri()
    run = p.launch(inst, bundle.path, spec)
    status = wait_ended(p, run)
    assert (status.state, status.exit_code, status.failure_class) == ("exited", 99, "user_error")
    events, offset = p.read_events(run, 0)
    assert isinstance(events[0], Started) and any(isinstance(e, Exit) for e in events)
    assert not [e for e in events if isinstance(e, Rejected)]  # every line the agent wrote is of the contract
    assert events[0].precheck["cuda_visible_devices"] == "0"
    ckpt = [e for e in events if isinstance(e, Checkpoint)]
    assert [e.step for e in ckpt] == [4] and ckpt[0].uri.startswith(spec.store_uri)

    local = p.localize_checkpoint(run, ckpt[0], store.root_uri)
    assert local.uri == store.uri_for("job-agent", "step-000000004-a1")
    assert store.verify(local.uri).digest == ckpt[0].sha256

    # read_events returns whole lines only: a partial line waits for its newline.
    events_file = Path(run.run_ref) / "artifacts" / "events.jsonl"
    with open(events_file, "ab") as fh:
        fh.write(b'{"seq": 999, "type": "notice", "source": "sigterm", "deadline": null, "received_at": 1.0')
    assert p.read_events(run, offset) == ([], offset)
    with open(events_file, "ab") as fh:
        fh.write(b"}\n")
    tail, end = p.read_events(run, offset)
    assert [(type(e), e.seq) for e in tail] == [(Notice, 999)] and end == events_file.stat().st_size

    got = {f.name for f in p.collect(run, tmp_path / "collected")}
    assert {"events.jsonl", "exit.json", "exit_code", "agent.log"} <= got
    times = p.terminate(inst, "attempt ended")
    assert times.stopped_at > times.started_at == inst.started_at and times.reason == "attempt ended"
    assert p.instance_times(inst) == times and not p.instance_alive(inst)

    # Attempt 2 on a new lease resumes from the localized checkpoint, staged back to the host.
    inst2 = p.provision(one_gpu(p), tags={})
    assert inst2.gpu_slots == (0,)  # the first lease's slot was freed
    staged = p.stage_checkpoint(inst2, local.uri)
    assert staged == (Path(inst2.address["run_root"]) / "checkpoints/job-agent/step-000000004-a1").as_uri()
    assert FsStore(p.host_store_uri(inst2, store.root_uri)).verify(staged).digest == ckpt[0].sha256
    spec2 = LaunchSpec(attempt=2, store_uri=p.host_store_uri(inst2, store.root_uri), resume_from=staged)
    run2 = p.launch(inst2, bundle.path, spec2)
    assert wait_ended(p, run2).exit_code == 0
    events2, _ = p.read_events(run2, 0)
    assert [e.step for e in events2 if isinstance(e, Resumed)] == [4]
    final = [e for e in events2 if isinstance(e, Checkpoint)][-1]
    assert final.step == 12
    assert store.verify(p.localize_checkpoint(run2, final, store.root_uri).uri).step == 12
    p.terminate(inst2, "done")


# ---- a dropped connection, then a workload killed from outside ---------------------------
def test_dropped_connection_reattaches_without_a_second_launch_and_a_killed_workload_is_lost(
        ssh_inventory, tmp_path, monkeypatch):
    inv = ssh_inventory()
    p = provider(inv, tmp_path)
    bundle = small_bundle(tmp_path, **LONG)
    inst = p.provision(one_gpu(p), tags={})
    monkeypatch.setenv("ORBIT_TEST_TOKEN", SECRET)
    spec = LaunchSpec(store_uri=p.host_store_uri(inst, (tmp_path / "store").as_uri()),
                      secret_env=("ORBIT_TEST_TOKEN",))
    run = p.launch(inst, bundle.path, spec)
    wait_for(lambda: any(isinstance(e, Metrics) for e in p.read_events(run, 0)[0]), 90, what="first metrics")
    remote_bundle = str(Path(inst.address["run_root"]) / "bundle")
    [agent] = agent_pids(remote_bundle)
    # The secret reached the workload's environment, and nothing else: not argv, not a file, not the handle.
    assert f"ORBIT_TEST_TOKEN={SECRET}".encode() in Path(f"/proc/{agent}/environ").read_bytes().split(b"\0")
    assert SECRET.encode() not in Path(f"/proc/{agent}/cmdline").read_bytes()
    leaked = [f for f in Path(inst.address["root"]).rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert leaked == [] and SECRET not in run.model_dump_json()

    p.hosts._clients["box"].get_transport().sock.shutdown(socket.SHUT_RDWR)  # the network drops under us
    assert p.status(run).state == "running"  # one reconnect, transparently
    # Another control-plane process, knowing only the handle from the ledger:
    other = provider(inv, tmp_path)
    handle = RunHandle.model_validate_json(run.model_dump_json())
    assert other.reattach(handle) == handle
    assert other.launch(InstanceHandle.model_validate_json(inst.model_dump_json()), bundle.path, spec) == handle
    time.sleep(0.5)
    pids = agent_pids(remote_bundle)
    assert len(pids) == 1, f"a second agent was launched: {pids}"

    os.kill(pids[0], signal.SIGKILL)  # killed from outside: no exit file
    status = wait_for(lambda: (st := other.status(handle)).state != "running" and st, 20, what="the run to stop")
    assert (status.state, status.failure_class) == ("lost", "reclaim") and "signal 9" in status.reason
    assert other.reattach(handle) is None
    times = other.terminate(inst, "lost")
    assert times.stopped_at is not None and not agent_pids(remote_bundle)


# ---- GPU slots -----------------------------------------------------------------------
def test_gpu_slots_are_exclusive_across_control_plane_processes(ssh_inventory, tmp_path):
    inv = ssh_inventory()
    providers = [provider(inv, tmp_path) for _ in range(3)]
    results: list = [None] * 3

    def grab(i: int) -> None:
        try:
            results[i] = providers[i].provision(one_gpu(providers[i]), tags={"i": str(i)})
        except Exception as exc:  # noqa: BLE001 - kept for the assertion below to show
            results[i] = exc

    threads = [threading.Thread(target=grab, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    leases = [r for r in results if isinstance(r, InstanceHandle)]
    refused = [r for r in results if isinstance(r, NoCapacity)]
    assert len(leases) == 2 and len(refused) == 1 and refused[0].retryable is True, results
    assert sorted(s for lease in leases for s in lease.gpu_slots) == [0, 1]

    bundle = small_bundle(tmp_path, **LONG)
    p = providers[0]
    runs = [p.launch(lease, bundle.path, LaunchSpec(store_uri=p.host_store_uri(lease, "file:///unused")))
            for lease in leases]
    for r in runs:  # training: the agent handles SIGTERM from here on
        wait_for(lambda r=r: any(isinstance(e, Metrics) for e in p.read_events(r, 0)[0]), 90, what="first metrics")
    started = [[e for e in p.read_events(r, 0)[0] if isinstance(e, Started)][0] for r in runs]
    assert sorted(e.precheck["cuda_visible_devices"] for e in started) == ["0", "1"]
    p.terminate(leases[0], "done")  # SIGTERM: the agent checkpoints and exits as preempted
    status = p.status(runs[0])
    assert (status.state, status.exit_code) == ("exited", 75), status
    again = providers[2].provision(one_gpu(providers[2]), tags={})
    assert again.gpu_slots == leases[0].gpu_slots
    with pytest.raises(NoCapacity):
        providers[2].provision(p.list_offers()[0], tags={})  # both slots: one is still held
    for lease in (leases[1], again):
        p.terminate(lease, "done")


# ---- vendor errors from the real host ---------------------------------------------------
def test_auth_failure_is_an_auth_error(ssh_inventory, tmp_path):
    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")
    p = provider(ssh_inventory(key_file=str(stranger)), tmp_path)
    with pytest.raises(AuthError) as err:
        p.provision(one_gpu(p), tags={})
    assert err.value.retryable is False and "authorized_keys" in str(err.value)


def test_refused_and_silent_hosts_are_retryable_network_errors(ssh_inventory, tmp_path):
    p = provider(ssh_inventory(port=free_port()), tmp_path)
    with pytest.raises(NetworkError) as err:
        p.provision(one_gpu(p), tags={})
    assert err.value.retryable is True and "'box'" in str(err.value)

    with socket.socket() as silent:  # accepts, never speaks SSH
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        p = provider(ssh_inventory(port=silent.getsockname()[1], connect_timeout_s=0.5), tmp_path)
        with pytest.raises(NetworkError, match="banner") as err:
            p.provision(one_gpu(p), tags={})
        assert err.value.retryable is True


def test_session_limit_is_throttled(ssh_inventory, sshd, tmp_path):
    # The second port allows one session per connection: SFTP holds it, the helper's exec is refused.
    p = provider(ssh_inventory(port=sshd.throttled_port), tmp_path)
    with pytest.raises(Throttled) as err:
        p.provision(one_gpu(p), tags={})
    assert err.value.retryable is True


def test_missing_lease_and_missing_python_are_not_found(ssh_inventory, tmp_path):
    p = provider(ssh_inventory(), tmp_path)
    inst = p.provision(one_gpu(p), tags={})
    ghost = inst.model_copy(update={"instance_id": "ssh-box-ghost"})
    with pytest.raises(ResourceNotFound) as err:
        p.instance_times(ghost)
    assert err.value.retryable is False
    assert p.instance_alive(ghost) is False
    p.terminate(inst, "done")
    broken = provider(ssh_inventory(python="/nonexistent/python3"), tmp_path)
    with pytest.raises(ResourceNotFound, match="python"):
        broken.provision(one_gpu(broken), tags={})


def test_an_unreachable_host_is_a_network_error_then_not_alive_after_the_grace(ssh_inventory, tmp_path):
    inv = ssh_inventory()
    p = provider(inv, tmp_path, unreachable_grace_s=0.5)
    inst = p.provision(one_gpu(p), tags={})
    run = RunHandle(provider="ssh", instance=inst, run_ref=inst.address["run_root"] + "/run",
                    launched_at=inst.started_at)
    p.hosts.disconnect("box")
    ssh_inventory(port=free_port())  # the host stops answering
    with pytest.raises(NetworkError):
        p.instance_times(inst)
    with pytest.raises(NetworkError) as err:
        p.status(run)
    assert err.value.retryable is True
    assert p.instance_alive(inst) is True  # within the grace
    time.sleep(0.6)
    assert p.instance_alive(inst) is False
    status = p.status(run)
    assert (status.state, status.failure_class) == ("lost", "reclaim") and "unreachable" in status.reason
    times = p.instance_times(inst)  # billed up to the last contact
    assert times.reason == "host unreachable" and inst.started_at <= times.stopped_at
    ssh_inventory()  # back again: free the slot for good measure
    p.terminate(inst, "done")


# ---- the control plane through this provider ----------------------------------------------
def test_the_control_plane_runs_an_attempt_on_the_ssh_host(ssh_inventory, tmp_path, orbit_home, monkeypatch):
    from orbit_dagster.control.attempt import run_attempt
    from orbit_dagster.control.submit import submit
    from orbit_dagster.settings import Settings

    monkeypatch.setenv("ORBIT_SSH_HOSTS", str(ssh_inventory()))  # what a user sets; submit checks it fits
    settings = Settings.from_env(orbit_home)
    job = submit(settings, "charlm-finetune", {"config.steps": 16, "checkpoint.every_steps": 8,
                                               "placement": "ssh_rental"}, experiment="ssh")
    out = run_attempt(settings, job)
    assert (out.state, out.last_step, out.usd > 0) == ("SUCCEEDED", 16, True)
    ledger = settings.ledger()
    ckpts = ledger.rows("SELECT step, uri FROM checkpoints WHERE job_id = ? ORDER BY step", [job])
    store = FsStore(settings.store_uri)
    assert [c["step"] for c in ckpts] == [8, 16]
    assert all(c["uri"].startswith(store.root_uri) and store.verify(c["uri"]) for c in ckpts)  # localized
    [inst] = ledger.rows("SELECT gpu_slots FROM instances WHERE job_id = ?", [job])
    assert inst["gpu_slots"] == "0"
