"""What `orbit daemon`, `orbit ui` and `orbit code-server` do (the CLI only parses their options).

- `orbit daemon`: takes this Dagster home's daemon lock before anything touches Dagster's
  storage (a second daemon refuses in one line naming the first), creates the storage if
  new (under the storage lock), refuses if a daemon elsewhere heartbeats to the same
  storage, starts the code server and, once it answers, `dagster-daemon` on a workspace
  naming it.
- `orbit ui`: the same code server shared by `dagster-webserver` and, unless a daemon
  already runs for the instance (then it says so and uses it), a daemon.
- `orbit code-server`: the code server alone, for an operator who runs each process as a
  service (docs/deploy.md); `ORBIT_CODE_SERVER` points daemon and UI at it.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import IO, Callable

from ..core.errors import OrbitError
from ..settings import Settings
from .code_server import CodeServerAddress, PrivateDir, answers, default_socket, server_argv
from .instance import dagster_home, environment, foreign_daemon, prepare_instance, profile, running_daemon, wait_for_daemon
from .locks import DaemonLock, foreign_daemon_refusal
from .report import headline
from .services import Child, ServiceFailed, Supervisor, daemon_argv, say, wait_for_http, webserver_argv

# Loading orbit's definitions takes ~5 s on an idle 2-core machine, minutes on a saturated one.
CODE_SERVER_TIMEOUT_S = 600.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _storage(settings: Settings) -> str:
    prof = profile(settings)
    return (f"PostgreSQL {prof.postgres.host}:{prof.postgres.port}/{prof.postgres.dagster_database}"
            if prof.postgres else f"SQLite in {dagster_home(settings)}")


def take_daemon_lock(settings: Settings, what: str) -> DaemonLock:
    """This home's daemon lock, or the one-line refusal naming who holds it (before any storage is opened)."""
    lock = DaemonLock(dagster_home(settings))
    lock.acquire(what, say=say)
    return lock


def refuse_foreign(settings: Settings, lock: DaemonLock) -> None:
    foreign = foreign_daemon(settings, lock)
    if foreign:
        lock.release()
        raise foreign_daemon_refusal(foreign, _storage(settings))


def _unlink_socket(address: CodeServerAddress) -> Callable[[], None]:
    def prepare() -> None:
        if address.socket and os.path.exists(address.socket):
            os.unlink(address.socket)  # a dead server's: grpc would refuse to bind over it
    return prepare


def code_server_child(address: CodeServerAddress, out: IO[str]) -> Child:
    return Child("code server", server_argv(address), out, restart=True, prepare=_unlink_socket(address))


def serve_code(settings: Settings, sup: Supervisor, out: IO[str]) -> Path | None:
    """The workspace the webserver and daemon load: the operator's, or one naming a code server
    that answers (ours, started here, or `ORBIT_CODE_SERVER`'s). None if stopped meanwhile."""
    explicit = settings.workspace
    if explicit is not None:
        say(f"workspace {explicit} (ORBIT_WORKSPACE): the code location as it says")
        return explicit
    private = PrivateDir()
    sup.on_exit.append(private.remove)
    address, child = settings.code_server, None
    if address is None:
        address = private.address
        child = sup.start(code_server_child(address, out))
        say(f"waiting for the code server to load orbit_dagster.definitions and answer on {address}")
    else:
        say(f"using the code server at {address} (ORBIT_CODE_SERVER); waiting until it answers")
    waited = sup.wait_until(lambda: answers(address), "the code server answered", CODE_SERVER_TIMEOUT_S, child)
    if waited is None:
        return None
    say(f"code server answers after {waited:.0f} s")
    return private.workspace(address)


def _report(fn, *args, **kw) -> None:
    """A readiness wait in a status thread: its failure is a line, not a traceback."""
    try:
        fn(*args, **kw)
    except OrbitError as exc:
        say(f"error: {exc}")
    except Exception as exc:  # noqa: BLE001 - a status thread: the services keep running
        say(f"error while waiting ({type(exc).__name__}): {' '.join(str(exc).split())[:300]}")


def _daemon_up(settings: Settings, lock: DaemonLock) -> None:
    """Wait for the first heartbeats, remembering our daemon's id in the lock file as soon as one
    shows (a heartbeat written since we took the lock is our daemon's: any other was refused)."""
    since = lock.record.get("since_ts", 0)

    def seen(beats: dict) -> None:
        now = time.time()
        lock.remember({did for age, did in beats.values() if did and now - age >= since - 1})

    wait_for_daemon(settings, say=say, seen=seen)


