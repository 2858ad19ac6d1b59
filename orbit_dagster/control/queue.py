"""The queue of attempts waiting for a run to dispatch them."""
from __future__ import annotations

from ..core.lifecycle import JobState
from ..ledger import Ledger
from ..ledger import records as R
from ..settings import Settings


def queued_jobs(ledger: Ledger) -> list[dict]:
    return ledger.rows("SELECT job_id, attempt, experiment, placement FROM jobs WHERE state = 'QUEUED' "
                       "ORDER BY state_at, job_id")


def fail_undispatched(settings: Settings, job_id: str, attempt: int, *, runs: int) -> bool:
    """An attempt whose runs keep ending before they dispatch it: FAILED, with the reason."""
    reason = f"{runs} training runs of attempt {attempt} ended before dispatching it; see their logs in the Dagster UI"
    return R.transition(settings.ledger(), job_id, JobState.FAILED, attempt=attempt, reason=reason,
                        failure_class="infrastructure", only_from={JobState.QUEUED})
