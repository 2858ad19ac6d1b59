"""One failure taxonomy for every provider, and its retry rules.

| class            | what                                                        | retry rule |
|------------------|-------------------------------------------------------------|------------|
| `reclaim`        | the host went away: spot reclaim, lost heartbeat, the       | a new attempt from the newest checkpoint of the lineage, up to `max_interruptions`; an offer that reclaimed this job twice is avoided |
|                  | workload or host killed by a signal with no exit report     |            |
| `infrastructure` | the platform failed: disk full, I/O or network error, no    | retryable ones (capacity, network, a full disk on a host) as a reclaim: a new attempt, counted against `max_interruptions`; the others (credentials, quota) fail the job |
|                  | capacity, provider API errors, a dispatch that never ended  |            |
| `oom`            | out of memory (CUDA or host)                                | once, with the template's whitelisted change (`oom_retry`) |
| `user_error`     | the workload or its config: non-zero exit, exception, a     | never retried: a person fixes and retries |
|                  | bundle that does not verify, a config the provider rejects  |            |
| `divergence`     | a training metric became NaN or infinite                    | never retried (a user error, reported apart) |
| `migration`      | orbit moved the job to a safer offer (not a failure)        | the next attempt runs on the replacement; not counted |

The runtime agent reports the class in its exit file (`runtime/agent.py` keeps its own
copy of the exit-code table, because it never imports the control plane).
"""
from __future__ import annotations

import errno
from enum import Enum

from .errors import OrbitError, ProviderError


class FailureClass(str, Enum):
    RECLAIM = "reclaim"
    INFRASTRUCTURE = "infrastructure"
    OOM = "oom"
    USER_ERROR = "user_error"
    DIVERGENCE = "divergence"
    MIGRATION = "migration"


# Exit codes of the runtime agent and the class each stands for.
EXIT_CLASSES: dict[int, FailureClass | None] = {
    0: None,
    1: FailureClass.USER_ERROR,
    3: FailureClass.OOM,
    4: FailureClass.DIVERGENCE,
    65: FailureClass.USER_ERROR,  # the bundle does not verify
    74: FailureClass.INFRASTRUCTURE,  # EX_IOERR: disk full, I/O or network error on the host
    75: FailureClass.RECLAIM,  # EX_TEMPFAIL: stopped after an emergency checkpoint
}

INFRA_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENETUNREACH, errno.ECONNRESET,
                errno.ETIMEDOUT, errno.EHOSTUNREACH}


def retried_as_interruption(failure_class: str | None) -> bool:
    """Does an attempt that ended with this class get a new attempt from its last checkpoint?"""
    return failure_class in (FailureClass.RECLAIM.value, FailureClass.INFRASTRUCTURE.value,
                             FailureClass.MIGRATION.value)


def classify_dispatch_error(exc: BaseException) -> tuple[FailureClass, bool]:
    """(class, retryable) of an error raised while provisioning or launching an attempt."""
    if isinstance(exc, ProviderError):
        return FailureClass.INFRASTRUCTURE, bool(exc.retryable)
    if isinstance(exc, OrbitError):
        return FailureClass.USER_ERROR, False  # a config no provider accepts: a person fixes it
    if isinstance(exc, OSError):
        return FailureClass.INFRASTRUCTURE, exc.errno in INFRA_ERRNOS
    return FailureClass.INFRASTRUCTURE, False
