"""Checkpoint store on a local (or mounted) filesystem. A checkpoint appears by rename."""
from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

from .base import MANIFEST, CheckpointManifest, StoreError


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
        return (self.root / job_id / name).as_uri()

    def put(self, job_id: str, name: str, files: dict[str, bytes], manifest: CheckpointManifest) -> str:
        final = self.root / job_id / name
        if (final / MANIFEST).exists():
            return final.as_uri()  # already complete (a re-sent checkpoint): keep the first
        tmp = self.root / job_id / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
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

    def verify(self, uri: str) -> CheckpointManifest:
        manifest = self.read_manifest(uri)
        base = _path_of(uri)
        for rel, info in manifest.files.items():
            f = base / rel
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
            shutil.copyfile(base / rel, dest / rel)
        (dest / MANIFEST).write_text(manifest.to_json())
        return manifest

    def list(self, job_id: str) -> Iterator[str]:
        job_dir = self.root / job_id
        if not job_dir.is_dir():
            return
        for d in sorted(job_dir.iterdir()):
            if not d.name.startswith(".") and (d / MANIFEST).exists():
                yield d.as_uri()

    def delete(self, uri: str) -> bool:
        path = _path_of(uri)
        if not path.exists():
            return False
        # Drop the manifest first: a half-deleted checkpoint then reads as incomplete.
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        return True
