"""A real OpenSSH server on 127.0.0.1 for the SSH provider's tests: the rental host on loopback.

Its own host key, its own user key pair and authorized_keys (nothing under ~/.ssh is
touched), password and PAM logins off. A second port on the same daemon allows only one
session per connection (`MaxSessions 1`), so a test can meet sshd's real "administratively
prohibited" channel refusal.
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"


def sshd_missing_reason() -> str | None:
    """Why the real sshd cannot run here, or None when it can."""
    if not SSHD.is_file():
        return "needs /usr/sbin/sshd (openssh-server; `make system-deps` installs it)"
    if not Path(SSH_KEYGEN).is_file():
        return "needs ssh-keygen (openssh-client)"
    if shutil.which("setsid") is None:
        return "needs setsid (util-linux)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str) -> str:
    """An ed25519 key pair at `path` (+ .pub); returns the public line."""
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@dataclass
class Sshd:
    root: Path
    port: int
    throttled_port: int  # same daemon, MaxSessions 1
    user: str
    user_key: Path
    host_pub: str  # "ssh-ed25519 AAAA..."
    proc: subprocess.Popen

    def known_hosts_line(self, port: int | None = None) -> str:
        return f"[127.0.0.1]:{port or self.port} {self.host_pub}\n"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the daemon and its children
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def start_sshd(root: Path, *, host_key: str | None = None, authorized_key: str | None = None,
               port: int | None = None) -> Sshd:
    """`host_key` (OpenSSH private key text) and `authorized_key` (a public line) replace the
    generated ones, as cloud-init installs them on an EC2 instance; `port` fixes the port."""
    root.mkdir(parents=True, exist_ok=True)
    host_key_file = root / "host_ed25519"
    if host_key is None:
        host_pub = keygen(host_key_file, "orbit-test-host").split()
    else:
        fd = os.open(host_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(host_key)
        host_pub = subprocess.run([SSH_KEYGEN, "-y", "-f", str(host_key_file)], check=True, capture_output=True,
                                  text=True).stdout.split()
    user_key = root / "user_ed25519"
    (root / "authorized_keys").write_text((authorized_key or keygen(user_key, "orbit-test-user")) + "\n")
    port, throttled = port or free_port(), free_port()
    config = root / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}",
        f"Port {throttled}",
        "ListenAddress 127.0.0.1",
        f"HostKey {host_key_file}",
        f"PidFile {root / 'sshd.pid'}",
        f"AuthorizedKeysFile {root / 'authorized_keys'}",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",  # keys live under a temp dir
        "Subsystem sftp internal-sftp",
        "LogLevel INFO",
        f"Match LocalPort {throttled}",
        "    MaxSessions 1",
        "",
    ]))
    try:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir
    except PermissionError:
        pass
    log = open(root / "sshd.log", "ab")
    proc = subprocess.Popen(
        ["setsid", str(SSHD), "-D", "-e", "-f", str(config)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # not start_new_session too: setsid would then fork, and proc.pid would not be sshd's
    deadline = time.time() + 10
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {(root / 'sshd.log').read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if s.recv(64).startswith(b"SSH-"):
                    break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("sshd did not answer within 10 s")
    return Sshd(root=root, port=port, throttled_port=throttled, user=getpass.getuser(), user_key=user_key,
                host_pub=f"{host_pub[0]} {host_pub[1]}", proc=proc)
