"""Checkpoints across the SSH boundary, over SFTP, with the store's own rules.

With a `file://` store the host writes checkpoints to its own disk (`<run_root>/checkpoints`,
the same `<job>/step-<9 digits>/` layout). `fetch_checkpoint` brings one into the control
plane's store; `push_checkpoint` sends one to a host to resume from. Both copy into a temp
dir, check every file's size and sha256 against the manifest, write the manifest last and
rename, so a checkpoint is either complete on the other side or absent. A host is not
trusted: paths in its events and manifests are checked before anything is written.
"""
from __future__ import annotations

import os
import posixpath
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator
from urllib.parse import unquote, urlparse

import paramiko

from ...core.errors import ProviderError
from ...core.host_contract import Checkpoint
from ...storage.base import MANIFEST, CheckpointManifest, StoreError, checkpoint_dir_name
from ...storage.fs import FsStore
from ...storage.reading import Digester

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
CHUNK = 1 << 20


def uri_path(uri: str) -> str:
    return unquote(urlparse(uri).path) if uri.startswith("file://") else uri


def _bad(message: str, fix: str = "the host's event or manifest is malformed; it is not used") -> ProviderError:
    return ProviderError(message, provider="ssh", retryable=False, fix=fix)


def mkdirs(sftp: paramiko.SFTPClient, path: str) -> None:
    """`mkdir -p` over SFTP."""
    missing = []
    while path not in ("", "/"):
        try:
            sftp.stat(path)
            break
        except FileNotFoundError:
            missing.append(path)
            path = posixpath.dirname(path)
    for p in reversed(missing):
        try:
            sftp.mkdir(p)
        except OSError:
            sftp.stat(p)  # made meanwhile by another process: fine; else this raises


def remote_dir_of(event: Checkpoint, host_store_uri: str) -> str:
    """The checkpoint dir an event names, after checking it is `<host store>/<job>/step-N`."""
    remote, base = posixpath.normpath(uri_path(event.uri)), uri_path(host_store_uri).rstrip("/")
    rel = PurePosixPath(remote).relative_to(base) if remote.startswith(base + "/") else None  # after normpath: no ..
    if rel is None or len(rel.parts) != 2 or not _JOB.match(rel.parts[0]):
        raise _bad(f"checkpoint uri {event.uri!r} is not under the host's store {host_store_uri}")
    if rel.parts[1] != checkpoint_dir_name(event.step, event.attempt):
        raise _bad(f"checkpoint uri {event.uri!r} does not match its step {event.step}")
    return posixpath.join(base, *rel.parts)


def rewrite_uri(uri: str, from_store: str, to_store: str) -> str:
    """`<from_store>/<job>/<step>` -> `<to_store>/<job>/<step>`; other uris unchanged."""
    src, dst = uri_path(from_store).rstrip("/"), FsStore(to_store).root
    path = uri_path(uri)
    if not path.startswith(src + "/"):
        return uri
    return (dst / path[len(src) + 1:]).as_uri()


def _safe_rel(rel: str) -> str:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts or rel == MANIFEST:
        raise _bad(f"checkpoint manifest names an unsafe file path {rel!r}")
    return p.as_posix()


def fetch_checkpoint(sftp: paramiko.SFTPClient, remote_dir: str, store_uri: str) -> str:
    """Copy a complete checkpoint from the host into the local fs store; returns its local uri."""
    store = FsStore(store_uri)
    job, name = PurePosixPath(remote_dir).parts[-2:]
    final = store.root / job / name
    if not (final / MANIFEST).exists():
        with sftp.open(posixpath.join(remote_dir, MANIFEST), "rb") as fh:  # absent: incomplete, ENOENT
            manifest_bytes = fh.read()
        manifest = CheckpointManifest.from_json(manifest_bytes.decode())
        tmp = final.parent / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            for rel, info in sorted(manifest.files.items()):
                _get_verified(sftp, posixpath.join(remote_dir, _safe_rel(rel)), tmp / rel,
                              Digester(info, manifest.version, manifest.part_size))
            with _our_disk(tmp / MANIFEST), open(tmp / MANIFEST, "wb") as fh:  # last: complete only now
                fh.write(manifest_bytes)
                fh.flush()
                os.fsync(fh.fileno())
            with _our_disk(final):
                try:
                    tmp.rename(final)
                except OSError:
                    if not (final / MANIFEST).exists():  # not a concurrent copy that landed first
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        store.verify(final.as_uri())
    except StoreError as exc:
        raise _bad(f"localized checkpoint does not verify: {exc}") from None
    return final.as_uri()


def _get_verified(sftp: paramiko.SFTPClient, remote: str, local: Path, digest: Digester) -> None:
    """One file over SFTP, hashed as it arrives (the whole file, or each part: either manifest version)."""
    with sftp.open(remote, "rb") as src:
        src.prefetch()  # pipelined reads: several times faster than one request per chunk
        with _our_disk(local):
            local.parent.mkdir(parents=True, exist_ok=True)
            out = open(local, "wb")
        with out:
            while chunk := src.read(CHUNK):  # a failure here is the host's (or the link's)
                digest.update(chunk)
                with _our_disk(local):
                    out.write(chunk)
            with _our_disk(local):
                out.flush()
                os.fsync(out.fileno())
    problem = digest.problem()
    if problem is not None:
        raise ProviderError(f"checkpoint file {remote} arrived as {digest.size} bytes that do not match its manifest "
                            f"({problem})", provider="ssh", retryable=True,
                            fix="the copy was discarded; the next read copies it again")


@contextmanager
def _our_disk(path: Path) -> Iterator[None]:
    """OSErrors on the control plane's own disk: not to be read as the host's (a full local disk
    would otherwise become `QuotaExceeded` on the host)."""
    try:
        yield
    except OSError as exc:
        raise ProviderError(f"cannot write {path} in the control plane's store: {exc}", provider="ssh",
                            retryable=False, fix="free space or fix permissions on the checkpoint store") from exc


def push_checkpoint(sftp: paramiko.SFTPClient, src: Path, remote_dir: str) -> None:
    """Send a local, verified checkpoint to `remote_dir` on the host (temp dir, manifest last, rename)."""
    try:
        manifest = FsStore(src.parent.parent.as_uri()).verify(src.as_uri())
    except StoreError as exc:
        raise _bad(f"cannot stage checkpoint {src}: {exc}", fix="resume from another checkpoint") from None
    tmp = posixpath.join(posixpath.dirname(remote_dir), f".tmp-{posixpath.basename(remote_dir)}-{uuid.uuid4().hex[:8]}")
    for rel in sorted(manifest.files):
        target = posixpath.join(tmp, _safe_rel(rel))
        mkdirs(sftp, posixpath.dirname(target))
        sftp.put(str(src / rel), target, confirm=True)
    sftp.put(str(src / MANIFEST), posixpath.join(tmp, MANIFEST), confirm=True)
    sftp.posix_rename(tmp, remote_dir)
