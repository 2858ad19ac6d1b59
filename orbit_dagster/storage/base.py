"""The checkpoint store protocol and the manifest that makes a checkpoint complete.

A checkpoint is a directory of files plus `manifest.json` listing the sha256 and size of
each. The manifest is written last, so a checkpoint without one is incomplete and is never
registered or resumed from; a checkpoint whose files do not match it is rejected on read.
"""
from __future__ import annotations

import hashlib
import json
import re
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


def checkpoint_dir_name(step: int, attempt: int) -> str:
    """`step-000000120-a2`: the attempt that wrote a checkpoint is part of its name, so a
    retry (from scratch, or with another config) never writes where an earlier attempt did."""
    return f"step-{int(step):09d}-a{int(attempt)}"


CHECKPOINT_DIR = re.compile(r"^step-(\d{9})-a(\d+)$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def parse_checkpoint_dir(name: str) -> tuple[int, int] | None:
    """(step, attempt) of a checkpoint directory name, or None."""
    m = CHECKPOINT_DIR.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_name(kind: str, value: str) -> str:
    """A job id or checkpoint name used as one path component: no '/', '..' or leading dot."""
    if not isinstance(value, str) or not NAME.match(value) or ".." in value:
        raise StoreError(f"{kind} {value!r} is not a valid name in a checkpoint store; "
                         "fix: letters, digits, '.', '_' and '-', not starting with '.', without '..'")
    return value


def check_rel(rel: str, uri: str) -> str:
    """A file name inside a checkpoint: relative, without '..', not the manifest itself."""
    parts = rel.split("/") if isinstance(rel, str) else [""]
    if (not rel or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts) or rel == MANIFEST
            or len(rel) > 1024 or not rel.isprintable()):  # a NUL or control character is no file name
        shown = repr(rel[:80]) + ("..." if len(rel) > 80 else "") if isinstance(rel, str) else type(rel).__name__
        raise StoreError(f"checkpoint {uri}: file name {shown} is not allowed; "
                         f"fix: a relative path of printable characters without '..' that is not {MANIFEST!r}")
    return rel


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
        """Store files then the manifest, atomically visible; return the checkpoint uri.
        The same checkpoint sent twice is kept once; different content under an existing
        name is a StoreError, never a silent keep of either."""

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

