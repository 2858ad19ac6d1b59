"""A command workload's files into the checkpoint store (stdlib and storage only)."""
from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

from ..storage.base import CheckpointManifest
from ..storage.parts import PART_SIZE

COPY_CHUNK = PART_SIZE  # reads of a script's checkpoint files: whole parts, handed to the store without a copy


def store_files(store, job_id: str, name: str, files: dict[str, Path], manifest: CheckpointManifest) -> CheckpointManifest:
    """A script's checkpoint files streamed from disk into the store (each part hashed and
    written on the store's threads; whole parts straight from the read buffer), the manifest last."""
    with store.writer(job_id, name) as w:
        for rel, path in files.items():
            with open(path, "rb") as src, w.open(rel) as dst:
                shutil.copyfileobj(src, dst, COPY_CHUNK)
        return w.commit(manifest)


def collect_files(store, job_id: str, attempt: int, directory: Path, last_step: int | None, record: Path) -> None:
    """`kind: collect`: what the script wrote under its checkpoint directory, stored as one
    artifact set (not a checkpoint: nothing resumes from it, nothing evaluates it) and listed in
    the attempt's artifacts (`record`, `collected.json`)."""
    files = {str(f.relative_to(directory)): f for f in sorted(directory.rglob("*")) if f.is_file()}
    manifest = CheckpointManifest(job_id=job_id, step=last_step or 0, tier="artifact", files={},
                                  created_at=datetime.now(timezone.utc).isoformat(), attempt=attempt,
                                  meta={"format": "command", "layout": "dir", "name": "collected"})
    name = f"collected-a{attempt}"
    manifest = store_files(store, job_id, name, files, manifest) if files else manifest
    uri = store.uri_for(job_id, name) if files else None
    record.write_text(json.dumps({"uri": uri, "sha256": manifest.digest if files else None, "files": manifest.files},
                                 indent=1))
