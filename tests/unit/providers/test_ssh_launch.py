"""Pure pieces of the ssh provider: the docker argv, the run-status decision, checkpoint paths."""
from __future__ import annotations

import shlex

import pytest

from orbit_dagster.core.errors import ProviderError
from orbit_dagster.core.host_contract import Checkpoint
from orbit_dagster.providers.base import LaunchSpec
from orbit_dagster.providers.common import agent_argv
from orbit_dagster.providers.ssh.checkpoints import _safe_rel, remote_dir_of, rewrite_uri
from orbit_dagster.providers.ssh.provider import docker_argv, run_status


def test_docker_argv_pins_the_lease_gpus_mounts_the_lease_and_passes_secrets_by_name_only():
    agent = agent_argv("python", "/w/l1/bundle", "/w/l1/run", LaunchSpec(store_uri="file:///w/l1/checkpoints"), None)
    argv = docker_argv("ghcr.io/acme/train:1", agent, gpu_slots=(0, 1), mount="/w/l1", workdir="/w/l1/run",
                       env={"PYTHONPATH": "/w/l1/bundle/runtime", "OMP_NUM_THREADS": "2"},
                       secret_names=["HF_TOKEN"], name="orbit-l1")
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[argv.index("--gpus") + 1] == '"device=0,1"'
    assert argv[argv.index("-v") + 1] == "/w/l1:/w/l1" and argv[argv.index("-w") + 1] == "/w/l1/run"
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert envs == ["OMP_NUM_THREADS=2", "PYTHONPATH=/w/l1/bundle/runtime", "HF_TOKEN"]  # no secret value
    image_at = argv.index("ghcr.io/acme/train:1")
    assert argv[image_at + 1:] == agent and agent[:3] == ["python", "-m", "orbit_dagster.runtime.agent"]
    # What the host's shell sees splits back into exactly this argv.
    assert shlex.split(shlex.join(argv)) == argv
    cpu = docker_argv("img", ["python"], gpu_slots=(), mount="/m", workdir="/m", env={}, secret_names=[], name="n")
    assert "--gpus" not in cpu


@pytest.mark.parametrize("snap,state,cls,code", [
    ({"launched": False}, "lost", "reclaim", None),
    ({"launched": True, "exit": {"code": 0, "reason": "completed", "last_step": 12}}, "exited", None, 0),
    ({"launched": True, "exit": {"code": 75, "failure_class": "reclaim"}}, "exited", "reclaim", 75),
    ({"launched": True, "wrapper_exit": {"returncode": -9}}, "lost", "reclaim", None),
    ({"launched": True, "wrapper_exit": {"returncode": 137}}, "lost", "reclaim", None),
    ({"launched": True, "wrapper_exit": {"returncode": 1}}, "exited", "infrastructure", 1),
    ({"launched": True, "wrapper_alive": True, "agent_pid": None}, "starting", None, None),
    ({"launched": True, "wrapper_alive": True, "agent_pid": 42, "agent_alive": True}, "running", None, None),
    ({"launched": True, "wrapper_alive": False, "agent_pid": 42, "agent_alive": True}, "running", None, None),
    ({"launched": True, "wrapper_alive": False, "agent_alive": False, "agent_pid": 42}, "lost", "reclaim", None),
    ({"launched": True, "lease_stopped": True}, "lost", "reclaim", None),
    ({"launched": True, "wrapper_pid": None, "launch_age_s": 0.01}, "starting", None, None),
    ({"launched": True, "wrapper_pid": None, "launch_age_s": 600}, "lost", "reclaim", None),
])
def test_run_status_follows_sims_semantics(snap, state, cls, code):
    st = run_status(snap)
    assert (st.state, st.failure_class, st.exit_code) == (state, cls, code)


def test_an_exit_file_wins_over_a_dead_process():
    st = run_status({"launched": True, "wrapper_alive": False, "exit": {"code": 0, "last_step": 3},
                     "wrapper_exit": {"returncode": -9}})
    assert (st.state, st.exit_code, st.last_step) == ("exited", 0, 3)


def test_checkpoint_paths_from_a_host_are_checked_before_use(tmp_path):
    store = "file:///w/l1/checkpoints"

    def event(uri: str) -> Checkpoint:
        return Checkpoint(uri=uri, step=4, attempt=1, tier="durable", sha256="0" * 64, bytes=1)

    ok = event("file:///w/l1/checkpoints/job-a/step-000000004-a1")
    assert remote_dir_of(ok, store) == "/w/l1/checkpoints/job-a/step-000000004-a1"
    for bad in ("file:///etc/step-000000004-a1", "file:///w/l1/checkpoints/../../etc/step-000000004-a1",
                "file:///w/l1/checkpoints/job-a/step-000000005-a1", "file:///w/l1/checkpoints/job-a/x/step-000000004-a1"):
        with pytest.raises(ProviderError):
            remote_dir_of(event(bad), store)
    for rel in ("../state.pt", "/etc/passwd", "manifest.json"):
        with pytest.raises(ProviderError):
            _safe_rel(rel)
    local = (tmp_path / "store").as_uri()
    assert rewrite_uri(ok.uri, store, local) == (tmp_path / "store/job-a/step-000000004-a1").as_uri()
    assert rewrite_uri("s3://b/job-a/step-000000004", store, local) == "s3://b/job-a/step-000000004"
