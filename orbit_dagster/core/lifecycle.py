"""The job state machine: one transition table; an illegal transition raises."""
from __future__ import annotations

from enum import Enum

from .errors import InvalidTransition


class JobState(str, Enum):
    CREATED = "CREATED"
    QUEUED = "QUEUED"
    DISPATCHING = "DISPATCHING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    LOST = "LOST"


S = JobState

# Every legal edge. LOST -> QUEUED is the automatic recovery (a new attempt, resumed from
# the last checkpoint). The edges out of SUCCEEDED/FAILED/CANCELLED exist only for a
# person's explicit `orbit retry`; nothing automatic takes them.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.CREATED: frozenset({S.QUEUED, S.CANCELLED}),
    S.QUEUED: frozenset({S.DISPATCHING, S.CANCELLED, S.FAILED}),
    S.DISPATCHING: frozenset({S.RUNNING, S.FAILED, S.LOST, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.LOST, S.CANCELLED}),
    S.LOST: frozenset({S.QUEUED, S.FAILED}),
    S.SUCCEEDED: frozenset({S.QUEUED}),
    S.FAILED: frozenset({S.QUEUED}),
    S.CANCELLED: frozenset({S.QUEUED}),
}

TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
ACTIVE = frozenset({S.DISPATCHING, S.RUNNING})


def check_transition(current: JobState | None, new: JobState, *, job_id: str = "") -> None:
    """Raise InvalidTransition unless `current -> new` is in the table (None = no job yet)."""
    new = JobState(new)
    if current is None:
        if new is S.CREATED:
            return
        raise InvalidTransition(f"job {job_id or '?'} does not exist yet; it can only be CREATED, not {new.value}")
    current = JobState(current)
    if new not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none"
        raise InvalidTransition(
            f"job {job_id or '?'}: illegal transition {current.value} -> {new.value}",
            field="state",
            value=new.value,
            fix=f"from {current.value} the allowed next states are: {allowed}",
        )
