"""Checkpoint store on a local (or mounted) filesystem. A checkpoint appears by rename."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

from .base import MANIFEST, CheckpointManifest, StoreError, check_name, check_rel, parse_checkpoint_dir


def _path_of(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))
    return Path(uri)


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class FsStore:
    def __init__(self, root_uri: str):
        self.root = _path_of(root_uri).expanduser().resolve()
        self.root_uri = self.root.as_uri()

    def uri_for(self, job_id: str, name: str) -> str:
        return (self.root / check_name("job id", job_id) / check_name("checkpoint name", name)).as_uri()

    def _existing(self, final: Path, manifest: CheckpointManifest) -> str:
        """A checkpoint already at `final`: the same one again is fine, another one is an error."""
        have = self.read_manifest(final.as_uri())
        if have.digest != manifest.digest:
            raise StoreError(f"checkpoint {final.as_uri()} already exists with other content (sha256 "
                             f"{have.digest[:12]}, not {manifest.digest[:12]}); fix: a checkpoint is immutable, "
                             "write it under a new name (a new attempt)")
        return final.as_uri()

    def put(self, job_id: str, name: str, files: dict[str, bytes], manifest: CheckpointManifest) -> str:
        final = _path_of(self.uri_for(job_id, name))
        for rel in files:
            check_rel(rel, final.as_uri())
        if (final / MANIFEST).exists():
            return self._existing(final, manifest)  # a re-sent checkpoint: the same bytes, or an error
        sweep_temp_dirs(self.root / job_id)
        tmp = self.root / job_id / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            for rel, data in files.items():
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
            with open(tmp / MANIFEST, "w") as fh:
                fh.write(manifest.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            try:
                tmp.rename(final)
            except OSError:
                if not (final / MANIFEST).exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return self._existing(final, manifest)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final.as_uri()

    def read_manifest(self, uri: str) -> CheckpointManifest:
        path = _path_of(uri) / MANIFEST
        try:
            return CheckpointManifest.from_json(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"checkpoint {uri} is incomplete: no manifest; it cannot be used") from None

    def _file(self, uri: str, base: Path, rel: str) -> Path:
        """A manifest's file, refused when its name or a symlink leads out of the checkpoint."""
        check_rel(rel, uri)
        f = base / rel
        if f.is_symlink() or not f.resolve().is_relative_to(base.resolve()):
            raise StoreError(f"checkpoint {uri}: file {rel} is a link out of the checkpoint; it cannot be used")
        return f

    def verify(self, uri: str) -> CheckpointManifest:
        manifest = self.read_manifest(uri)
        base = _path_of(uri)
        for rel, info in manifest.files.items():
            f = self._file(uri, base, rel)
            if not f.is_file():
                raise StoreError(f"checkpoint {uri}: file {rel} is missing")
            if f.stat().st_size != int(info["bytes"]) or _hash_file(f) != info["sha256"]:
                raise StoreError(f"checkpoint {uri}: file {rel} does not match its manifest sha256")
        return manifest

    def fetch(self, uri: str, dest: Path) -> CheckpointManifest:
        manifest = self.verify(uri)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        base = _path_of(uri)
        for rel in manifest.files:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self._file(uri, base, rel), dest / rel)
        (dest / MANIFEST).write_text(manifest.to_json())
        return manifest

    def list(self, job_id: str) -> Iterator[str]:
        job_dir = self.root / check_name("job id", job_id)
        if not job_dir.is_dir():
            return
        for d in sorted(job_dir.iterdir()):
            if parse_checkpoint_dir(d.name) and not d.is_symlink() and (d / MANIFEST).exists():
                yield d.as_uri()

    def delete(self, uri: str) -> bool:
        path = _path_of(uri)
        if parse_checkpoint_dir(path.name) is None:
            raise StoreError(f"{uri} is not a checkpoint directory; fix: delete checkpoints by the uri the ledger holds")
        if not path.exists():
            return False
        # Drop the manifest first: a half-deleted checkpoint then reads as incomplete.
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        return True


TEMP_MAX_AGE_S = 3600.0


def sweep_temp_dirs(job_dir: Path, max_age_s: float = TEMP_MAX_AGE_S) -> int:
    """Remove the temp dirs of writers that died mid-write (killed, host lost). A live writer
    finishes within seconds; one older than an hour is gone. Returns how many were removed."""
    removed = 0
    if not job_dir.is_dir():
        return 0
    for d in job_dir.glob(".tmp-*"):
        try:
            if time.time() - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself is flushed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
