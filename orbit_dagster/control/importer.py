"""`orbit import-run DIR`: register a run trained outside the platform, with its checkpoints.

Layout of DIR:
    run.json              optional: {"name", "experiment", "project", "template", "overrides"}
    metrics.jsonl         optional: one {"step": N, "<metric>": value, ...} per line
    <anything>-<step>/    one directory per checkpoint, holding `state.pt` (a torch state
                          dict with "model" and "step"); or orbit's own checkpoint
                          directories (with manifest.json), verified as they are; or a
                          Hugging Face Trainer's `checkpoint-<step>/` (model.safetensors or
                          pytorch_model.bin, trainer_state.json: control/import_hf.py), whose
                          trainer states' log_history become the run's metrics too.

Everything in DIR is untrusted input, data and never code:
- nothing of DIR is executed: the `template` of run.json must name an installed template
  (shipped, `ORBIT_TEMPLATES` or `$ORBIT_HOME/templates`): a template is code (loading it
  imports its workload's `config.py`), so a template path, or a name not installed, is not
  loaded: the run is registered without a config schema (not evaluated) and the output
  says so;
- names are confined to the store (no `..`, absolute paths, symlinks out, NUL or other
  control characters), and every refusal is one OrbitError naming the file or field;
- every file's size is checked with stat before it is read, then it is read in chunks that
  stop at its allowance: a file in a manifest at its declared size + 1 byte (hashed while
  read), a state at a quarter of this machine's memory (it is loaded whole to check it),
  run.json and manifests at a few MiB, metrics.jsonl line by line;
- every state is loaded with `weights_only=True` and its weights hashed before anything is
  registered; a refused import leaves nothing behind (checkpoints copied so far are
  removed, the ledger is written in one transaction at the end).
The run becomes a job like any other (`imported`), so it appears wherever jobs do; with an
installed `template`, a bundle is frozen for it and its checkpoints are evaluated too.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import re
from datetime import datetime, timezone
from pathlib import Path

from ..core.bounded import check_size, memory_cap, printable_name, read_bounded, read_text_bounded, size_text
from ..core.bundle import JobBundle, build_bundle
from ..core.config_schema import show
from ..core.errors import OrbitError
from ..core.lifecycle import JobState
from ..core.submission import check_name
from ..core.templates import installed_template
from ..ledger import records as R
from ..ledger import utcnow
from ..settings import Settings
from ..storage.base import MANIFEST, CheckpointManifest, StoreError, check_rel, checkpoint_dir_name
from ..storage.reading import Digester
from . import import_hf
from .submit import ensure_experiment
from .validate import validate_submission

STEP_RE = re.compile(r"(\d{1,12})$")
MAX_STATE_BYTES = 64 << 30  # a checkpoint's files together, at most a quarter of this machine's memory
MAX_META_BYTES = 4 << 20  # run.json
MAX_MANIFEST_BYTES = 16 << 20
MAX_METRICS_BYTES = 4 << 30  # metrics.jsonl, at most an eighth of memory (its rows are held until registered)
MAX_METRIC_LINE = 64 << 10
MAX_METRIC_NAME = 200


def checkpoint_cap() -> int:
    """The most a checkpoint's files may hold: each is read into memory (and a state loaded)."""
    return memory_cap(MAX_STATE_BYTES, 0.25)


def _refuse(message: str, *, field: str, value: object = None, fix: str) -> OrbitError:
    return OrbitError(message, field=field, value=value, fix=fix)


def _weights_digest(blob: bytes, where: str) -> tuple[str, int | None]:
    # lazy: torch costs 3 s or more; only a run whose checkpoints hold a state file loads one
    import torch

    from ..runtime.checkpointing import weights_digest  # lazy: imports torch (above)

    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)  # data, never code
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError, KeyError, IndexError,
            RecursionError, OverflowError) as exc:
        raise _refuse(f"{where} is not a weights-only torch state ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
                      field=where, fix="save plain tensors and numbers: torch.save({'model': model.state_dict(), "
                                       "'step': N}, 'state.pt')") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise _refuse(f"{where} holds no 'model' state dict", field=where, fix="save {'model': ..., 'step': N}")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["model"].items()):
        raise _refuse(f"{where}: its 'model' state dict is not names to tensors", field=where,
                      fix="save model.state_dict() as it is: {'model': model.state_dict(), 'step': N}")
    return weights_digest(state["model"]), state.get("step")


def _regular_file(path: Path, root: Path) -> Path:
    if path.is_symlink() or not path.resolve().is_relative_to(root):
        raise _refuse(f"{path.relative_to(root)} is a link; imported files must be regular files inside DIR",
                      field="DIR", value=str(path), fix="copy the files instead of linking them")
    return path


def _read(path: Path, root: Path, cap: int, *, declared: int | None = None, digest=None) -> bytes:
    """A file of DIR, size-checked before it is read and read in bounded chunks."""
    rel = str(path.relative_to(root))
    fix = ("re-export it; a corrupt checkpoint is never imported" if declared is not None else
           f"import files of at most {size_text(cap)} (a quarter of this machine's memory: each is loaded to check it)")
    return read_bounded(_regular_file(path, root), cap, what=rel, field=rel, fix=fix, declared=declared, digest=digest)


def _json(text: str, what: str, fix: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise _refuse(f"{what} is not JSON: {' '.join(str(exc).split())[:160]}", field=what, fix=fix) from None


def _collect(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for d in sorted(p for p in directory.iterdir() if p.is_dir()):
        m = STEP_RE.search(d.name)
        if not m or not ((d / "state.pt").is_file() or (d / MANIFEST).is_file() or import_hf.is_hf_checkpoint(d)):
            continue
        if d.is_symlink():  # a checkpoint that is a link: its files would come from outside DIR
            raise _refuse(f"{d.name} is a link; imported checkpoints must be directories inside DIR", field="DIR",
                          value=str(d), fix="copy the checkpoint directory instead of linking it")
        found.append((int(m.group(1)), d))
    steps = [s for s, _ in found]
    if len(steps) != len(set(steps)):
        raise _refuse("two checkpoint directories name the same step", field="DIR", value=str(directory),
                      fix="keep one directory per step")
    return sorted(found)


def _files_of(d: Path, root: Path, step: int, hf_states: list) -> tuple[dict[str, bytes], str, dict]:
    """The checkpoint's files, its weights digest and its manifest's meta, every name, size and
    byte checked (a Hugging Face checkpoint's trainer state is appended to `hf_states`)."""
    cap = checkpoint_cap()
    meta = {"imported_from": str(d)}
    if (d / MANIFEST).is_file():
        fix = "re-export the checkpoint"
        text = read_text_bounded(_regular_file(d / MANIFEST, root), MAX_MANIFEST_BYTES, what=f"{d.name}/{MANIFEST}",
                                 field=d.name, fix=fix)
        try:
            m = CheckpointManifest.from_json(text)
        except (ValueError, TypeError, KeyError, RecursionError, StoreError) as exc:
            raise _refuse(f"{d.name}/{MANIFEST} is not a checkpoint manifest: {' '.join(str(exc).split())[:160]}",
                          field=d.name, fix=fix) from None
        if not isinstance(m.files, dict):
            raise _refuse(f"{d.name}/{MANIFEST}: 'files' is not a mapping", field=d.name, fix=fix)
        declared, total = {}, 0
        for rel, info in m.files.items():  # every name and size checked before any file is read
            try:
                check_rel(rel, d.name)
            except StoreError as exc:
                raise _refuse(str(exc).split("; fix: ")[0], field=d.name, value=rel, fix=fix) from None
            size = info["bytes"]  # from_json checked every entry: a size, a sha256 or part digests
            total += size
            if total > cap:
                raise _refuse(f"checkpoint {d.name} declares more than {size_text(cap)} of files (a quarter of this "
                              "machine's memory: each is loaded to check it)", field=d.name, value=total,
                              fix="import it on a machine with more memory, or import smaller checkpoints")
            declared[rel] = info
        files = {}
        for rel, info in declared.items():
            digest = Digester(info, m.version, m.part_size)  # either manifest version, part by part
            files[rel] = _read(d / rel, root, cap, declared=info["bytes"], digest=digest)  # hashed while read
            if digest.problem() is not None:
                raise _refuse(f"checkpoint {d.name}: file {rel} does not match its manifest ({digest.problem()})",
                              field=d.name, value=rel, fix="re-export it; a corrupt checkpoint is never imported")
        if "state.pt" not in files:
            raise _refuse(f"checkpoint {d.name} has no state.pt", field=d.name, fix="re-export it")
        weights, _ = _weights_digest(files["state.pt"], f"{d.name}/state.pt")
        if m.weights_sha256 and m.weights_sha256 != weights:
            raise _refuse(f"checkpoint {d.name}: its weights do not match the manifest's weights_sha256", field=d.name,
                          fix="re-export it; the manifest was written for other weights")
        return files, weights, meta
    if not (d / "state.pt").is_file() and import_hf.is_hf_checkpoint(d):
        from ..runtime.checkpointing import weights_digest  # lazy: imports torch (1.5 s or more), for SDK runs only

        files, state_dict, trainer_state = import_hf.hf_files(d, root, step, cap, lambda p, c: _read(p, root, c))
        hf_states.append((d, trainer_state))
        return files, weights_digest(state_dict), {"layout": "dir", "name": d.name, "format": "hf", **meta}
    blob = _read(d / "state.pt", root, cap)
    weights, _ = _weights_digest(blob, f"{d.name}/state.pt")
    return {"state.pt": blob}, weights, meta


def _metric_row(job_id: str, experiment: str, keys: dict[int, str], step: int, name: str, value: float) -> dict:
    return {"job_id": job_id, "experiment": experiment, "run_id": R.run_id_for(job_id, 1),
            "checkpoint_key": keys.get(step), "step": step, "name": name, "value": value, "source": "train",
            "ts": utcnow()}


def _hf_metric_rows(hf_states: list, job_id: str, experiment: str, keys: dict[int, str]) -> list[dict]:
    """The Hugging Face trainer states' log_history as metric rows (control/import_hf.py)."""
    rows = []
    for (step, name), value in sorted(import_hf.log_history_points(hf_states).items()):
        if not name or len(name) > MAX_METRIC_NAME or not printable_name(name):
            raise _refuse(f"trainer_state.json log_history: metric name {show(name)} is not a name (1 to "
                          f"{MAX_METRIC_NAME} printable characters)", field="trainer_state.json", value=name[:120],
                          fix="log metrics under short printable names")
        rows.append(_metric_row(job_id, experiment, keys, step, name, value))
    return rows


def _metric_rows(directory: Path, job_id: str, experiment: str, keys: dict[int, str]) -> list[dict]:
    path = directory / "metrics.jsonl"
    if not path.is_file() and not path.is_symlink():
        return []
    cap = memory_cap(MAX_METRICS_BYTES, 0.125)
    check_size(_regular_file(path, directory), cap, what="metrics.jsonl", field="metrics.jsonl",
               fix=f"keep metrics.jsonl under {size_text(cap)}: fewer points (every Nth step)")
    rows = []
    shape = "one JSON object per line with an integer step, e.g. {\"step\": 10, \"train/loss\": 2.5}"
    with open(path, "rb") as fh:
        for n, raw in enumerate(iter(lambda: fh.readline(MAX_METRIC_LINE + 1), b""), 1):
            if len(raw) > MAX_METRIC_LINE:
                raise _refuse(f"metrics.jsonl line {n} is longer than {MAX_METRIC_LINE} bytes", field="metrics.jsonl",
                              value=n, fix=shape)
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = int(rec.pop("step"))
                values = {k: float(v) for k, v in rec.items()}
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError):
                raise _refuse(f"metrics.jsonl line {n} is not {{\"step\": N, \"name\": number, ...}}",
                              field="metrics.jsonl", value=line[:120], fix=shape) from None
            for k, v in values.items():
                if not k or len(k) > MAX_METRIC_NAME or not printable_name(k):
                    raise _refuse(f"metrics.jsonl line {n}: metric name {show(k)} is not a name (1 to {MAX_METRIC_NAME} "
                                  "printable characters)", field="metrics.jsonl", value=k[:120], fix=shape)
                if not math.isfinite(v):
                    raise _refuse(f"metrics.jsonl line {n}: metric {k} = {v} is not a finite number",
                                  field="metrics.jsonl", value=n, fix=shape)
                rows.append(_metric_row(job_id, experiment, keys, step, k, v))
    return rows


def _meta(directory: Path) -> dict:
    path = directory / "run.json"
    if not path.is_file():
        return {}
    text = read_text_bounded(_regular_file(path, directory), MAX_META_BYTES, what="run.json", field="run.json",
                             fix='run.json is a short JSON object, e.g. {"experiment": "imported"}')
    meta = _json(text, "run.json", "write a JSON object")
    if not isinstance(meta, dict):
        raise _refuse("run.json is not a JSON object", field="run.json", fix='e.g. {"experiment": "imported"}')
    return meta


def _template_of(settings: Settings, meta: dict) -> tuple[str | None, str | None]:
    """(the installed template run.json names, or None; a note when it names one that is not)."""
    ref = meta.get("template")
    if not ref:
        return None, None
    if installed_template(ref, settings.template_dirs):
        return ref, None
    return None, (f"run.json names template {show(ref)}, which is not an installed template (shipped, ORBIT_TEMPLATES "
                  "or $ORBIT_HOME/templates): a template is code and is not taken from the imported directory, so the "
                  "run is registered without a config schema and its checkpoints are not evaluated; to evaluate them, "
                  "install the template and import the run again with another --name")


def import_run(settings: Settings, directory: Path, *, experiment: str | None = None, name: str | None = None,
               progress=None) -> dict:
    if not printable_name(str(directory)):
        raise _refuse(f"DIR {show(str(directory))} holds a NUL or other control character", field="DIR",
                      value=str(directory), fix="give the directory's path as it is written")
    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        raise _refuse(f"{directory} is not a directory", field="DIR", value=str(directory),
                      fix="give the directory that holds the run's checkpoint directories")
    meta = _meta(directory)
    found = _collect(directory)
    if not found:
        raise _refuse(f"no checkpoints found in {directory}", field="DIR", value=str(directory),
                      fix="each checkpoint is a sub-directory named ...-<step> holding state.pt, or a Hugging Face "
                          "Trainer's checkpoint-<step> (model.safetensors or pytorch_model.bin, trainer_state.json)")
    experiment = experiment or str(meta.get("experiment", "imported"))
    project = str(meta.get("project", "default"))
    base = str(name or meta.get("name") or directory.name)
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:8]
    job_id = f"import-{re.sub(r'[^A-Za-z0-9_-]', '-', base)[:40].strip('-') or 'run'}-{digest}"
    template, sub = None, None
    name_of_template, note = _template_of(settings, meta)
    if name_of_template is not None:
        overrides = meta.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise _refuse(f"run.json: overrides is {type(overrides).__name__}, not a mapping", field="overrides",
                          fix='e.g. "overrides": {"config.steps": 8}')
        template, sub = validate_submission(settings, name_of_template, dict(overrides),
                                            experiment=experiment, project=project)
    else:  # the names are checked the same way with or without a template
        validate_names(experiment, project)
    ledger = settings.ledger()
    if R.job(ledger, job_id) is not None:
        raise _refuse(f"{directory} was already imported as {job_id}", field="DIR", value=str(directory),
                      fix=f"see it with `orbit status {job_id}`")
    store = settings.open_store(settings.store_uri)
    written: list[str] = []
    lineage = f"L1-import-{digest}"
    try:
        hf_states: list = []
        rows = _copy_checkpoints(store, found, job_id, experiment, lineage, directory, written, progress, hf_states)
        keys = {r["step"]: r["checkpoint_key"] for r in rows}
        own = _metric_rows(directory, job_id, experiment, keys)
        seen = {(m["step"], m["name"]) for m in own}  # metrics.jsonl wins over the trainer states' log_history
        metric_rows = [m for m in _hf_metric_rows(hf_states, job_id, experiment, keys)
                       if (m["step"], m["name"]) not in seen] + own
        for r in rows:  # the training loss at a checkpoint's step, if recorded
            r["train_loss"] = next((m["value"] for m in metric_rows
                                    if m["checkpoint_key"] == r["checkpoint_key"] and m["name"] == "train/loss"), None)
        bundle = build_bundle(template, sub, job_id, settings.bundles_dir, max_bytes=settings.bundle_max_bytes) if template else None
        _register(ledger, job_id, experiment, project, lineage, template, bundle, rows, metric_rows, directory)
    except BaseException:
        for uri in written:  # a refused import leaves nothing behind
            try:
                store.delete(uri)
            except StoreError:
                pass
        raise
    result = {"job_id": job_id, "experiment": experiment, "checkpoints": [r["checkpoint_key"] for r in rows],
              "evaluable": template is not None}
    if note:
        result["note"] = note
    return result


def validate_names(experiment: str, project: str) -> None:
    check_name("experiment", experiment)
    check_name("project", project)


def _copy_checkpoints(store, found, job_id, experiment, lineage, directory, written, progress, hf_states) -> list[dict]:
    rows: list[dict] = []
    parent_uri, parent_key = None, None
    for step, d in (progress(found) if progress else found):
        files, weights, meta = _files_of(d, directory, step, hf_states)
        manifest = CheckpointManifest(  # its files described by the store as it writes them
            job_id=job_id, step=step, tier="durable", files={}, format="files" if meta.get("format") else "torch",
            weights_sha256=weights, parent=parent_uri, created_at=datetime.now(timezone.utc).isoformat(), attempt=1,
            meta=meta)
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

