"""JobBundle: the frozen, content-hashed contract a host runs.

Layout:  job.json  inputs/  scripts/  runtime/  artifacts/  manifest.json
`scripts/` is the workload directory as a tree (core/packaging.py), `inputs/` the files the
template's `inputs` list.
`manifest.json` lists the sha256 of every file outside `artifacts/` (the host's outputs);
the bundle hash is the digest of that listing, so it names exactly the code, data and config
that run. A bundle directory is built under a temporary name and renamed into place, so a
half-built bundle is never visible.
"""
from __future__ import annotations

import json
import shutil
import uuid
from datetime import datetime, timezone
from importlib import resources as importlib_resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from . import provenance
from .errors import BundleIntegrityError, TemplateError
from .execution import ExecutionRequest
from .hashing import canonical_json, digest_of_listing, sha256_file
from .packaging import DEFAULT_MAX_BYTES, copy_tree
from .submission import TaskSubmission, execution_request_for
from .templates import TaskTemplate
from .workload import workload_dir

SCHEMA_VERSION = 1
HASHED_DIRS = ("inputs", "scripts", "runtime")
# The runtime agent and the checkpoint store code travel inside the bundle, so a host needs
# only Python and torch: it never imports the control plane. Of core/, only the host
# contract (the event records the agent writes; stdlib only) and core's import-free
# __init__ travel with them.
# `integrations` too: a command workload's script imports its helpers (env, framework
# callbacks) on the host, through the PYTHONPATH the agent sets.
RUNTIME_PACKAGES = ("runtime", "storage", "integrations")
RUNTIME_CORE_FILES = ("__init__.py", "errors.py", "host_contract.py", "interval.py", "placeholders.py",
                      "process_tree.py")


class JobSpec(BaseModel):
    """The content of job.json."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    job_id: str
    kind: str
    template_snapshot: dict[str, Any]
    execution_request: ExecutionRequest
    submission: TaskSubmission
    provenance: dict[str, Any]
    created_at: str

    @property
    def template(self) -> TaskTemplate:
        return TaskTemplate.model_validate(self.template_snapshot)


class JobBundle(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: Path
    bundle_hash: str
    spec: JobSpec

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @classmethod
    def load(cls, path: Path | str, *, verify: bool = True) -> "JobBundle":
        path = Path(path)
        manifest_path = path / "manifest.json"
        if not manifest_path.is_file():
            raise BundleIntegrityError(f"{path} is not a bundle: manifest.json is missing", fix="build it with orbit submit")
        manifest = json.loads(manifest_path.read_text())
        if verify:
            verify_bundle(path, manifest)
        spec = JobSpec.model_validate_json((path / "job.json").read_text())
        return cls(path=path, bundle_hash=manifest["bundle_sha256"], spec=spec)


def _listing(root: Path) -> dict[str, str]:
    files = {"job.json": sha256_file(root / "job.json")}
    for top in HASHED_DIRS:
        for f in sorted((root / top).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                files[str(f.relative_to(root))] = sha256_file(f)
    return files


def verify_bundle(path: Path, manifest: dict | None = None) -> str:
    manifest = manifest or json.loads((path / "manifest.json").read_text())
    actual = _listing(path)
    expected = manifest["files"]
    if actual != expected:
        changed = sorted(set(actual) ^ set(expected) | {k for k in actual if expected.get(k) not in (None, actual[k])})
        raise BundleIntegrityError(
            f"bundle {path.name} does not match its manifest: {', '.join(changed[:5])}",
            fix="bundles are immutable; submit again or retry to build a new one",
        )
    digest = digest_of_listing(actual)
    if digest != manifest["bundle_sha256"]:
        raise BundleIntegrityError(f"bundle {path.name}: hash mismatch", fix="rebuild the bundle")
    return digest


def _copy_runtime(dest: Path) -> None:
    pkg_root = Path(str(importlib_resources.files("orbit_dagster")))
    (dest / "orbit_dagster").mkdir(parents=True)
    (dest / "orbit_dagster" / "__init__.py").write_text('"""Host-side copy: runtime, storage, integrations and the host contract only."""\n')
    for name in RUNTIME_PACKAGES:
        shutil.copytree(pkg_root / name, dest / "orbit_dagster" / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / "orbit_dagster" / "core").mkdir()
    for name in RUNTIME_CORE_FILES:
        shutil.copy2(pkg_root / "core" / name, dest / "orbit_dagster" / "core" / name)


def build_bundle(
    template: TaskTemplate,
    submission: TaskSubmission,
    job_id: str,
    bundles_root: Path,
    *,
    execution_request: ExecutionRequest | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> JobBundle:
    """Freeze a template (overrides already applied) into a bundle under `bundles_root/<hash>`:
    the workload directory as a tree in `scripts/` (core/packaging.py; at most `max_bytes`),
    the files its `inputs` list in `inputs/`."""
    src = workload_dir(template.workload)
    # A command names its own files (any argv); an SDK template's scripts must be there.
    entry_files = [template.entrypoint] + ([template.eval.entrypoint] if template.eval else [])
    for name in filter(None, entry_files):
        if not (src / name).is_file():
            raise TemplateError(f"workload {template.workload!r} has no script {name!r}", field="entrypoint", value=name)
    bundles_root = Path(bundles_root)
    bundles_root.mkdir(parents=True, exist_ok=True)
    tmp = bundles_root / f".tmp-{uuid.uuid4().hex}"
    try:
        (tmp / "artifacts").mkdir(parents=True)
        (tmp / "inputs").mkdir()
        for name in template.inputs:
            if not (src / name).is_file():
                raise TemplateError(f"workload input {name!r} not found in {src.name}", field="inputs", value=name)
            shutil.copy2(src / name, tmp / "inputs" / name)
        (tmp / "scripts").mkdir()
        copy_tree(src, tmp / "scripts", exclude=set(template.inputs), max_bytes=max_bytes)
        _copy_runtime(tmp / "runtime")
        spec = JobSpec(
            job_id=job_id,
            kind=template.kind,
            template_snapshot=template.model_dump(mode="json"),
            execution_request=execution_request or execution_request_for(template),
            submission=submission,
            provenance=provenance.collect(src),
            created_at=datetime.now(timezone.utc).isoformat(),
        )
        (tmp / "job.json").write_text(json.dumps(json.loads(spec.model_dump_json()), indent=2, sort_keys=True) + "\n")
        files = _listing(tmp)
        digest = digest_of_listing(files)
        (tmp / "manifest.json").write_text(canonical_json({"bundle_sha256": digest, "files": files}) + "\n")
        final = bundles_root / digest
        if final.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return JobBundle(path=final, bundle_hash=digest, spec=spec)
