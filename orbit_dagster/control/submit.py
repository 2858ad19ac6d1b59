"""Submit a template as a job, retry a job as a new attempt, cancel it.

Everything is validated and the bundle is built before the ledger is touched; the ledger
rows of a new job are then written in one transaction. A rejected submission leaves no
trace (a bundle directory is content-addressed and only ever added, so one built for a
submission the ledger then refused is harmless and reused by the next identical one).
"""
from __future__ import annotations

import uuid
from typing import Any

from ..core.bundle import JobBundle, build_bundle
from ..core.errors import OrbitError
from ..core.lifecycle import TERMINAL, JobState
from ..core.templates import TaskTemplate
from ..ledger import records as R
from ..ledger import utcnow
from ..ledger.store import Tx
from ..providers.base import RunHandle
from ..settings import Settings
from .billing import stop_cancelled
from .context import bundle_and_provider
from .lineage import next_lineage
from .validate import validate_retry, validate_submission


def _bundle_row(bundle: JobBundle, attempt: int) -> dict:
    return {"bundle_hash": bundle.bundle_hash, "job_id": bundle.job_id, "attempt": attempt, "path": str(bundle.path),
            "template_id": bundle.spec.template.template_id, "provenance": R.dumps(bundle.spec.provenance),
            "created_at": utcnow()}


def ensure_experiment(tx: Tx, experiment: str, project: str, template: TaskTemplate | None) -> None:
    """The experiment (and its project) exist; an experiment belongs to one project."""
    now = utcnow()
    tx.insert("projects", [{"project": project, "created_at": now, "updated_at": now}])
    known = tx.one("SELECT project FROM experiments WHERE experiment = ?", [experiment])
    if known and known["project"] != project:
        raise OrbitError(f"experiment {experiment!r} belongs to project {known['project']!r}, not {project!r}",
                         field="experiment", value=experiment,
                         fix="choose another experiment name or the experiment's own project")
    if not known:
        pm = template.primary_metric if template else None
        # The first template's metric is the experiment's fallback; a person's choice for the
        # experiment or its project (`orbit metric set`) comes first.
        tx.insert("experiments", [{"experiment": experiment, "project": project, "template_metric": pm.name if pm else None,
                                   "template_mode": pm.mode if pm else None, "created_at": now, "updated_at": now}])


def submit(settings: Settings, template_name: str, overrides: dict[str, Any] | None = None, *,
           experiment: str = "default", project: str = "default") -> str:
    """Create a job (CREATED then QUEUED) and return its id."""
    # Raises before anything is written (the ledger is not even opened).
    template, sub = validate_submission(settings, template_name, overrides, experiment=experiment, project=project)
    overrides = dict(sub.overrides)
    job_id = f"{template.name}-{uuid.uuid4().hex[:8]}"
    # The ledger before the bundle: a damaged or lost ledger is refused before anything is
    # written, and a new home's ledger exists before its first bundle (identity.py).
    ledger = settings.ledger()
    bundle = build_bundle(template, sub, job_id, settings.bundles_dir, max_bytes=settings.bundle_max_bytes)
    lineage = next_lineage(None, template, 1, from_scratch=True)
    job_row = {"job_id": job_id, "template": template.name, "template_version": template.version,
               "kind": template.kind, "experiment": experiment, "project": project, "placement": template.placement,
               "max_interruptions": template.max_interruptions, "imported": 0, "created_at": utcnow(),
               "lineage": lineage}
    with ledger.write() as tx:
        ensure_experiment(tx, experiment, project, template)
        R.insert_job(tx, job_row, [R.state_row(job_id, 1, JobState.CREATED, reason="submitted"),
                                   R.state_row(job_id, 1, JobState.QUEUED, reason="submitted",
                                               detail={"resume": "latest"})])
        tx.insert("bundles", [_bundle_row(bundle, 1)])
        tx.insert("events", [R.event("submitted", job_id=job_id, template=template.template_id, overrides=overrides,
                                     bundle=bundle.bundle_hash, lineage=lineage)])
    return job_id


