"""What happens after an attempt ends badly: the retry rules of `core/failures.py`.

- reclaim / lost host, and retryable infrastructure failures: a new attempt resumed from
  the newest complete checkpoint of the lineage, up to `max_interruptions`; an offer that
  keeps reclaiming this job goes to the back of dispatch's ranking;
- out-of-memory: one retry with the template's whitelisted change (e.g. micro-batch
  halved, gradient accumulation doubled), when the template declares one;
- divergence (NaN), user error: no automatic retry.
"""
from __future__ import annotations

from ..core.bundle import JobBundle
from ..core.errors import OrbitError
from ..core.lifecycle import JobState
from ..ledger import Ledger
from ..ledger import records as R
from ..policy.offer_choice import offers_to_avoid as policy_offers_to_avoid
from ..settings import Settings
from .submit import requeue


def offers_to_avoid(ledger: Ledger, job_id: str) -> set[str]:
    """Offers on which this job was reclaimed `AVOID_AFTER_RECLAIMS` times or more (the rule is
    the policy's, `policy.offer_choice.offers_to_avoid`, which the offers replay drives too).
    A reclaim is a LOST attempt that was not a migration (a move is not the zone's doing), as
    the reclaim rates count them (`control.observations.observed_reclaims`)."""
    rows = ledger.rows(
        """SELECT r.offer_id, count(*) AS n FROM runs r WHERE r.job_id = ? AND r.state = 'LOST'
           AND coalesce(r.failure_class, '') <> 'migration' GROUP BY r.offer_id""", [job_id])
    return policy_offers_to_avoid({r["offer_id"]: int(r["n"]) for r in rows if r["offer_id"]})


def oom_change(template, current: dict) -> dict | None:
    """The whitelisted OOM change, or None when the template declares none."""
    spec = template.oom_retry
    if spec is None:
        return None
    change = {}
    cfg = template.config
    if spec.halve:
        value = int(cfg.get(spec.halve.split(".", 1)[1], 0))
        if value < 2:
            return None
        change[spec.halve] = value // 2
    if spec.double:
        change[spec.double] = int(cfg.get(spec.double.split(".", 1)[1], 1)) * 2
    return change or None


def after_failure(settings: Settings, outcome) -> int | None:
    """Apply the retry rule of a FAILED attempt; returns the new attempt number if queued."""
    if outcome.state != JobState.FAILED.value or outcome.failure_class != "oom":
        return None
    ledger = settings.ledger()
    earlier = ledger.scalar(
        "SELECT count(*) FROM job_states WHERE job_id = ? AND state = 'QUEUED' AND failure_class = 'oom'", [outcome.job_id]
    )
    if earlier:
        return None  # OOM retries once
    bundle = JobBundle.load(R.bundle_for(ledger, outcome.job_id, outcome.attempt)["path"], verify=False)
    change = oom_change(bundle.spec.template, bundle.spec.template.config)
    if change is None:
        return None
    try:
        return requeue(settings, outcome.job_id, overrides=change, reason=f"out of memory: retry with {change}",
                       failure_class="oom", expect_attempt=outcome.attempt)
    except OrbitError as exc:  # the change leaves the config's allowed range: no retry, and why
        ledger.commit({"events": [R.event("oom_retry_refused", job_id=outcome.job_id, change=change, reason=str(exc))]})
        return None


def recover_lost(settings: Settings, job_id: str) -> dict:
    """LOST -> QUEUED (next attempt, resume from the newest checkpoint) or FAILED when the
    job has been interrupted more than `max_interruptions` times. Idempotent."""
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    if job["state"] != JobState.LOST.value:
        return {"job_id": job_id, "action": "none", "state": job["state"]}
    attempt = int(job["attempt"])
    lost = R.interruptions(ledger, job_id)
    limit = int(job["max_interruptions"])
    if lost > limit:
        reason = f"interrupted {lost} times, more than max_interruptions={limit}; last: {job['reason']}"
        R.transition(ledger, job_id, JobState.FAILED, attempt=attempt, reason=reason, failure_class="reclaim")
        return {"job_id": job_id, "action": "failed", "reason": reason}
    moved = job["failure_class"] == "migration"
    new_attempt = requeue(settings, job_id, expect_attempt=attempt, failure_class=job["failure_class"] or "reclaim",
                          reason="moving to the provisioned replacement" if moved
                          else f"recovering from interruption {lost}: {job['reason']}")
    return {"job_id": job_id, "action": "requeued", "attempt": new_attempt}
