"""`orbit import-run DIR`: register a run trained outside the platform, with its checkpoints.

Layout of DIR:
    run.json              optional: {"name", "experiment", "project", "template", "overrides"}
    metrics.jsonl         optional: one {"step": N, "<metric>": value, ...} per line
    <anything>-<step>/    one directory per checkpoint, holding `state.pt` (a torch state
                          dict with "model" and "step"); or orbit's own checkpoint
                          directories (with manifest.json), verified as they are.

Everything in DIR is untrusted input: names are confined to the store (no `..`, absolute
paths or symlinks out), every state is loaded with `weights_only=True` (data, never code)
and its weights hashed before anything is registered, and a refused import leaves nothing
behind (checkpoints copied so far are removed, the ledger is written in one transaction at
the end). The run becomes a job like any other (`imported`), so it appears wherever jobs
do; with a `template`, a bundle is frozen for it and its checkpoints are evaluated too.
"""
from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
from datetime import datetime, timezone
from pathlib import Path

from ..core.bundle import JobBundle, build_bundle
from ..core.errors import OrbitError
from ..core.lifecycle import JobState
from ..ledger import utcnow
from ..ledger import records as R
from ..storage import open_store
from ..storage.base import MANIFEST, CheckpointManifest, StoreError, check_rel, checkpoint_dir_name, sha256_bytes
from .settings import Settings
from .submit import ensure_experiment

STEP_RE = re.compile(r"(\d{1,12})$")
MAX_STATE_BYTES = 64 << 30


def _refuse(message: str, *, field: str, value: object = None, fix: str) -> OrbitError:
    return OrbitError(message, field=field, value=value, fix=fix)


def _weights_digest(blob: bytes, where: str) -> tuple[str, int | None]:
    import torch

    from ..runtime.checkpointing import weights_digest

    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)  # data, never code
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as exc:
        raise _refuse(f"{where} is not a weights-only torch state ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
                      field=where, fix="save plain tensors and numbers: torch.save({'model': model.state_dict(), "
                                       "'step': N}, 'state.pt')") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise _refuse(f"{where} holds no 'model' state dict", field=where, fix="save {'model': ..., 'step': N}")
    return weights_digest(state["model"]), state.get("step")


def _regular_file(path: Path, root: Path) -> Path:
    if path.is_symlink() or not path.resolve().is_relative_to(root):
        raise _refuse(f"{path.relative_to(root)} is a link; imported files must be regular files inside DIR",
                      field="DIR", value=str(path), fix="copy the files instead of linking them")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise _refuse(f"{path.relative_to(root)} is larger than {MAX_STATE_BYTES >> 30} GiB", field="DIR",
                      value=str(path), fix="import smaller checkpoints")
    return path


def _collect(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for d in sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink()):
        m = STEP_RE.search(d.name)
        if m and ((d / "state.pt").is_file() or (d / MANIFEST).is_file()):
            found.append((int(m.group(1)), d))
    steps = [s for s, _ in found]
    if len(steps) != len(set(steps)):
        raise _refuse("two checkpoint directories name the same step", field="DIR", value=str(directory),
                      fix="keep one directory per step")
    return sorted(found)


