"""Submit a template as a job, retry a job as a new attempt, cancel it.

Everything is validated and the bundle is built before the ledger is touched; the ledger
rows of a new job are then written in one atomic commit. A rejected submission leaves no
trace.
"""
from __future__ import annotations

import uuid
from typing import Any

from ..core.bundle import JobBundle, build_bundle
from ..core.errors import OrbitError
from ..core.lifecycle import TERMINAL, JobState
from ..core.submission import TaskSubmission, apply_overrides
from ..core.templates import TaskTemplate
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from .settings import Settings
from .validate import validate_retry, validate_submission


def _bundle_row(bundle: JobBundle, attempt: int) -> dict:
    return {
        "bundle_hash": bundle.bundle_hash,
        "job_id": bundle.job_id,
        "attempt": attempt,
        "path": str(bundle.path),
        "template_id": bundle.spec.template.template_id,
        "provenance": R.dumps(bundle.spec.provenance),
        "created_at": utcnow(),
    }


def _experiment_rows(ledger: Ledger, sub: TaskSubmission, template: TaskTemplate) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    now = utcnow()
    if not ledger.scalar("SELECT count(*) FROM projects WHERE project = ?", [sub.project]):
        rows["projects"] = [{"project": sub.project, "primary_metric": None, "primary_mode": None, "created_at": now}]
    known = ledger.rows("SELECT project FROM experiments WHERE experiment = ?", [sub.experiment])
    if known and known[0]["project"] != sub.project:
        raise OrbitError(
            f"experiment {sub.experiment!r} belongs to project {known[0]['project']!r}, not {sub.project!r}",
            field="experiment",
            value=sub.experiment,
            fix="choose another experiment name or the experiment's own project",
        )
    if not known:
        pm = template.primary_metric
        rows["experiments"] = [
            {
                "experiment": sub.experiment,
                "project": sub.project,
                # The template's primary metric becomes the experiment's, so the ranking of an
                # experiment never changes under it when later jobs use other templates.
                "primary_metric": pm.name if pm else None,
                "primary_mode": pm.mode if pm else None,
                "created_at": now,
            }
        ]
    return rows


def submit(
    settings: Settings,
    template_name: str,
    overrides: dict[str, Any] | None = None,
    *,
    experiment: str = "default",
    project: str = "default",
) -> str:
    """Create a job (CREATED then QUEUED) and return its id."""
    # Raises before anything is written (the ledger is not even opened).
    template, sub = validate_submission(settings, template_name, overrides, experiment=experiment, project=project)
    overrides = dict(sub.overrides)
    ledger = settings.ledger()
    job_id = f"{template.name}-{uuid.uuid4().hex[:8]}"
    rows = _experiment_rows(ledger, sub, template)
    bundle = build_bundle(template, sub, job_id, settings.bundles_dir)
    now = utcnow()
    rows["jobs"] = [
        {
            "job_id": job_id,
            "template": template.name,
            "template_version": template.version,
            "kind": template.kind,
            "experiment": experiment,
            "project": project,
            "placement": template.placement,
            "max_interruptions": template.max_interruptions,
            "created_at": now,
        }
    ]
    rows["bundles"] = [_bundle_row(bundle, 1)]
    rows["job_states"] = [
        R.state_row(job_id, 1, JobState.CREATED, reason="submitted"),
        R.state_row(job_id, 1, JobState.QUEUED, reason="submitted", detail={"resume": "latest"}),
    ]
    rows["events"] = [R.event("submitted", job_id=job_id, template=template.template_id, overrides=overrides,
                              bundle=bundle.bundle_hash)]
    ledger.commit(rows)
    return job_id


def requeue(
    settings: Settings,
    job_id: str,
    *,
    overrides: dict[str, Any] | None = None,
    reason: str,
    from_scratch: bool = False,
    failure_class: str | None = None,
    expect_attempt: int | None = None,
) -> int:
    """Queue attempt n+1 of a job (same job id); a config change goes through the whitelist."""
    ledger = settings.ledger()
    row = R.require_job(ledger, job_id)
    attempt = int(row["attempt"])
    if expect_attempt is not None and attempt != expect_attempt:
        return attempt  # someone already queued the next attempt: never twice
    prev = R.bundle_for(ledger, job_id, attempt)
    extra: dict[str, list[dict]] = {}
    if overrides:
        old = JobBundle.load(prev["path"])
        # Applied to the frozen snapshot, not to today's template file: the job stays the job
        # it was, changed only through its own whitelist.
        template = apply_overrides(old.spec.template, overrides)
        sub = old.spec.submission.model_copy(update={"overrides": {**old.spec.submission.overrides, **overrides}})
        bundle = build_bundle(template, sub, job_id, settings.bundles_dir)
        extra["bundles"] = [_bundle_row(bundle, attempt + 1)]
    extra["events"] = [R.event("requeued", job_id=job_id, attempt=attempt + 1, reason=reason, overrides=overrides or {})]
    R.transition(
        ledger,
        job_id,
        JobState.QUEUED,
        attempt=attempt + 1,
        reason=reason,
        failure_class=failure_class,
        detail={"resume": "scratch" if from_scratch else "latest", "overrides": overrides or {}},
        extra=extra,
    )
    return attempt + 1


def retry(settings: Settings, job_id: str, overrides: dict[str, Any] | None = None, *, from_scratch: bool = False) -> int:
    """A person's retry: only from a finished attempt (SUCCEEDED, FAILED, CANCELLED)."""
    ledger = settings.ledger()
    row = R.require_job(ledger, job_id)
    if JobState(row["state"]) not in TERMINAL:
        raise OrbitError(
            f"job {job_id} is {row['state']} (attempt {row['attempt']}); only a finished job can be retried",
            field="job",
            value=job_id,
            fix="wait for it to finish, or cancel it first with `orbit cancel`",
        )
    snapshot = JobBundle.load(R.bundle_for(ledger, job_id, int(row["attempt"]))["path"]).spec.template
    validate_retry(settings, snapshot, overrides)  # raises before anything is written
    return requeue(settings, job_id, overrides=overrides, reason="retry requested", from_scratch=from_scratch)


def cancel(settings: Settings, job_id: str) -> None:
    ledger = settings.ledger()
    row = R.require_job(ledger, job_id)
    R.transition(ledger, job_id, JobState.CANCELLED, attempt=int(row["attempt"]), reason="cancelled by a person")
