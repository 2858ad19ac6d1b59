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
point daemon and UI at it with `ORBIT_CODE_SERVER` (`unix:/path` or `HOST:PORT`).
`dagster api grpc` rather than `dagster code-server start`: the latter is a proxy that
starts the real server as a child kept alive by heartbeats again; the cost is that the UI's
"Reload definitions" does not reload code (restart the code server instead).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import OrbitError

LOCATION = "orbit_dagster.definitions"
ENV = "ORBIT_CODE_SERVER"
SOCKET_NAME = "code-server.sock"
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


@dataclass(frozen=True)
class CodeServerAddress:
    """Where a code server listens: a unix socket, or a host and port."""

    socket: str | None = None
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str, field: str = ENV) -> "CodeServerAddress":
        fix = f"{field}=unix:/path/to/{SOCKET_NAME} or {field}=127.0.0.1:4000"
        text = (text or "").strip()
        if text.startswith("unix:") or text.startswith("/"):
            path = text[5:] if text.startswith("unix:") else text
            if not path.startswith("/"):
                raise OrbitError(f"{field} names a socket by a relative path", field=field, value=text, fix=fix)
            return cls(socket=socket_path_ok(path, field))
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OrbitError(f"{field} is neither a unix socket nor HOST:PORT", field=field, value=text, fix=fix)
        return cls(host=host.strip("[]"), port=int(port))

    def __str__(self) -> str:
        return f"unix:{self.socket}" if self.socket else f"{self.host}:{self.port}"

    @property
    def grpc_target(self) -> str:
        return str(self)

    def server_options(self) -> list[str]:
        return ["--socket", self.socket] if self.socket else ["--host", str(self.host), "--port", str(self.port)]

    def workspace_yaml(self) -> str:
        where = [f"      socket: {self.socket}"] if self.socket else [f"      host: {self.host}",
                                                                     f"      port: {self.port}"]
        return "\n".join([
            "# Written by orbit: the code server this webserver or daemon uses (see docs/deploy.md).",
            "# The location keeps the name `-m orbit_dagster.definitions` gave it, so sensor state and",
            "# run history carry over.",
            "load_from:",
            "  - grpc_server:",
            *where,
            f"      location_name: {LOCATION}",
        ]) + "\n"


def socket_path_ok(path: str, field: str) -> str:
    if len(path.encode()) > UNIX_PATH_MAX:
        raise OrbitError(f"the socket path is {len(path.encode())} bytes, more than a unix socket's "
                         f"{UNIX_PATH_MAX}", field=field, value=path,
                         fix="choose a shorter path (e.g. under /run or /tmp), or HOST:PORT")
    return path


def configured() -> CodeServerAddress | None:
    """The code server the operator runs (`ORBIT_CODE_SERVER`), or None: orbit starts its own."""
    text = os.environ.get(ENV)
    return CodeServerAddress.parse(text) if text else None


def server_argv(address: CodeServerAddress) -> list[str]:
    """`dagster api grpc` serving orbit's definitions at `address`, without a heartbeat."""
    dagster = str(Path(sys.executable).with_name("dagster"))
    # --use-python-environment-entry-point: whatever launches a run from this server runs
    # `<this python> -m dagster ...`, not whichever `dagster` is first on PATH.
    return [dagster, "api", "grpc", *address.server_options(), "-m", LOCATION, "--location-name", LOCATION,
            "--use-python-environment-entry-point", "--log-level", "info"]


def answers(address: CodeServerAddress, timeout_s: float = 5.0) -> bool:
    """True if the server at `address` answers a gRPC health check (it serves once its code is loaded)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

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
        base = os.environ.get("TMPDIR") or "/tmp"
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
