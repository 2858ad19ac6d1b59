"""Reaching inventory hosts: host keys checked, connections cached and re-made, errors translated.

`HostSessions` is the only place that opens connections. Each call runs `fn(client)`; one
that went stale (a dropped network, a restarted sshd) gets one reconnect and one retry,
which is safe because every remote step the provider takes is idempotent. A failure on a
fresh connection is final and reaches the caller as an orbit error. Reachability is kept
in `state_dir/hosts/<name>.json` so another process can tell how long a host has been gone.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import shlex
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, TypeVar

import paramiko

from ...core.errors import AuthError, HostKeyMismatch, NetworkError
from ...settings import secret
from ..jsonfiles import read_json as _read_json
from ..jsonfiles import write_json as _write_json
from .checkpoints import mkdirs
from .errors import RemoteCommandError, SlotsBusy, UnknownHostKey, translated
from .host import NO_CAPACITY
from .inventory import Inventory, SshHost, load_inventory

T = TypeVar("T")
HELPER_SOURCE = Path(__file__).with_name("host.py").read_bytes()
HELPER_NAME = f"ssh_host-{hashlib.sha256(HELPER_SOURCE).hexdigest()[:12]}.py"


# ---- host keys and private keys ---------------------------------------------------
class RefuseUnknownKey(paramiko.MissingHostKeyPolicy):
    """Never AutoAdd: a host whose key is not in known_hosts is refused."""

    def missing_host_key(self, client, hostname, key):  # noqa: ARG002 - paramiko's signature
        raise UnknownHostKey(hostname, key)


class TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Only when the inventory says so: accept an unknown key once and append it to known_hosts
    (a changed key is still refused: paramiko raises BadHostKeyException before asking us)."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def load_private_key(host: SshHost) -> paramiko.PKey:
    passphrase = secret(host.key_passphrase_env) if host.key_passphrase_env else None
    if host.key_file is not None:
        path = host.key_file.expanduser()
        if not path.is_file():
            raise AuthError(f"ssh host {host.name!r}: key_file {path} does not exist", provider="ssh",
                            field="key_file", value=str(path), fix="point key_file at the private key for this host")
        return paramiko.PKey.from_path(path, passphrase)
    text = secret(host.key_env) if host.key_env else None
    if not text:
        raise AuthError(f"ssh host {host.name!r}: environment variable {host.key_env} is unset or empty",
                        provider="ssh", field="key_env", value=host.key_env,
                        fix=f"export {host.key_env} with the private key text (never put it in a file in the repo)")
    for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return cls.from_private_key(io.StringIO(text), passphrase)
        except paramiko.PasswordRequiredException:
            raise
        except (paramiko.SSHException, ValueError):
            continue
    raise AuthError(f"ssh host {host.name!r}: {host.key_env} holds no ed25519/ECDSA/RSA private key", provider="ssh",
                    field="key_env", value=host.key_env, fix="export the key in OpenSSH or PEM format")


def connect(host: SshHost) -> paramiko.SSHClient:
    """A connected client whose host key was checked against the user's known_hosts only.

    Raises paramiko/socket exceptions (the caller translates them) or HostKeyMismatch.
    """
    known = host.known_hosts.expanduser()
    client = paramiko.SSHClient()
    if known.is_file():
        client.load_host_keys(str(known))  # the user's file only: never ~/.ssh/known_hosts implicitly
    elif not host.trust_on_first_use:
        raise HostKeyMismatch(f"ssh host {host.name!r}: known_hosts {known} does not exist, so no host key is trusted",
                              provider="ssh", field="known_hosts", value=str(known),
                              fix="create it with the host's key (ssh-keyscan, verified out of band), "
                                  "or set trust_on_first_use: true")
    client.set_missing_host_key_policy(TrustOnFirstUse(known) if host.trust_on_first_use else RefuseUnknownKey())
    t = host.connect_timeout_s
    try:
        client.connect(host.host, port=host.port, username=host.user, pkey=load_private_key(host),
                       look_for_keys=False, allow_agent=False, timeout=2 * t, banner_timeout=t, auth_timeout=t,
                       channel_timeout=t)  # negotiation outlasts the banner wait: the banner error names the cause
    except BaseException:
        client.close()
        raise
    return client


class HostSessions:
    """Connections to the inventory's hosts, one cached client (+ SFTP) per host name."""

    def __init__(self, inventory_path: Path, state_dir: Path, *, command_timeout_s: float = 120.0):
        self.inventory_path = inventory_path
        self.state_dir = Path(state_dir)
        (self.state_dir / "hosts").mkdir(parents=True, exist_ok=True)
        self.command_timeout_s = command_timeout_s
        self._inventory: tuple[float, Inventory] | None = None
        self._clients: dict[str, paramiko.SSHClient] = {}
        self._sftps: dict[str, paramiko.SFTPClient] = {}
        self._roots: dict[str, str] = {}
        self._helpers: set[str] = set()
        self._lock = threading.RLock()
        self.last_connect_s: float | None = None  # measured, for the docs and the curious

    @property
    def inventory(self) -> Inventory:
        """The inventory file, re-read when it changes (a user may edit it between runs)."""
        mtime = self.inventory_path.stat().st_mtime if self.inventory_path.exists() else -1.0
        if self._inventory is None or self._inventory[0] != mtime:
            self._inventory = (mtime, load_inventory(self.inventory_path))
        return self._inventory[1]

    def _client(self, name: str) -> tuple[paramiko.SSHClient, bool]:
        """The cached connection to `name` if it is alive, else a new one (and True)."""
        with self._lock:
            c = self._clients.get(name)
            t = c.get_transport() if c is not None else None
            if t is not None and t.is_active():
                return c, False
            self.disconnect(name)
            t0 = time.monotonic()
            with translated(name, "connect"):
                c = connect(self.inventory.host(name))
            self.last_connect_s = time.monotonic() - t0
            self._clients[name] = c
            return c, True

    def disconnect(self, name: str) -> None:
        """Drop the cached connection to host `name` (the next call reconnects)."""
        with self._lock:
            self._helpers.discard(name)  # re-checked on the next connection (a host may have been wiped)
            for cache in (self._sftps, self._clients):
                obj = cache.pop(name, None)
                if obj is not None:
                    try:
                        obj.close()
                    except Exception:  # noqa: BLE001 - closing a broken connection may fail any way
                        pass

    def sftp(self, name: str, client: paramiko.SSHClient) -> paramiko.SFTPClient:
        with self._lock:
            s = self._sftps.get(name)
            if s is None or s.get_channel() is None or s.get_channel().closed:
                s = self._sftps[name] = client.open_sftp()
            return s

    def do(self, name: str, action: str, fn: Callable[[paramiko.SSHClient], T]) -> T:
        """fn(client), errors translated; a stale connection gets one reconnect and retry
        (safe: every remote step is idempotent). A failure on a fresh connection is final."""
        for _ in range(2):
            fresh = True
            try:
                client, fresh = self._client(name)
                with translated(name, action):
                    out = fn(client)
                self.seen(name, ok=True)
                return out
            except NetworkError:
                self.disconnect(name)
                if fresh:
                    self.seen(name, ok=False)
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def exec(self, client: paramiko.SSHClient, argv: list[str], stdin: bytes = b"",
             timeout: float | None = None) -> tuple[int, bytes, bytes]:
        """Run argv on the host (quoted with shlex.join: no user value is ever parsed by its shell)."""
        chan = client.get_transport().open_session(timeout=30)
        try:
            chan.settimeout(timeout or self.command_timeout_s)
            chan.exec_command(shlex.join(argv))
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out, err = chan.makefile("rb").read(), chan.makefile_stderr("rb").read()
            rc = chan.recv_exit_status()
            if rc == -1:  # the channel closed without an exit status: the connection, not the command
                raise EOFError(f"connection closed before {argv[-1]!r} reported its exit status")
            return rc, out, err
        finally:
            chan.close()

    def root(self, name: str) -> str:
        """The host's workdir as an absolute path (`~` is the remote user's home)."""
        if name not in self._roots:
            host = self.inventory.host(name)

            def resolve(c: paramiko.SSHClient) -> str:
                home = self.sftp(name, c).normalize(".")
                return posixpath.normpath(home + host.workdir[1:]) if host.workdir.startswith("~") else host.workdir

            self._roots[name] = self.do(name, "resolve workdir", resolve)
        return self._roots[name]

    def helper(self, name: str, command: str, request: dict, *, timeout: float | None = None) -> Any:
        """Run one ssh_host.py command on the host; the request travels on stdin."""
        host, root = self.inventory.host(name), self.root(name)
        path = posixpath.join(root, ".orbit", HELPER_NAME)

        def call(c: paramiko.SSHClient) -> Any:
            if name not in self._helpers:
                self._upload_helper(self.sftp(name, c), path)
                self._helpers.add(name)
            # -S: the helper is stdlib only, and a site-packages full of .pth files costs ~0.2 s a call.
            rc, out, err = self.exec(c, [host.python, "-S", path, command], json.dumps(request).encode(), timeout)
            if rc == 0:
                return json.loads(out)
            if rc == NO_CAPACITY:
                raise SlotsBusy(**json.loads(err))
            try:
                info = json.loads(err)
            except ValueError:
                info = {"error": err.decode(errors="replace").strip()[-500:]}
            raise RemoteCommandError(f"{command}: {info.get('error')}", errno=info.get("errno"), returncode=rc)

        return self.do(name, command, call)

    @staticmethod
    def _upload_helper(sftp: paramiko.SFTPClient, path: str) -> None:
        try:
            sftp.stat(path)
            return
        except FileNotFoundError:
            pass
        mkdirs(sftp, posixpath.dirname(path))
        tmp = f"{path}.{uuid.uuid4().hex[:8]}"
        sftp.putfo(io.BytesIO(HELPER_SOURCE), tmp)
        sftp.posix_rename(tmp, path)

    def seen(self, name: str, *, ok: bool) -> None:
        path = self.state_dir / "hosts" / f"{name}.json"
        state = _read_json(path) or {}
        now = time.time()
        if ok and state.get("first_failure") is None and now - state.get("last_ok", 0) < 5:
            return  # throttle writes: status() is polled several times a second
        if ok:
            state.update(last_ok=now, first_failure=None)
        elif state.get("first_failure") is None:
            state["first_failure"] = now
        _write_json(path, state)

    def unreachable_for(self, name: str) -> float:
        first = (_read_json(self.state_dir / "hosts" / f"{name}.json") or {}).get("first_failure")
        return 0.0 if first is None else time.time() - first

    def last_ok(self, name: str) -> float | None:
        return (_read_json(self.state_dir / "hosts" / f"{name}.json") or {}).get("last_ok")

