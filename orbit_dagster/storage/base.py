"""The checkpoint store protocol and the manifest that makes a checkpoint complete.

A checkpoint is a directory of files plus `manifest.json` listing the sha256 and size of
each. The manifest is written last, so a checkpoint without one is incomplete and is never
registered or resumed from; a checkpoint whose files do not match it is rejected on read.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

MANIFEST = "manifest.json"


class StoreError(Exception):
    """A checkpoint is missing, incomplete or corrupt (message names the uri and the fix)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listing_digest(files: dict[str, dict]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['sha256']}\n".encode())
    return h.hexdigest()


def checkpoint_dir_name(step: int) -> str:
    # One checkpoint per (job, step): training is deterministic, so two saves of the same
    # step hold the same state, and the first one to land is kept.
    return f"step-{step:09d}"


@dataclass
class CheckpointManifest:
    job_id: str
    step: int
    tier: str
    files: dict[str, dict]  # rel path -> {"sha256", "bytes"}
    weights_sha256: str = ""
    parent: str | None = None
    created_at: str = ""
    attempt: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return listing_digest(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())

    def to_json(self) -> str:
        d = asdict(self)
        d["digest"] = self.digest
        return json.dumps(d, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointManifest":
        d = json.loads(text)
        d.pop("digest", None)
        return cls(**d)


class CheckpointStore(Protocol):
    root_uri: str

    def put(self, job_id: str, name: str, files: dict[str, bytes], manifest: CheckpointManifest) -> str:
        """Store files then the manifest, atomically visible; return the checkpoint uri."""

    def uri_for(self, job_id: str, name: str) -> str:
        """Where `put(job_id, name, ...)` stores the checkpoint (known before it lands)."""

    def read_manifest(self, uri: str) -> CheckpointManifest:
        """The manifest, or StoreError if the checkpoint is incomplete."""

    def fetch(self, uri: str, dest: Path) -> CheckpointManifest:
        """Download into `dest` and verify every file against the manifest."""

    def verify(self, uri: str) -> CheckpointManifest:
        """Re-hash the stored files against the manifest (StoreError on mismatch)."""

    def list(self, job_id: str) -> Iterator[str]:
        """Uris of the job's complete checkpoints (manifest present)."""

    def delete(self, uri: str) -> bool:
        """Remove a checkpoint; a checkpoint already gone is not an error (returns False)."""


def store_of(uri: str) -> CheckpointStore:
    """A store that can read, verify and delete the checkpoint at `uri` (any kind)."""
    return open_store(uri)


def open_store(root_uri: str) -> CheckpointStore:
    """`file:///abs/dir` or a plain path -> FsStore; `s3://bucket/prefix` -> S3Store."""
    if root_uri.startswith("s3://"):
        from .s3 import S3Store

        return S3Store(root_uri)
    from .fs import FsStore

    return FsStore(root_uri)