def _with_daemon_lock(settings: Settings, what: str, body: Callable[[DaemonLock], int]) -> int:
    lock = take_daemon_lock(settings, what)
    try:
        prepare_instance(settings)
        refuse_foreign(settings, lock)
        return body(lock)
    finally:
        lock.release()


def run_daemon(settings: Settings) -> int:
    """`orbit daemon`, in the foreground."""
    def body(lock: DaemonLock) -> int:
        say(headline(settings))
        with Supervisor(environment(settings), say, where=str(settings.home)) as sup:
            try:
                workspace = serve_code(settings, sup, sys.stdout)
            except ServiceFailed as exc:
                say(f"error: {exc}; see the lines above")
                return 1
            if workspace is None:
                return 0
            sup.start(Child("dagster-daemon", daemon_argv(workspace), sys.stdout, pass_fds=(lock.fd,)))
            return sup.run(ready=lambda: _report(_daemon_up, settings, lock))

    return _with_daemon_lock(settings, "orbit daemon", body)


def run_ui(settings: Settings, port: int, no_daemon: bool) -> int:
    """`orbit ui`: the webserver on 127.0.0.1, with a daemon unless one runs (or `no_daemon`)."""
    lock = None
    if not no_daemon:
        running = running_daemon(settings)
        if running is not None:
            say(f"{running}: the UI uses it, not starting another")
        else:
            lock = DaemonLock(dagster_home(settings))
            if not lock.try_acquire():  # taken meanwhile
                say(f"{lock.refusal()}: the UI uses it")
                lock = None
            else:
                lock.claim("orbit ui")
    try:
        prepare_instance(settings)
        say(headline(settings))
        with Supervisor(environment(settings), say, where=str(settings.home)) as sup:
            try:
                workspace = serve_code(settings, sup, sys.stdout)
            except ServiceFailed as exc:
                say(f"error: {exc}; see the lines above")
                return 1
            if workspace is None:
                return 0
            sup.start(Child("dagster-webserver", webserver_argv(workspace, "127.0.0.1", port), sys.stdout))
            if lock is not None:
                log = dagster_home(settings) / "daemon.log"
                say(f"starting a daemon too (log: {log})")
                sup.start(Child("dagster-daemon", daemon_argv(workspace), open(log, "a"), pass_fds=(lock.fd,)))
            url = f"http://127.0.0.1:{port}"

            def ready() -> None:
                say(f"waiting for the webserver to load the code location and answer on {url}")
                waited = wait_for_http(url + "/server_info", 180)
                say(f"UI ready at {url} after {waited:.0f} s" if waited is not None else f"{url} did not answer in 180 s")
                if lock is not None:
                    _report(_daemon_up, settings, lock)

            return sup.run(ready=ready)
    finally:
        if lock is not None:
            lock.release()


def code_server_address(settings: Settings, socket: str | None, host: str | None, port: int | None
                        ) -> CodeServerAddress:
    if socket and port:
        raise OrbitError("give a socket or a port, not both", field="--socket", value=socket,
                         fix="orbit code-server --socket PATH, or --port N [--host 127.0.0.1]")
    if socket:
        return CodeServerAddress.parse("unix:" + str(Path(socket).expanduser().resolve()), field="--socket")
    if port:
        host = host or "127.0.0.1"
        if host not in LOOPBACK:
            raise OrbitError("a code server answers whoever reaches it (no authentication: anyone could launch "
                             "runs)", field="--host", value=host,
                             fix="listen on 127.0.0.1 or a unix socket; reach it from elsewhere through an SSH "
                                 "tunnel")
        return CodeServerAddress(host=host, port=port)
    return settings.code_server or CodeServerAddress(socket=default_socket(dagster_home(settings)))


def run_code_server(settings: Settings, address: CodeServerAddress) -> int:
    """`orbit code-server`: orbit's code location served at `address` until SIGTERM."""
    if answers(address, timeout_s=2.0):
        raise OrbitError(f"a code server already answers at {address}", field="code server", value=str(address),
                         fix="use it (ORBIT_CODE_SERVER), or stop it first")
    with Supervisor(environment(settings), say, where=str(settings.home)) as sup:
        child = sup.start(code_server_child(address, sys.stdout))
        try:
            waited = sup.wait_until(lambda: answers(address), "the code server answered", CODE_SERVER_TIMEOUT_S,
                                    child)
        except ServiceFailed as exc:
            say(f"error: {exc}; see the lines above")
            return 1
        if waited is None:
            return 0
        say(f"code server answers at {address} after {waited:.0f} s; daemon and UI use it with "
            f"ORBIT_CODE_SERVER={address}")
        return sup.run()
