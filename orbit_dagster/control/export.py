"""Exports people use: a checkpoint's weights as `safetensors` (`orbit export`).

A checkpoint is a torch pickle (`state.pt`), a command workload's files or a
torch.distributed.checkpoint directory of shards: what the training resumes from, not what an
evaluation or a person wants to load. `export_weights` takes an experiment's best checkpoint
(or one named by its key), checks it against the sha256 the ledger recorded (and a delta's
base too), loads it with `torch.load(..., weights_only=True)` (a delta on its base, shards
resharded into whole tensors), and writes its weights (`model`) alone as one safetensors file:
no pickle, loadable by `safetensors.torch.load_file` anywhere. The file is written under a
temp name, fsynced and renamed; its weights must hash to the checkpoint's `weights_sha256`
(the same weights, exactly) and its sha256 is recorded in the ledger (`checkpoint_export`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..core.errors import NotFound, OrbitError
from ..ledger import records as R
from ..settings import Settings
from ..storage import store_of
from .best import compute_best
from .checkpoints import check_against_ledger

FORMATS = ("safetensors",)
STATE_FILE = "state.pt"


def resolve(settings: Settings, target: str) -> dict:
    """The checkpoint row TARGET names: a checkpoint key (`<job>/a<n>/<step>`), else an experiment (its best)."""
    ledger = settings.ledger()
    row = R.checkpoint(ledger, target)
    if row is not None:
        return row
    if "/" not in target:
        try:
            best = compute_best(settings, target)
        except NotFound:  # no such experiment: said below, with both readings of TARGET
            best = None
        if best is not None:
            return R.checkpoint(ledger, best["checkpoint_key"])
    raise NotFound(f"{target!r} is neither a checkpoint key nor an experiment with a best checkpoint",
                   field="BEST_OR_CHECKPOINT", value=target,
                   fix="name a checkpoint as <job>/a<attempt>/<step> (`orbit status JOB`) or an experiment whose "
                       "checkpoints were evaluated (`orbit best EXPERIMENT`)")


def _load(uri: str, scratch: Path) -> dict:
    """The checkpoint's state, verified: a torch state (a delta applied on its base) or DCP shards made whole."""
    import torch  # lazy: torch (2-3 s) only for this command, never on the control plane's other paths

    from ..runtime.delta import DELTA_KEY, apply_delta, is_delta  # lazy: imports torch, as above

    manifest, directory = store_of(uri).checkout(uri, scratch / uri.rstrip("/").rsplit("/", 1)[-1])
    if manifest.format == "dcp":
        # lazy: torch.distributed.checkpoint, for sharded checkpoints only
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = scratch / "whole.pt"
        scratch.mkdir(parents=True, exist_ok=True)
        dcp_to_torch_save(directory, whole)  # every shard, resharded into whole tensors, no process group
        return torch.load(whole, map_location="cpu", weights_only=True)
    files = [rel for rel in manifest.files if rel != STATE_FILE]
    rel = STATE_FILE if STATE_FILE in manifest.files else (files[0] if len(files) == 1 else None)
    if rel is None:
        raise OrbitError(f"checkpoint {uri} holds {len(manifest.files)} files and no state.pt: no one torch state "
                         "to export", field="BEST_OR_CHECKPOINT", value=uri,
                         fix="export a checkpoint of an SDK job, a command workload's single-file save or a DCP "
                             "directory; a Hugging Face checkpoint already holds model.safetensors")
    try:
        state = torch.load(directory / rel, map_location="cpu", weights_only=True)  # data, never code
    except Exception as exc:  # noqa: BLE001 - a pickle refused or no torch file: one line naming the file
        raise OrbitError(f"checkpoint {uri}: {rel} is not a torch state weights_only loads: "
                         f"{' '.join(str(exc).split())[:200]}", field="BEST_OR_CHECKPOINT", value=uri,
                         fix="export a checkpoint saved with torch.save of tensors") from None
    if is_delta(state):
        state = apply_delta(_load(state[DELTA_KEY]["base"], scratch), state)
    return state


def _weights(state: Any, uri: str) -> dict:
    """`model` of the state (or the state itself when it is a flat dict of tensors), shared storage unshared."""
    import torch  # lazy: see _load

    model = state.get("model") if isinstance(state, dict) and isinstance(state.get("model"), dict) else state
    if not isinstance(model, dict) or not model or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise OrbitError(f"checkpoint {uri} has no `model` mapping of names to tensors to export",
                         field="BEST_OR_CHECKPOINT", value=uri,
                         fix="save the weights under state['model'] (the SDK does), or a flat dict of tensors")
    seen: set[int] = set()
    out = {}
    for name, t in model.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        # safetensors refuses tensors that share memory (tied weights): each gets its own copy.
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def export_weights(settings: Settings, target: str, dest: Path, *, fmt: str = "safetensors") -> dict:
    """Write TARGET's weights to `dest` (a file, or a directory to name it in); the ledger records it."""
    if fmt not in FORMATS:
        raise OrbitError(f"export format {fmt!r} is not supported", field="--format", value=fmt,
                         fix=f"one of: {', '.join(FORMATS)}")
    row = resolve(settings, target)
    key = row["checkpoint_key"]
    dest = Path(dest)
    if dest.is_dir():
        dest = dest / f"{key.replace('/', '-')}.safetensors"
    if dest.exists():
        raise OrbitError(f"{dest} exists", field="DEST", value=str(dest), fix="name a new file, or remove it first")
    check_against_ledger(row)  # the bytes the ledger registered, not merely their own manifest
    from safetensors.torch import save_file  # lazy: safetensors and torch (seconds), for this command only

    from ..runtime.checkpointing import weights_digest  # lazy: imports torch, as above

    with tempfile.TemporaryDirectory(prefix=".orbit-export-", dir=settings.home) as tmp:
        weights = _weights(_load(row["uri"], Path(tmp)), row["uri"])
        digest = weights_digest(weights)
        if row.get("weights_sha256") and digest != row["weights_sha256"]:
            raise OrbitError(f"checkpoint {key}: the weights loaded hash to {digest[:12]}, the ledger recorded "
                             f"{row['weights_sha256'][:12]}", field="BEST_OR_CHECKPOINT", value=key,
                             fix="the checkpoint does not hold the weights it was registered with; export another")
        part = Path(tmp) / "export.safetensors"
        save_file(weights, str(part), metadata={"orbit_checkpoint": key, "orbit_checkpoint_sha256": row["sha256"],
                                                "orbit_weights_sha256": digest})
        sha, size = _sha256_file(part), part.stat().st_size
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.copyfile(part, staged)
        with open(staged, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(staged, dest)  # whole or absent
    record = {"checkpoint_key": key, "format": fmt, "dest": str(dest.resolve()), "sha256": sha, "bytes": size,
              "weights_sha256": digest, "tensors": len(weights)}
    settings.ledger().commit({"events": [R.event("checkpoint_export", job_id=row["job_id"], checkpoint_key=key,
                                                 **{k: v for k, v in record.items() if k != "checkpoint_key"})]})
    return record


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