def requeue(settings: Settings, job_id: str, *, overrides: dict[str, Any] | None = None, reason: str,
            from_scratch: bool = False, failure_class: str | None = None, expect_attempt: int | None = None) -> int:
    """Queue attempt n+1 of a job (same job id); a config change goes through the whitelist.

    The new attempt continues the job's lineage (resumes from its newest checkpoint) unless
    it starts from scratch or its config changes what is trained: then it starts a new one."""
    ledger = settings.ledger()
    row = R.require_job(ledger, job_id)
    attempt = int(row["attempt"])
    if expect_attempt is not None and attempt != expect_attempt:
        return attempt  # someone already queued the next attempt: never twice
    prev = R.bundle_for(ledger, job_id, attempt)
    old = JobBundle.load(prev["path"], verify=False)
    template = old.spec.template
    extra: dict[str, list[dict]] = {}
    if overrides:
        # Applied to the frozen snapshot, not to today's template file: the job stays the job
        # it was, changed only through its own whitelist.
        template = validate_retry(settings, old.spec.template, overrides)
        sub = old.spec.submission.model_copy(update={"overrides": {**old.spec.submission.overrides, **overrides}})
        bundle = build_bundle(template, sub, job_id, settings.bundles_dir, max_bytes=settings.bundle_max_bytes)
        extra["bundles"] = [_bundle_row(bundle, attempt + 1)]
    lineage = next_lineage(row["lineage"], template, attempt + 1, from_scratch=from_scratch)
    extra["events"] = [R.event("requeued", job_id=job_id, attempt=attempt + 1, reason=reason, overrides=overrides or {},
                               lineage=lineage, new_lineage=lineage != row["lineage"])]
    R.transition(ledger, job_id, JobState.QUEUED, attempt=attempt + 1, reason=reason, failure_class=failure_class,
                 detail={"resume": "scratch" if lineage != row["lineage"] else "latest", "overrides": overrides or {}},
                 extra=extra, lineage=lineage)
    return attempt + 1


def retry(settings: Settings, job_id: str, overrides: dict[str, Any] | None = None, *, from_scratch: bool = False) -> int:
    """A person's retry: only from a finished attempt (SUCCEEDED, FAILED, CANCELLED)."""
    row = R.require_job(settings.ledger(), job_id)
    if row["imported"]:
        raise OrbitError(f"job {job_id} was imported, not trained here; it has nothing to retry", field="job",
                         value=job_id, fix="submit a template to train it here")
    if JobState(row["state"]) not in TERMINAL:
        raise OrbitError(f"job {job_id} is {row['state']} (attempt {row['attempt']}); only a finished job can be retried",
                         field="job", value=job_id, fix="wait for it to finish, or cancel it first with `orbit cancel`")
    snapshot = JobBundle.load(R.bundle_for(settings.ledger(), job_id, int(row["attempt"]))["path"]).spec.template
    validate_retry(settings, snapshot, overrides)  # raises before anything is written
    return requeue(settings, job_id, overrides=overrides, reason="retry requested", from_scratch=from_scratch)


def cancel(settings: Settings, job_id: str, *, reason: str = "cancelled by a person") -> bool:
    """Cancel the job's current attempt and stop what it rents now: the workload is stopped, the
    instance released and billed to the second. False if the job had already ended."""
    ledger = settings.ledger()
    row = R.require_job(ledger, job_id)
    attempt = int(row["attempt"])
    if JobState(row["state"]) in TERMINAL:
        return False
    changed = R.transition(ledger, job_id, JobState.CANCELLED, attempt=attempt, reason=reason)
    run = R.run(ledger, R.run_id_for(job_id, attempt))
    if run is not None and run["state"] == "RUNNING" and run["handle"]:
        _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
        stop_cancelled(settings, ledger, provider, RunHandle.model_validate_json(run["handle"]), job_id=job_id,
                       attempt=attempt, run_id=run["run_id"])
    return changed
