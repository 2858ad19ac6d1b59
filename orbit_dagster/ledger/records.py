"""Domain-level reads and writes on the ledger: jobs, states, runs, checkpoints, events."""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable

from ..core.errors import NotFound
from ..core.lifecycle import JobState, check_transition
from .store import Ledger, Tx, utcnow


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def job(ledger: Ledger | Tx, job_id: str) -> dict | None:
    return ledger.one("SELECT * FROM jobs WHERE job_id = ?", [job_id])


def require_job(ledger: Ledger | Tx, job_id: str) -> dict:
    row = job(ledger, job_id)
    if row is None:
        raise NotFound(f"no job {job_id!r} in the ledger", field="job", value=job_id, fix="list jobs with `orbit status`")
    return row


def state_row(job_id: str, attempt: int, state: JobState | str, *, reason: str = "", failure_class: str | None = None,
              detail: dict | None = None) -> dict:
    return {"job_id": job_id, "attempt": attempt, "state": JobState(state).value, "reason": reason,
            "failure_class": failure_class, "detail": dumps(detail or {}), "ts": utcnow()}


def insert_job(tx: Tx, job_row: dict, states: list[dict]) -> None:
    """A new job and its first states, the last of which is its current state."""
    last = states[-1]
    tx.insert("jobs", [{**job_row, "state": last["state"], "attempt": last["attempt"], "reason": last["reason"],
                        "failure_class": last["failure_class"], "detail": last["detail"], "state_at": last["ts"]}])
    tx.insert("job_states", states)


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
    lineage: str | None = None,
    deadline_at: float | None = None,
    only_from: set[JobState] | None = None,
    then: Callable[[Tx], None] | None = None,
) -> bool:
    """Move a job to `new` (checked against the lifecycle table), atomically with `extra` rows.

    Returns False, writing nothing, when the job is already in `new` for this attempt (a
    writer may retry a transition after a crash without making a second one), when it has
    moved on to a later attempt (a writer about an older attempt never moves it), or when
    `only_from` is given and the job is in none of those states (a compare-and-set: of two
    processes racing for one move, exactly one makes it). `then(tx)` makes further changes
    in the same transaction (e.g. the run's state), only when the move is made.
    """
    new = JobState(new)
    with ledger.write() as tx:
        current = tx.one("SELECT state, attempt, lineage FROM jobs WHERE job_id = ?" + tx.for_update, [job_id])
        if current is None:
            raise NotFound(f"no job {job_id!r} in the ledger", field="job", value=job_id,
                           fix="list jobs with `orbit status`")
        if int(current["attempt"]) > attempt:
            return False
        if current["state"] == new.value and int(current["attempt"]) == attempt:
            return False
        if only_from is not None and JobState(current["state"]) not in only_from:
            return False
        check_transition(JobState(current["state"]), new, job_id=job_id)
        row = state_row(job_id, attempt, new, reason=reason, failure_class=failure_class, detail=detail)
        tx.execute(
            """UPDATE jobs SET state = ?, attempt = ?, reason = ?, failure_class = ?, detail = ?, state_at = ?,
                   lineage = ?, deadline_at = ? WHERE job_id = ?""",
            [new.value, attempt, reason, failure_class, row["detail"], row["ts"], lineage or current["lineage"],
             deadline_at, job_id])
        tx.insert("job_states", [row])
        for table, batch in (extra or {}).items():
            tx.insert(table, batch)
        if then is not None:
            then(tx)
    return True


def event(kind: str, *, job_id: str | None = None, run_id: str | None = None, instance_id: str | None = None,
          checkpoint_key: str | None = None, event_id: str | None = None, **detail: Any) -> dict:
    return {
        "event_id": event_id or uuid.uuid4().hex,
        "ts": utcnow(),
        "kind": kind,
        "job_id": job_id,
        "run_id": run_id,
        "instance_id": instance_id,
        "checkpoint_key": checkpoint_key,
        "detail": dumps(detail),
    }


def run(ledger: Ledger | Tx, run_id: str) -> dict | None:
    return ledger.one("SELECT * FROM runs WHERE run_id = ?", [run_id])


def run_id_for(job_id: str, attempt: int) -> str:
    return f"{job_id}#{attempt}"


def run_state(tx: Tx, run_id: str, state: str, *, exit_code: int | None = None, failure_class: str | None = None,
              reason: str = "") -> None:
    """A run's new state, and its history row, in the caller's transaction."""
    now = utcnow()
    tx.execute("UPDATE runs SET state = ?, exit_code = ?, failure_class = ?, reason = ?, state_at = ? WHERE run_id = ?",
               [state, exit_code, failure_class, reason, now, run_id])
    tx.insert("run_states", [{"run_id": run_id, "state": state, "exit_code": exit_code, "failure_class": failure_class,
                              "reason": reason, "ts": now}])


def bundle_for(ledger: Ledger | Tx, job_id: str, attempt: int) -> dict:
    row = ledger.one("SELECT * FROM bundles WHERE job_id = ? AND attempt <= ? ORDER BY attempt DESC LIMIT 1",
                     [job_id, attempt])
    if row is None:
        raise NotFound(f"job {job_id} has no bundle for attempt {attempt}", field="job", value=job_id,
                       fix="an imported run has no bundle; give its run.json a template to evaluate it")
    return row


def checkpoints(ledger: Ledger | Tx, job_id: str, *, live_only: bool = True, lineage: str | None = None) -> list[dict]:
    sql = "SELECT * FROM checkpoints WHERE job_id = ?"
    params: list = [job_id]
    if live_only:
        sql += " AND deleted_at IS NULL"
    if lineage is not None:
        sql += " AND lineage = ?"
        params.append(lineage)
    return ledger.rows(sql + " ORDER BY step, attempt", params)


def checkpoint(ledger: Ledger | Tx, checkpoint_key: str) -> dict | None:
    return ledger.one("SELECT * FROM checkpoints WHERE checkpoint_key = ?", [checkpoint_key])


def checkpoint_key(job_id: str, attempt: int, step: int) -> str:
    """`<job>/a<attempt>/<step>`: the attempt that wrote it is part of a checkpoint's name, so
    two attempts (a retry from scratch, a changed config) can never share a key."""
    return f"{job_id}/a{int(attempt)}/{int(step)}"


def interruptions(ledger: Ledger | Tx, job_id: str) -> int:
    """Losses that count against `max_interruptions`: not the moves orbit chose to make."""
    return int(ledger.scalar(
        "SELECT count(*) FROM job_states WHERE job_id = ? AND state = 'LOST' AND coalesce(failure_class, '') <> 'migration'",
        [job_id]) or 0)
