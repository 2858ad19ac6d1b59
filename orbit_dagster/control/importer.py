"""`orbit import-run DIR`: register a run trained outside the platform, with its checkpoints.

Layout of DIR:
    run.json              optional: {"name", "experiment", "project", "template"}
    metrics.jsonl         optional: one {"step": N, "<metric>": value, ...} per line
    <anything>-<step>/    one directory per checkpoint, holding `state.pt` (a torch state
                          dict with "model" and "step"); or orbit's own checkpoint
                          directories (with manifest.json), which are verified as they are.
Every checkpoint is verified (or hashed) and copied into the checkpoint store, so it
becomes a checkpoint like any other: a partition of the `checkpoint` asset. With a
`template`, a bundle is frozen for the run and its checkpoints are evaluated too.
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from pathlib import Path

from ..core.bundle import build_bundle
from ..core.errors import OrbitError
from ..core.submission import TaskSubmission, apply_overrides
from ..core.templates import load_template
from ..ledger import utcnow
from ..ledger import records as R
from ..storage import open_store
from ..storage.base import MANIFEST, CheckpointManifest, StoreError, checkpoint_dir_name, sha256_bytes
from .settings import Settings

STEP_RE = re.compile(r"(\d+)$")


def _step_of(d: Path) -> int | None:
    m = STEP_RE.search(d.name)
    return int(m.group(1)) if m else None


def _weights_digest(blob: bytes) -> tuple[str, int | None]:
    import io

    import torch

    from ..runtime.checkpointing import weights_digest

    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)  # data, never code
    if not isinstance(state, dict) or "model" not in state:
        raise OrbitError("state.pt holds no 'model' state dict", field="state.pt", fix="save {'model': ..., 'step': N}")
    return weights_digest(state["model"]), state.get("step")


def _collect(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for d in sorted(p for p in directory.iterdir() if p.is_dir()):
        step = _step_of(d)
        if step is not None and ((d / "state.pt").is_file() or (d / MANIFEST).is_file()):
            found.append((step, d))
    return sorted(found)


def import_run(settings: Settings, directory: Path, *, experiment: str | None = None, name: str | None = None,
               progress=None) -> dict:
    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        raise OrbitError(f"{directory} is not a directory", field="DIR", value=str(directory),
                         fix="give the directory that holds the run's checkpoint directories")
    meta = json.loads((directory / "run.json").read_text()) if (directory / "run.json").is_file() else {}
    found = _collect(directory)
    if not found:
        raise OrbitError(f"no checkpoints found in {directory}", field="DIR", value=str(directory),
                         fix="each checkpoint is a sub-directory named ...-<step> holding state.pt")
    experiment = experiment or meta.get("experiment", "imported")
    project = meta.get("project", "default")
    base = name or meta.get("name") or directory.name
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:8]
    job_id = f"import-{re.sub(r'[^A-Za-z0-9_-]', '-', base)[:40]}-{digest}"
    ledger = settings.ledger()
    if ledger.scalar("SELECT count(*) FROM runs WHERE job_id = ?", [job_id]):
        raise OrbitError(f"{directory} was already imported as {job_id}", field="DIR", value=str(directory),
                         fix=f"see it with `orbit status {job_id}`")
    store = open_store(settings.store_uri)
    rows: list[dict] = []
    parent_uri, parent_key = None, None
    for step, d in (progress(found) if progress else found):
        if (d / MANIFEST).is_file():
            src = open_store(d.parent.as_uri())
            try:
                m = src.verify(d.as_uri())
            except StoreError as exc:
                raise OrbitError(f"checkpoint {d.name} is corrupt: {exc}", field=d.name, fix="re-export it") from None
            files = {rel: (d / rel).read_bytes() for rel in m.files}
            weights = m.weights_sha256
        else:
            blob = (d / "state.pt").read_bytes()
            weights, _ = _weights_digest(blob)
            files = {"state.pt": blob}
        manifest = CheckpointManifest(
            job_id=job_id, step=step, tier="durable",
            files={rel: {"sha256": sha256_bytes(b), "bytes": len(b)} for rel, b in files.items()},
            weights_sha256=weights, parent=parent_uri, created_at=datetime.now(timezone.utc).isoformat(), attempt=1,
            meta={"imported_from": str(d)},
        )
        uri = store.put(job_id, checkpoint_dir_name(step), files, manifest)
        rows.append({
            "checkpoint_key": R.checkpoint_key(job_id, step), "job_id": job_id, "run_id": R.run_id_for(job_id, 1),
            "attempt": 1, "step": step, "tier": "durable", "parent_key": parent_key,
            "uri": uri, "sha256": manifest.digest, "bytes": manifest.total_bytes, "weights_sha256": weights,
            "train_loss": None, "created_at": utcnow(), "registered_at": utcnow(),
        })
        parent_uri, parent_key = uri, rows[-1]["checkpoint_key"]
    metric_rows = []
    if (directory / "metrics.jsonl").is_file():
        by_step = {s: R.checkpoint_key(job_id, s) for s, _ in found}
        for line in (directory / "metrics.jsonl").read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            step = int(rec.pop("step"))
            for k, v in rec.items():
                metric_rows.append({"job_id": job_id, "run_id": R.run_id_for(job_id, 1), "checkpoint_key": by_step.get(step),
                                    "step": step, "name": k, "value": float(v), "source": "train", "ts": utcnow()})
        for r in rows:  # the training loss at a checkpoint's step, if recorded
            r["train_loss"] = next((m["value"] for m in metric_rows
                                    if m["checkpoint_key"] == r["checkpoint_key"] and m["name"] == "train/loss"), None)
    batch: dict[str, list[dict]] = {
        "runs": [{"run_id": R.run_id_for(job_id, 1), "job_id": job_id, "attempt": 1, "bundle_hash": None,
                  "dagster_run_id": None, "instance_id": None, "provider": "external", "offer_id": None,
                  "resume_from": None, "handle": None, "imported": True, "experiment": experiment,
                  "project": project, "started_at": utcnow()}],
        "run_states": [{"run_id": R.run_id_for(job_id, 1), "state": "SUCCEEDED", "exit_code": 0, "failure_class": None,
                        "reason": f"imported from {directory}", "ts": utcnow()}],
        "checkpoints": rows,
        "metric_points": metric_rows,
        "events": [R.event("imported", job_id=job_id, source=str(directory), checkpoints=len(rows))],
    }
    if not ledger.scalar("SELECT count(*) FROM experiments WHERE experiment = ?", [experiment]):
        batch["experiments"] = [{"experiment": experiment, "project": project, "primary_metric": None,
                                 "primary_mode": None, "created_at": utcnow()}]
    if not ledger.scalar("SELECT count(*) FROM projects WHERE project = ?", [project]):
        batch["projects"] = [{"project": project, "primary_metric": None, "primary_mode": None, "created_at": utcnow()}]
    if meta.get("template"):
        overrides = dict(meta.get("overrides") or {})
        template = apply_overrides(load_template(meta["template"]), overrides)
        sub = TaskSubmission(template=meta["template"], overrides=overrides, experiment=experiment, project=project)
        bundle = build_bundle(template, sub, job_id, settings.bundles_dir)
        batch["bundles"] = [{"bundle_hash": bundle.bundle_hash, "job_id": job_id, "attempt": 1, "path": str(bundle.path),
                             "template_id": template.template_id, "provenance": R.dumps(bundle.spec.provenance),
                             "created_at": utcnow()}]
    ledger.commit(batch)
    return {"job_id": job_id, "experiment": experiment, "checkpoints": [r["checkpoint_key"] for r in rows],
            "evaluable": bool(meta.get("template"))}
