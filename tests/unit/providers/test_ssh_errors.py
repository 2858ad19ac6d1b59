"""Every SSH failure lands in exactly one orbit error class, with the right `retryable`."""
from __future__ import annotations

import errno
import socket

import paramiko
import pytest
from paramiko.ssh_exception import NoValidConnectionsError

from orbit_dagster.core.errors import (
    AuthError,
    HostKeyMismatch,
    NetworkError,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    ResourceNotFound,
    Throttled,
)
from orbit_dagster.providers.ssh.errors import (
    RemoteCommandError,
    SlotsBusy,
    UnknownHostKey,
    normalize,
    translated,
)

KEY, OTHER = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()

CASES = [
    # (raised by paramiko / the socket / the host, orbit class, retryable)
    (paramiko.AuthenticationException("Authentication failed."), AuthError, False),
    (paramiko.BadAuthenticationType("Bad authentication type", ["password"]), AuthError, False),
    (paramiko.PasswordRequiredException("Private key file is encrypted"), AuthError, False),
    (PermissionError(errno.EACCES, "Permission denied"), AuthError, False),
    (paramiko.BadHostKeyException("[h]:22", KEY, OTHER), HostKeyMismatch, False),
    (UnknownHostKey("[h]:22", KEY), HostKeyMismatch, False),
    (paramiko.SSHException("Incompatible ssh peer (no acceptable host key)"), HostKeyMismatch, False),
    (NoValidConnectionsError({("127.0.0.1", 22): ConnectionRefusedError(errno.ECONNREFUSED, "refused")}),
     NetworkError, True),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), NetworkError, True),
    (socket.timeout("timed out"), NetworkError, True),
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), NetworkError, True),
    (EOFError(), NetworkError, True),
    (paramiko.SSHException("Error reading SSH protocol banner"), NetworkError, True),
    (paramiko.SSHException("SSH session not active"), NetworkError, True),
    (OSError("Socket is closed"), NetworkError, True),
    (OSError(errno.EHOSTUNREACH, "No route to host"), NetworkError, True),
    (paramiko.ChannelException(1, "Administratively prohibited"), Throttled, True),
    (paramiko.ChannelException(2, "Connect failed"), Throttled, True),  # sshd's MaxSessions refusal
    (OSError(errno.ENOSPC, "No space left on device"), QuotaExceeded, False),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), QuotaExceeded, False),
    (RemoteCommandError("hash: OSError: [Errno 28] No space left on device", errno=28, returncode=2),
     QuotaExceeded, False),
    (IOError(errno.ENOENT, "No such file"), ResourceNotFound, False),  # how paramiko's SFTP says it
    (RemoteCommandError("lease-read: no lease", errno=errno.ENOENT, returncode=2), ResourceNotFound, False),
    (RemoteCommandError("bash: /opt/py/bin/python3: No such file or directory", returncode=127),
     ResourceNotFound, False),
    (SlotsBusy(free=0, total=2, need=1), NoCapacity, True),
    (ValueError("something nobody foresaw"), ProviderError, False),
]


@pytest.mark.parametrize("exc,cls,retryable", CASES, ids=[f"{type(c[0]).__name__}-{c[1].__name__}" for c in CASES])
def test_each_failure_maps_to_its_orbit_error(exc, cls, retryable):
    err = normalize(exc, host="box", action="provision")
    assert type(err) is cls
    assert err.retryable is retryable
    assert err.provider == "ssh"
    assert str(err).startswith("ssh host 'box': provision failed") and "fix: " in str(err)


def test_every_vendor_error_class_is_covered():
    wanted = {AuthError, QuotaExceeded, NoCapacity, Throttled, ResourceNotFound, NetworkError, HostKeyMismatch}
    assert wanted <= {cls for _, cls, _ in CASES}


def test_translated_raises_the_orbit_error_chained_and_passes_orbit_errors_through():
    with pytest.raises(Throttled) as info:
        with translated("box", "status"):
            raise paramiko.ChannelException(1, "Administratively prohibited")
    assert isinstance(info.value.__cause__, paramiko.ChannelException)
    original = NoCapacity("full", provider="ssh")
    with pytest.raises(NoCapacity) as info:
        with translated("box", "provision"):
            raise original
    assert info.value is original


def test_a_host_key_mismatch_names_both_fingerprints():
    msg = str(normalize(paramiko.BadHostKeyException("[h]:22", KEY, OTHER), host="box", action="connect"))
    assert KEY.fingerprint in msg and OTHER.fingerprint in msg and "known_hosts" in msg
