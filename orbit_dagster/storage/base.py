"""The checkpoint store protocol and the manifest that makes a checkpoint complete.

A checkpoint is a directory of files plus `manifest.json` describing each. The manifest is
written last, so a checkpoint without one is incomplete and is never registered or resumed
from; a checkpoint whose files do not match it is rejected on read.

Two manifest versions are read (docs/recovery.md, "Checkpoint format"):
- version 1 (written before streaming saves): each file's sha256 and size. Its JSON has no
  `version` key; it is still read, verified and resumed from, and re-written byte for byte
  as it was (`to_json`), so its digest never changes.
- version 2 (written now): each file cut into `part_size` parts, the sha256 of every part
  (hashed on several threads while the file is written, verified on several while it is
  read), and `format`, what the files hold (`torch`: one `state.pt`; `dcp`: a
  torch.distributed.checkpoint directory of shards; `files`: a command workload's own).
The manifest's `digest` (the checkpoint's sha256 in the ledger) is a digest of the digests:
of each file's name and sha256 (v1), or name, size, part size and part digests (v2).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # what this code writes
READS_VERSIONS = (1, 2)
V1_FIELDS = ("job_id", "step", "tier", "files", "weights_sha256", "parent", "created_at", "attempt", "meta")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class StoreError(Exception):
    """A checkpoint is missing, incomplete or corrupt (message names the uri and the fix)."""


class ManifestError(StoreError, ValueError):
    """A manifest that is not one this code reads (names the field, the value and the fix)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listing_digest(files: dict[str, dict]) -> str:
    """The version-1 digest: over each file's name and whole-file sha256."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['sha256']}\n".encode())
    return h.hexdigest()


def parts_digest(files: dict[str, dict], part_size: int) -> str:
    """The version-2 digest: over each file's name, size and part digests (a digest of digests;
    the prefix keeps it apart from any version-1 digest)."""
    h = hashlib.sha256(b"orbit-checkpoint-manifest-v2\n")
    for rel in sorted(files):
        info = files[rel]
        h.update(f"{rel}\0{int(info['bytes'])}\0{int(part_size)}\0{','.join(info['parts'])}\n".encode())
    return h.hexdigest()


def part_count(nbytes: int, part_size: int) -> int:
    """Parts of a file of `nbytes` (an empty file has none)."""
    return -(-int(nbytes) // int(part_size))


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


# One node's part of a group's checkpoint (runtime/group.py): stored beside the checkpoint's name
# until node 0 has put the checkpoint together, then deleted; never a checkpoint itself.
PART_DIR = re.compile(r"^step-(\d{9})-a(\d+)\.node(\d+)$")


def checkpoint_part_name(step: int, attempt: int, node_rank: int) -> str:
    return f"{checkpoint_dir_name(step, attempt)}.node{int(node_rank)}"


def deletable(name: str) -> bool:
    """A checkpoint's directory, or a group node's part of one: what a store deletes by name."""
    return parse_checkpoint_dir(name) is not None or PART_DIR.match(name) is not None


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
    files: dict[str, dict]  # v1: rel -> {"sha256", "bytes"}; v2: rel -> {"bytes", "parts": [sha256 of each part]}
    weights_sha256: str = ""
    parent: str | None = None
    created_at: str = ""
    attempt: int = 0
    meta: dict = field(default_factory=dict)
    # A manifest built by hand with whole-file sha256s is version 1, as before versions
    # existed; a store's writer commits version 2 (MANIFEST_VERSION), with its parts.
    version: int = 1
    part_size: int = 0  # v2: bytes per part (the last part of a file may be shorter)
    format: str = ""  # v2: "torch" | "dcp" | "files"

    @property
    def digest(self) -> str:
        return listing_digest(self.files) if self.version == 1 else parts_digest(self.files, self.part_size)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())

    def to_json(self) -> str:
        d = asdict(self)
        if self.version == 1:  # exactly the keys a version-1 writer wrote
            d = {k: d[k] for k in V1_FIELDS}
        d["digest"] = self.digest
        return json.dumps(d, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointManifest":
        """A manifest read from a store (or a host): every field checked, ManifestError otherwise."""
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"manifest is not JSON: {' '.join(str(exc).split())[:160]}; fix: the checkpoint "
                                "is damaged, resume from another") from None
        if not isinstance(d, dict):
            raise ManifestError("manifest is not a JSON object; fix: the checkpoint is damaged, resume from another")
        d.pop("digest", None)
        version = d.setdefault("version", 1)  # a manifest without one was written before versions existed
        if isinstance(version, bool) or version not in READS_VERSIONS:
            raise ManifestError(f"manifest version {version!r} is not one this code reads {READS_VERSIONS}; fix: "
                                "upgrade orbit-dagster to read checkpoints a newer one wrote")
        allowed = set(V1_FIELDS) | ({"version"} if version == 1 else {"version", "part_size", "format"})
        unknown = sorted(set(d) - allowed)
        missing = [k for k in ("job_id", "step", "tier", "files") if k not in d]
        if unknown or missing:
            raise ManifestError(f"manifest version {version}: fields {unknown or missing} are "
                                f"{'unknown' if unknown else 'missing'}; fix: the checkpoint is damaged or written "
                                "by another program, resume from another")
        manifest = cls(**d)
        _check_files(manifest)
        return manifest


def _check_files(m: CheckpointManifest) -> None:
    """The file listing a manifest of its version must have (sizes, digests, part counts)."""
    def bad(rel: str, what: str) -> ManifestError:
        return ManifestError(f"manifest version {m.version}: file {str(rel)[:80]!r} {what}; fix: the checkpoint "
                             "is damaged, resume from another")

    if not isinstance(m.files, dict):
        raise ManifestError("manifest: 'files' is not a mapping; fix: the checkpoint is damaged, resume from another")
    if m.version == 2 and (isinstance(m.part_size, bool) or not isinstance(m.part_size, int) or m.part_size <= 0):
        raise ManifestError(f"manifest version 2: part_size {m.part_size!r} is not a positive integer; fix: the "
                            "checkpoint is damaged, resume from another")
    for rel, info in m.files.items():
        size = info.get("bytes") if isinstance(info, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise bad(rel, "has no byte count")
        if m.version == 1:
            if not isinstance(info.get("sha256"), str):
                raise bad(rel, "has no sha256")
            continue
        parts = info.get("parts")
        if not isinstance(parts, list) or not all(isinstance(p, str) and _HEX64.match(p) for p in parts):
            raise bad(rel, "has no list of part sha256 digests")
        if len(parts) != part_count(size, m.part_size):
            raise bad(rel, f"lists {len(parts)} parts for {size} bytes in parts of {m.part_size}")


class CheckpointWriter(Protocol):
    """One checkpoint being written (`store.writer(job, name)`): files streamed in, each cut
    into parts hashed on several threads as it is written; the manifest last, on `commit`.
    Left without a commit (an exception, a `with` block that ends), nothing is visible."""

    uri: str

    def open(self, rel: str):
        """A binary file-like object (`write`, `tell`, `close`; a context manager) for one file."""

    def add(self, rel: str, data: bytes) -> None:
        """One file from bytes in memory."""

    def commit(self, manifest: CheckpointManifest) -> CheckpointManifest:
        """Write the manifest (its `files`, `version` and `part_size` from what was written)
        last; return it. The same checkpoint already there is kept once (returned); other
        content under the name is a StoreError."""

    def abort(self) -> None:
        """Discard everything written (nothing of it was visible)."""


class CheckpointStore(Protocol):
    root_uri: str

    def writer(self, job_id: str, name: str) -> CheckpointWriter:
        """A writer for a new checkpoint (see CheckpointWriter)."""

    def put(self, job_id: str, name: str, files: dict[str, bytes], manifest: CheckpointManifest) -> str:
        """Store files then the manifest, atomically visible; return the checkpoint uri. The
        manifest's `files` (and version, part size) are filled in with what was written, on
        the object passed. The same checkpoint sent twice is kept once; different content
        under an existing name is a StoreError, never a silent keep of either."""

    def uri_for(self, job_id: str, name: str) -> str:
        """Where `put(job_id, name, ...)` stores the checkpoint (known before it lands)."""

    def read_manifest(self, uri: str) -> CheckpointManifest:
        """The manifest, or StoreError if the checkpoint is incomplete."""

    def fetch(self, uri: str, dest: Path) -> CheckpointManifest:
        """Download into `dest` and verify every file (every part) against the manifest."""

    def checkout(self, uri: str, scratch: Path) -> tuple[CheckpointManifest, Path]:
        """The checkpoint's verified files in a directory, to read (never to change): the
        store's own directory where the store is local (no copy), else fetched into `scratch`."""

    def verify(self, uri: str) -> CheckpointManifest:
        """Re-hash the stored files against the manifest (StoreError on mismatch)."""

    def list(self, job_id: str) -> Iterator[str]:
        """Uris of the job's complete checkpoints (manifest present)."""

    def parts(self, job_id: str) -> Iterator[str]:
        """Uris of group nodes' parts (PART_DIR) under the job, complete or not: the ones node 0
        never put together are garbage once their attempt has ended."""

    def delete(self, uri: str) -> bool:
        """Remove a checkpoint; a checkpoint already gone is not an error (returns False)."""
