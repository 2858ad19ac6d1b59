"""The code server: orbit's code location served by a process of its own.

Loaded from a `python_module` workspace, `dagster-daemon` starts and manages its own code
server and that server shuts itself down when the daemon's heartbeat is 20 s late (a value
Dagster fixes). On a machine whose CPUs are saturated the heartbeat is late, the server
stops, sensors stop ticking and launches fail with DEADLINE_EXCEEDED. So the supervisor
of `orbit daemon` / `orbit ui` starts the code server itself, as `dagster api grpc`
without `--heartbeat` (nothing can stop it but a signal), on a unix socket in a private
directory (0700: no other local user can ask it to launch a run, which anyone could on a
TCP port; and no fixed port, so many instances run side by side), waits until it answers,
and hands the daemon and the webserver a workspace naming it as a `grpc_server` with the
same location name `orbit_dagster.definitions`, so sensor state and run history carry over.

An operator may run it as a service of its own (`orbit code-server`, docs/deploy.md) and
point daemon and UI at it with `ORBIT_CODE_SERVER` (`unix:/path` or `HOST:PORT`; parsed by the
settings into `settings.code_server`, a CodeServerAddress).
`dagster api grpc` rather than `dagster code-server start`: the latter is a proxy that
starts the real server as a child kept alive by heartbeats again; the cost is that the UI's
"Reload definitions" does not reload code (restart the code server instead).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..settings.deployment import SOCKET_NAME, UNIX_PATH_MAX, CodeServerAddress, socket_path_ok

__all__ = ["LOCATION", "SOCKET_NAME", "UNIX_PATH_MAX", "CodeServerAddress", "socket_path_ok", "server_argv", "answers",
           "PrivateDir", "default_socket"]

LOCATION = "orbit_dagster.definitions"  # the same name CodeServerAddress.workspace_yaml writes


def server_argv(address: CodeServerAddress) -> list[str]:
    """`dagster api grpc` serving orbit's definitions at `address`, without a heartbeat."""
    dagster = str(Path(sys.executable).with_name("dagster"))
    # --use-python-environment-entry-point: whatever launches a run from this server runs
    # `<this python> -m dagster ...`, not whichever `dagster` is first on PATH.
    return [dagster, "api", "grpc", *address.server_options(), "-m", LOCATION, "--location-name", LOCATION,
            "--use-python-environment-entry-point", "--log-level", "info"]


def answers(address: CodeServerAddress, timeout_s: float = 5.0) -> bool:
    """True if the server at `address` answers a gRPC health check (it serves once its code is loaded)."""
    try:
        with grpc.insecure_channel(address.grpc_target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="DagsterApi"),
                                                             timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


PRIVATE_PREFIX = "orbit-code-"


class PrivateDir:
    """A 0700 directory for one supervisor's code-server socket and workspace, removed at the end
    (and, if the supervisor was killed, by the next one: its name carries the owner's pid)."""

    def __init__(self) -> None:
        base = tempfile.gettempdir()  # TMPDIR's, as Python resolves it
        if len(base) > 60 or not os.path.isdir(base):  # keep the socket's path well under 108 bytes
            base = "/tmp"
        sweep_stale(Path(base))
        self.path = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=base))

    @property
    def address(self) -> CodeServerAddress:
        return CodeServerAddress(socket=str(self.path / SOCKET_NAME))

    def workspace(self, address: CodeServerAddress) -> Path:
        path = self.path / "workspace.yaml"
        path.write_text(address.workspace_yaml())
        return path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def sweep_stale(base: Path) -> None:
    """Remove the private directories of supervisors (of this user) that are gone."""
    for path in base.glob(f"{PRIVATE_PREFIX}*-*"):
        pid = path.name[len(PRIVATE_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def default_socket(dagster_home: Path) -> str:
    """`orbit code-server`'s socket when none is given: in the Dagster home, if the path is short enough."""
    return socket_path_ok(str(Path(dagster_home) / SOCKET_NAME), "--socket")