def _files_of(d: Path, root: Path) -> tuple[dict[str, bytes], str]:
    """The checkpoint's files and its weights digest, every name and byte checked."""
    if (d / MANIFEST).is_file():
        try:
            m = CheckpointManifest.from_json(_regular_file(d / MANIFEST, root).read_text())
        except (ValueError, TypeError, KeyError) as exc:
            raise _refuse(f"{d.name}/{MANIFEST} is not a checkpoint manifest: {exc}", field=d.name,
                          fix="re-export the checkpoint") from None
        files = {}
        for rel, info in m.files.items():
            try:
                check_rel(rel, d.name)
            except StoreError as exc:
                raise _refuse(str(exc), field=d.name, value=rel, fix="re-export the checkpoint") from None
            data = _regular_file(d / rel, root).read_bytes()
            if sha256_bytes(data) != info.get("sha256") or len(data) != int(info.get("bytes", -1)):
                raise _refuse(f"checkpoint {d.name}: file {rel} does not match its manifest", field=d.name, value=rel,
                              fix="re-export it; a corrupt checkpoint is never imported")
            files[rel] = data
        if "state.pt" not in files:
            raise _refuse(f"checkpoint {d.name} has no state.pt", field=d.name, fix="re-export it")
        weights, _ = _weights_digest(files["state.pt"], f"{d.name}/state.pt")
        if m.weights_sha256 and m.weights_sha256 != weights:
            raise _refuse(f"checkpoint {d.name}: its weights do not match the manifest's weights_sha256", field=d.name,
                          fix="re-export it; the manifest was written for other weights")
        return files, weights
    blob = _regular_file(d / "state.pt", root).read_bytes()
    weights, _ = _weights_digest(blob, f"{d.name}/state.pt")
    return {"state.pt": blob}, weights


def _metric_rows(directory: Path, job_id: str, experiment: str, keys: dict[int, str]) -> list[dict]:
    path = directory / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(_regular_file(path, directory).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec.pop("step"))
            values = {str(k)[:200]: float(v) for k, v in rec.items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            raise _refuse(f"metrics.jsonl line {n} is not {{\"step\": N, \"name\": number, ...}}", field="metrics.jsonl",
                          value=line[:120], fix="one JSON object per line with an integer step") from None
        for k, v in values.items():
            rows.append({"job_id": job_id, "experiment": experiment, "run_id": R.run_id_for(job_id, 1),
                         "checkpoint_key": keys.get(step), "step": step, "name": k, "value": v, "source": "train",
                         "ts": utcnow()})
    return rows


def _meta(directory: Path) -> dict:
    path = directory / "run.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(_regular_file(path, directory).read_text())
    except ValueError as exc:
        raise _refuse(f"run.json is not JSON: {exc}", field="run.json", fix="write a JSON object") from None
    if not isinstance(meta, dict):
        raise _refuse("run.json is not a JSON object", field="run.json", fix='e.g. {"experiment": "imported"}')
    return meta


def import_run(settings: Settings, directory: Path, *, experiment: str | None = None, name: str | None = None,
               progress=None) -> dict:
    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        raise _refuse(f"{directory} is not a directory", field="DIR", value=str(directory),
                      fix="give the directory that holds the run's checkpoint directories")
    meta = _meta(directory)
    found = _collect(directory)
    if not found:
        raise _refuse(f"no checkpoints found in {directory}", field="DIR", value=str(directory),
                      fix="each checkpoint is a sub-directory named ...-<step> holding state.pt")
    experiment = experiment or str(meta.get("experiment", "imported"))
    project = str(meta.get("project", "default"))
    base = str(name or meta.get("name") or directory.name)
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:8]
    job_id = f"import-{re.sub(r'[^A-Za-z0-9_-]', '-', base)[:40].strip('-') or 'run'}-{digest}"
    template, sub = None, None
    from .validate import validate_submission

    if meta.get("template"):
        template, sub = validate_submission(settings, str(meta["template"]), dict(meta.get("overrides") or {}),
                                            experiment=experiment, project=project)
    else:  # the names are checked the same way with or without a template
        validate_names(experiment, project)
    ledger = settings.ledger()
    if R.job(ledger, job_id) is not None:
        raise _refuse(f"{directory} was already imported as {job_id}", field="DIR", value=str(directory),
                      fix=f"see it with `orbit status {job_id}`")
    store = open_store(settings.store_uri)
    written: list[str] = []
    lineage = f"L1-import-{digest}"
    try:
        rows = _copy_checkpoints(store, found, job_id, experiment, lineage, directory, written, progress)
        keys = {r["step"]: r["checkpoint_key"] for r in rows}
        metric_rows = _metric_rows(directory, job_id, experiment, keys)
        for r in rows:  # the training loss at a checkpoint's step, if recorded
            r["train_loss"] = next((m["value"] for m in metric_rows
                                    if m["checkpoint_key"] == r["checkpoint_key"] and m["name"] == "train/loss"), None)
        bundle = build_bundle(template, sub, job_id, settings.bundles_dir) if template else None
        _register(ledger, job_id, experiment, project, lineage, template, bundle, rows, metric_rows, directory)
    except BaseException:
        for uri in written:  # a refused import leaves nothing behind
            try:
                store.delete(uri)
            except StoreError:
                pass
        raise
    return {"job_id": job_id, "experiment": experiment, "checkpoints": [r["checkpoint_key"] for r in rows],
            "evaluable": template is not None}


