"""The local-disk tier of an emergency save: the instance's own disk as a first stop when the
checkpoint store is too slow for a reclaim notice (runtime/emergency.py decides when).

A copy there is written like any checkpoint (parts hashed as they are written, fsynced, the
manifest last) into a filesystem store on that disk, then uploaded file by file into the
checkpoint store (`store_files`: streamed, hashed again part by part, the store's manifest
last) and deleted. Only the store's copy is a checkpoint: the local one is lost with the
instance unless its volume outlives it, which a reclaimed spot instance's disk does not.

What the local disk sustains is measured, not assumed: once per attempt, after the first
durable save, up to PROBE_BYTES go through the same path to it and are deleted again.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..storage.base import CheckpointManifest, CheckpointStore
from ..storage.fs import FsStore
from .encoding import write_state
from .files import store_files

LOCAL_DIR = "local-checkpoints"  # under the agent's workdir, on the instance's own disk
PROBE_BYTES = 64 << 20  # enough to see the disk's rate past the fixed costs of a save; a fraction of a second
PROBE_JOB = "local-probe"


def local_store_for(store: CheckpointStore, workdir: Path) -> FsStore | None:
    """A filesystem store on the instance's disk (`workdir/local-checkpoints`), or None where
    the checkpoint store already is that disk: a copy there first would write the same bytes
    twice to the same device and win nothing."""
    if isinstance(store, FsStore) and os.stat(_existing(store.root)).st_dev == os.stat(_existing(workdir)).st_dev:
        return None
    directory = workdir / LOCAL_DIR
    directory.mkdir(parents=True, exist_ok=True)
    return FsStore(directory.as_uri(), direct=getattr(store, "direct", True))  # an fs store's ORBIT_FS_DIRECT too


def _existing(path: Path) -> Path:
    """The path, or its nearest existing parent (a store's root, a workdir: made by their first write)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def probe(local: FsStore, nbytes: int) -> tuple[int, float]:
    """(bytes, seconds) of a save of min(nbytes, PROBE_BYTES) to the local store through the
    save path (serialise, hash parts, fsync, manifest), deleted afterwards."""
    floats = max(1, min(nbytes, PROBE_BYTES) // 4)
    state = {"probe": torch.rand(floats)}  # random: no disk or filesystem compresses it
    name = "step-000000000-a0"
    began = time.perf_counter()
    with local.writer(PROBE_JOB, name) as w:
        write_state(w, "state.pt", state, state)
        manifest = w.commit(CheckpointManifest(job_id=PROBE_JOB, step=0, tier="local", files={}, format="torch"))
    seconds = time.perf_counter() - began
    local.delete(local.uri_for(PROBE_JOB, name))
    return manifest.total_bytes, seconds


def upload(local: FsStore, store: CheckpointStore, local_uri: str, job_id: str, name: str,
           manifest: CheckpointManifest) -> CheckpointManifest:
    """The local copy, verified part by part where it lies, into the store under `name`; the
    store's manifest (the commit point) last. The local copy is deleted once that commits.
    A copy whose bytes changed on the local disk is refused here (StoreError), never uploaded."""
    _, directory = local.checkout(local_uri, local.root)  # a filesystem store: verified in place, no copy
    files = {rel: directory / rel for rel in sorted(manifest.files)}
    durable = store_files(store, job_id, name, files, manifest)
    # The same bytes cut into parts of the same size have the same digest (a store of another
    # part size hashed them anew as they went in, which stands on its own).
    if durable.part_size == manifest.part_size and durable.digest != manifest.digest:
        raise RuntimeError(f"upload of {local_uri}: the store's digest {durable.digest[:12]} differs from the "
                           f"local copy's {manifest.digest[:12]}")
    local.delete(local_uri)
    return durable
