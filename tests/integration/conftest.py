"""Fixtures for the SSH provider's integration tests: a real sshd on loopback, and hosts on it."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from .sshd import Sshd, sshd_missing_reason, start_sshd


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Sshd:
    """One real OpenSSH server for the session, killed at teardown (its own session/group)."""
    reason = sshd_missing_reason()
    if reason:
        pytest.skip(reason)
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def ssh_inventory(sshd, tmp_path):
    """write(**overrides) -> inventory path for one host `box` on the loopback sshd.

    The host's workdir is a temp dir, its python is this interpreter (it has torch), and its
    known_hosts holds the server's real key (both ports) unless a test writes another one.
    """
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts_line() + sshd.known_hosts_line(sshd.throttled_port))

    def write(**overrides) -> Path:
        host = {"name": "box", "host": "127.0.0.1", "port": sshd.port, "user": sshd.user,
                "key_file": str(sshd.user_key), "known_hosts": str(known),
                "gpus": {"model": "L4", "count": 2, "memory_gb": 24}, "usd_per_hour": 1.8,
                "workdir": str(tmp_path / "remote"), "python": sys.executable, "connect_timeout_s": 5}
        host.update(overrides)
        path = tmp_path / "ssh_hosts.yaml"
        path.write_text(yaml.safe_dump({"hosts": [host]}))
        return path

    write.known_hosts = known
    yield write
    kill_workloads_under(tmp_path / "remote")


def kill_workloads_under(remote: Path) -> None:
    """A failed test may leave its (long) workload running: end those processes, by pid."""
    token = str(remote).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if token in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue
