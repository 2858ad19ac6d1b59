"""sha256 helpers shared by bundles and checkpoints (stdlib only: the runtime copies this idea)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: object) -> str:
    """One byte-exact JSON form of a value, so that hashing it is stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def digest_of_listing(files: dict[str, str]) -> str:
    """Hash of a {relative path: sha256} listing: the content address of a directory."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()