def validate_names(experiment: str, project: str) -> None:
    from ..core.submission import check_name

    check_name("experiment", experiment)
    check_name("project", project)


def _copy_checkpoints(store, found, job_id, experiment, lineage, directory, written, progress) -> list[dict]:
    rows: list[dict] = []
    parent_uri, parent_key = None, None
    for step, d in (progress(found) if progress else found):
        files, weights = _files_of(d, directory)
        manifest = CheckpointManifest(
            job_id=job_id, step=step, tier="durable",
            files={rel: {"sha256": sha256_bytes(b), "bytes": len(b)} for rel, b in files.items()},
            weights_sha256=weights, parent=parent_uri, created_at=datetime.now(timezone.utc).isoformat(), attempt=1,
            meta={"imported_from": str(d)})
        uri = store.put(job_id, checkpoint_dir_name(step, 1), files, manifest)
        written.append(uri)
        rows.append({
            "checkpoint_key": R.checkpoint_key(job_id, 1, step), "job_id": job_id, "experiment": experiment,
            "run_id": R.run_id_for(job_id, 1), "attempt": 1, "lineage": lineage, "step": step, "tier": "durable",
            "parent_key": parent_key, "uri": uri, "sha256": manifest.digest, "bytes": manifest.total_bytes,
            "weights_sha256": weights, "train_loss": None, "created_at": utcnow(), "registered_at": utcnow(),
        })
        parent_uri, parent_key = uri, rows[-1]["checkpoint_key"]
    return rows


def _register(ledger, job_id, experiment, project, lineage, template, bundle: JobBundle | None, rows, metric_rows,
              directory) -> None:
    now = utcnow()
    job_row = {"job_id": job_id, "template": template.name if template else None,
               "template_version": template.version if template else None, "kind": "imported",
               "experiment": experiment, "project": project, "placement": "external", "max_interruptions": 0,
               "imported": 1, "created_at": now, "lineage": lineage}
    with ledger.write() as tx:
        ensure_experiment(tx, experiment, project, template)
        R.insert_job(tx, job_row, [R.state_row(job_id, 1, JobState.CREATED, reason="imported"),
                                   R.state_row(job_id, 1, JobState.SUCCEEDED, reason=f"imported from {directory}")])
        tx.insert("runs", [{"run_id": R.run_id_for(job_id, 1), "job_id": job_id, "attempt": 1, "lineage": lineage,
                            "provider": "external", "imported": 1, "experiment": experiment, "project": project,
                            "started_at": now, "state": "SUCCEEDED", "exit_code": 0,
                            "reason": f"imported from {directory}", "state_at": now}])
        tx.insert("checkpoints", rows)
        tx.insert("metric_points", metric_rows)
        if bundle is not None:
            tx.insert("bundles", [{"bundle_hash": bundle.bundle_hash, "job_id": job_id, "attempt": 1,
                                   "path": str(bundle.path), "template_id": bundle.spec.template.template_id,
                                   "provenance": R.dumps(bundle.spec.provenance), "created_at": now}])
            if template.eval:
                tx.insert("evaluations", [{"checkpoint_key": r["checkpoint_key"], "suite": template.eval.suite_id,
                                           "job_id": job_id, "experiment": experiment, "state": "PENDING", "tries": 0,
                                           "requested_at": now} for r in rows])
        tx.insert("events", [R.event("imported", job_id=job_id, source=str(directory), checkpoints=len(rows))])

