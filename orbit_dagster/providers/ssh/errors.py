"""paramiko, socket and remote-command failures -> orbit's ProviderError types.

The control plane decides what to do from the type and `retryable` alone (a retryable
error re-queues the attempt, a non-retryable one fails it), so every SSH failure must land
in exactly one class, with a message that names the host and the fix.
"""
from __future__ import annotations

import errno as errno_codes
import socket
from contextlib import contextmanager
from typing import Iterator

import paramiko

from ...core.errors import (
    AuthError,
    HostKeyMismatch,
    NetworkError,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    ResourceNotFound,
    Throttled,
)

PROVIDER = "ssh"
_DISK_FULL = ("no space left on device", "disk quota exceeded")
_CLOSED_TEXT = ("socket is closed", "connection reset", "connection dropped", "broken pipe", "timed out")


class UnknownHostKey(paramiko.SSHException):
    """The host's key is in no known_hosts entry and trust-on-first-use is off."""

    def __init__(self, hostname: str, key: paramiko.PKey):
        self.hostname, self.key = hostname, key
        super().__init__(f"unknown host key {key.get_name()} {key.fingerprint} for {hostname}")


class RemoteCommandError(Exception):
    """A command on the host failed; `errno` when the host said which OSError it was."""

    def __init__(self, message: str, *, errno: int | None = None, returncode: int | None = None):
        self.errno, self.returncode = errno, returncode
        super().__init__(message)


class SlotsBusy(Exception):
    """All GPU slots the request needs are held by other leases on the host."""

    def __init__(self, free: int, total: int, need: int):
        self.free, self.total, self.need = free, total, need
        super().__init__(f"{free} of {total} GPU slots free, {need} needed")


def normalize(exc: BaseException, *, host: str, action: str) -> ProviderError:
    """The orbit error for `exc`, raised while doing `action` on inventory host `host`."""
    where = f"ssh host {host!r}: {action} failed"
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, SlotsBusy):
        return NoCapacity(f"{where}: {exc}", provider=PROVIDER,
                          fix="wait for a lease on the host to end, or add hosts/GPUs to the inventory")
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyMismatch(
            f"{where}: the host presented {exc.key.get_name()} {exc.key.fingerprint}, but known_hosts holds "
            f"{exc.expected_key.fingerprint}; refusing to connect (a changed key can mean a man in the middle)",
            provider=PROVIDER, fix="verify the new key out of band, then replace the host's line in known_hosts")
    if isinstance(exc, UnknownHostKey):
        return HostKeyMismatch(
            f"{where}: {exc}; refusing an unknown host key", provider=PROVIDER,
            fix="add the host's key to the inventory's known_hosts (ssh-keyscan, verified out of band), "
                "or set trust_on_first_use: true for this host")
    if isinstance(exc, paramiko.AuthenticationException):  # incl. PasswordRequiredException
        return AuthError(f"{where}: authentication refused ({exc})", provider=PROVIDER,
                         fix="check user and key_file/key_env in the inventory; the public key must be in the "
                             "host's authorized_keys")
    if isinstance(exc, paramiko.ChannelException):
        # sshd refuses a channel on a live connection when a session/forwarding limit is hit.
        return Throttled(f"{where}: the host refused a channel (code {exc.code}: {exc.text})", provider=PROVIDER,
                         fix="retry later; raise MaxSessions/MaxStartups in the host's sshd_config")
    code = _errno_of(exc)
    text = str(exc).lower()
    if code in (errno_codes.ENOSPC, errno_codes.EDQUOT) or any(t in text for t in _DISK_FULL):
        return QuotaExceeded(f"{where}: the host's disk is full ({exc})", provider=PROVIDER,
                             fix="free space under the host's workdir or point workdir at a larger disk")
    if isinstance(exc, RemoteCommandError) and code is None and exc.returncode == 127:
        return ResourceNotFound(f"{where}: a program is missing on the host ({exc})", provider=PROVIDER,
                                fix="install it, or set `python:` in the inventory to the host's interpreter")
    if code == errno_codes.ENOENT:
        return ResourceNotFound(f"{where}: not found on the host ({exc})", provider=PROVIDER,
                                fix="the lease or run may have been cleaned up; check the host's workdir")
    if code in (errno_codes.EACCES, errno_codes.EPERM):
        return AuthError(f"{where}: permission denied on the host ({exc})", provider=PROVIDER,
                         fix="give the inventory user write access to workdir, or change workdir")
    if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, socket.timeout, TimeoutError,
                        ConnectionError, socket.gaierror, EOFError)):
        return NetworkError(f"{where}: cannot reach the host ({exc})", provider=PROVIDER,
                            fix="check that the host is up and port/host in the inventory are right; retrying")
    if isinstance(exc, paramiko.SSHException):
        if "no acceptable host key" in text:
            return HostKeyMismatch(f"{where}: the host offers no key type that known_hosts holds ({exc})",
                                   provider=PROVIDER, fix="add the host's current key to known_hosts")
        # Banner timeouts, dropped sessions, protocol hiccups: the transport, not the request.
        return NetworkError(f"{where}: the SSH connection failed ({exc or type(exc).__name__})", provider=PROVIDER,
                            fix="check that sshd runs on the host and answers; retrying")
    if isinstance(exc, OSError) and (code in (errno_codes.ENETUNREACH, errno_codes.EHOSTUNREACH, errno_codes.EPIPE,
                                              errno_codes.ECONNABORTED) or any(t in text for t in _CLOSED_TEXT)):
        return NetworkError(f"{where}: the connection to the host broke ({exc})", provider=PROVIDER, fix="retrying")
    return ProviderError(f"{where}: {type(exc).__name__}: {exc}", provider=PROVIDER, retryable=False,
                         fix="see the host's agent.log and sshd log")


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, RemoteCommandError):
        return exc.errno
    if isinstance(exc, (OSError, IOError)) and not isinstance(exc, socket.timeout):
        return exc.errno if isinstance(exc.errno, int) else None
    return None


@contextmanager
def translated(host: str, action: str) -> Iterator[None]:
    """Re-raise anything from paramiko/sockets/the host as the orbit error for it."""
    try:
        yield
    except ProviderError:
        raise
    except (Exception, EOFError) as exc:  # noqa: BLE001 - normalize() decides, unknowns stay non-retryable
        raise normalize(exc, host=host, action=action) from exc
