"""Domain-level reads and writes on the ledger: jobs, states, runs, checkpoints, events."""
from __future__ import annotations

import json
import uuid
from typing import Any

from ..core.errors import NotFound
from ..core.lifecycle import JobState, check_transition
from .store import Ledger, utcnow


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def job(ledger: Ledger, job_id: str) -> dict | None:
    rows = ledger.rows("SELECT * EXCLUDE (_commit) FROM job_status WHERE job_id = ?", [job_id])
    return rows[0] if rows else None


def require_job(ledger: Ledger, job_id: str) -> dict:
    row = job(ledger, job_id)
    if row is None:
        raise NotFound(f"no job {job_id!r} in the ledger", field="job", value=job_id, fix="list jobs with `orbit status`")
    return row


def state_row(job_id: str, attempt: int, state: JobState | str, *, reason: str = "", failure_class: str | None = None,
              detail: dict | None = None) -> dict:
    return {
        "job_id": job_id,
        "attempt": attempt,
        "state": JobState(state).value,
        "reason": reason,
        "failure_class": failure_class,
        "detail": dumps(detail or {}),
        "ts": utcnow(),
    }


def transition(
    ledger: Ledger,
    job_id: str,
    new: JobState,
    *,
    attempt: int,
    reason: str = "",
    failure_class: str | None = None,
    detail: dict | None = None,
    extra: dict[str, list[dict]] | None = None,
) -> bool:
    """Move a job to `new` (checked against the lifecycle table), atomically with `extra` rows.

    Returns False, writing nothing, when the job is already in `new` for this attempt (every
    writer may retry a transition after a crash without making a second one), or when the
    job has moved on to a later attempt (a writer about an older attempt never moves it).
    """
    current = job(ledger, job_id)
    if current is not None:
        if int(current["attempt"]) > attempt:
            return False
        if current["state"] == JobState(new).value and int(current["attempt"]) == attempt:
            return False
    check_transition(JobState(current["state"]) if current else None, new, job_id=job_id)
    rows = {"job_states": [state_row(job_id, attempt, new, reason=reason, failure_class=failure_class, detail=detail)]}
    for table, batch in (extra or {}).items():
        rows.setdefault(table, []).extend(batch)
    ledger.commit(rows)
    return True


def event(kind: str, *, job_id: str | None = None, run_id: str | None = None, instance_id: str | None = None,
          **detail: Any) -> dict:
    return {
        "event_id": uuid.uuid4().hex,
        "ts": utcnow(),
        "kind": kind,
        "job_id": job_id,
        "run_id": run_id,
        "instance_id": instance_id,
        "detail": dumps(detail),
    }


def run(ledger: Ledger, run_id: str) -> dict | None:
    rows = ledger.rows("SELECT * EXCLUDE (_commit) FROM run_status WHERE run_id = ?", [run_id])
    return rows[0] if rows else None


def run_id_for(job_id: str, attempt: int) -> str:
    return f"{job_id}#{attempt}"


def bundle_for(ledger: Ledger, job_id: str, attempt: int) -> dict:
    rows = ledger.rows(
        "SELECT * EXCLUDE (_commit) FROM bundles WHERE job_id = ? AND attempt <= ? ORDER BY attempt DESC, created_at DESC LIMIT 1",
        [job_id, attempt],
    )
    if not rows:
        raise NotFound(f"job {job_id} has no bundle for attempt {attempt}", field="job", value=job_id)
    return rows[0]


def checkpoints(ledger: Ledger, job_id: str, *, live_only: bool = True) -> list[dict]:
    view = "live_checkpoints" if live_only else "checkpoints"
    return ledger.rows(f"SELECT * EXCLUDE (_commit) FROM {view} WHERE job_id = ? ORDER BY step", [job_id])


def checkpoint_key(job_id: str, step: int) -> str:
    return f"{job_id}/{step}"


def interruptions(ledger: Ledger, job_id: str) -> int:
    """Losses that count against `max_interruptions`: not the moves orbit chose to make."""
    return int(ledger.scalar(
        "SELECT count(*) FROM job_states WHERE job_id = ? AND state = 'LOST' AND coalesce(failure_class, '') <> 'migration'",
        [job_id]) or 0)
