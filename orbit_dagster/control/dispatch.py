"""Dispatch: QUEUED -> DISPATCHING -> RUNNING: choose an offer, provision, launch.

Exactly one process dispatches an attempt (a lock and an idempotent transition); a
replacement a migration provisioned ahead is used instead of a new instance.
"""
from __future__ import annotations

import json

from ..core.errors import NoCapacity, OrbitError, ProviderError
from ..core.lifecycle import JobState
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, LaunchSpec, Provider, RunHandle
from . import checkpoints as C
from .billing import instance_row, release, run_state_row
from .context import Reporter, bundle_and_provider
from .observations import probed_offers
from .offers import rank_for
from .settings import Settings


def dispatch(settings: Settings, ledger: Ledger, job: dict, *, dagster_run_id: str | None,
             reporter: Reporter) -> tuple[RunHandle, Provider] | None:
    """Launch the queued attempt; None if another process is already dispatching it."""
    job_id, attempt = job["job_id"], int(job["attempt"])
    with ledger.lock(f"dispatch-{job_id}"):
        # Re-read under the lock: two runs of one attempt (a UI click and a sensor) must
        # not both provision. The loser re-attaches to what the winner launched.
        if not R.transition(ledger, job_id, JobState.DISPATCHING, attempt=attempt,
                            reason=f"dagster run {dagster_run_id or '-'}"):
            return None
    bundle, provider = bundle_and_provider(settings, ledger, job_id, attempt)
    detail = json.loads(job.get("detail") or "{}")
    template = bundle.spec.template
    store_uri = settings.store_uri_for(template.checkpoint.store)
    resume = None if detail.get("resume") == "scratch" else C.newest_complete(ledger, store_uri, job_id)
    from .recovery import offers_to_avoid  # local: recovery imports this module

    try:
        ranked, decision = rank_for(ledger, provider, bundle.spec.execution_request, job_id=job_id, attempt=attempt,
                                    notice_s=provider.notice_seconds, template=template.name,
                                    avoid=offers_to_avoid(ledger, job_id))
        standby = standby_instance(ledger, provider, job_id, attempt)
        instance, tried = (standby, []) if standby else provision_first(provider, ranked, job_id, attempt)
    except (ProviderError, OrbitError) as exc:
        retryable = isinstance(exc, ProviderError) and exc.retryable
        R.transition(ledger, job_id, JobState.LOST if retryable else JobState.FAILED, attempt=attempt, reason=str(exc),
                     failure_class="capacity" if retryable else "provider")
        raise
    offer = instance.offer
    run_id = R.run_id_for(job_id, attempt)
    interval, interval_row = checkpoint_plan(ledger, provider, template, offer, job_id=job_id, attempt=attempt)
    decision["inputs"] = R.dumps({**json.loads(decision["inputs"]), "tried": tried,
                                  "standby": instance.instance_id if standby else None})
    if standby:  # provisioned ahead by a migration: it becomes this attempt's instance
        decision["chosen"] = instance.offer.offer_id
    ledger.commit({"decisions": [decision, interval_row],
                   "instances": [] if standby else [instance_row(instance, "train", job_id, run_id)]})
    try:
        spec = LaunchSpec(
            task="train",
            attempt=attempt,
            store_uri=provider.host_store_uri(instance, store_uri),
            resume_from=provider.stage_checkpoint(instance, resume["uri"]) if resume else None,
            checkpoint_every=interval,
            memory_every=template.checkpoint.memory_every_steps,
            env=dict(bundle.spec.execution_request.env),
            secret_env=tuple(bundle.spec.execution_request.secret_env),
            # The first instance of an offer measures its effective TFLOPS for the catalog.
            probe=offer.offer_id not in probed_offers(ledger),
        )
        handle = provider.launch(instance, bundle.path, spec)
    except ProviderError as exc:
        release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                 checkpoints=[], lost=False, last_progress=None, reason=f"launch failed: {exc}")
        R.transition(ledger, job_id, JobState.LOST if exc.retryable else JobState.FAILED, attempt=attempt,
                     reason=str(exc), failure_class="capacity" if exc.retryable else "provider")
        raise
    run_row = {
        "run_id": run_id, "job_id": job_id, "attempt": attempt, "bundle_hash": bundle.bundle_hash,
        "dagster_run_id": dagster_run_id, "instance_id": instance.instance_id, "provider": provider.name,
        "offer_id": offer.offer_id, "resume_from": resume["checkpoint_key"] if resume else None,
        "handle": handle.model_dump_json(), "imported": False, "experiment": job["experiment"],
        "project": job["project"], "started_at": utcnow(),
    }
    R.transition(
        ledger, job_id, JobState.RUNNING, attempt=attempt,
        reason=f"on {offer.offer_id}" + (f", resumed from {resume['checkpoint_key']}" if resume else ""),
        extra={"runs": [run_row], "run_states": [run_state_row(run_id, "RUNNING")],
               "events": [R.event("launched", job_id=job_id, run_id=run_id, instance_id=instance.instance_id,
                                  offer=offer.offer_id, resume_from=resume["checkpoint_key"] if resume else None,
                                  checkpoint_every=interval)]},
    )
    reporter.log(f"{job_id} attempt {attempt}: running on {offer.offer_id} ({instance.instance_id}), "
                 f"durable checkpoint every {interval} steps"
                 + (f", resumed from {resume['checkpoint_key']}" if resume else ""))
    return handle, provider


MAX_OFFERS_TRIED = 5


def standby_instance(ledger: Ledger, provider: Provider, job_id: str, attempt: int) -> InstanceHandle | None:
    """The replacement a migration provisioned ahead for this attempt, if it is still up."""
    rows = ledger.rows("""SELECT handle FROM instance_usage WHERE job_id = ? AND run_id = ? AND purpose = 'train'
                          AND running AND handle IS NOT NULL""", [job_id, R.run_id_for(job_id, attempt)])
    for row in rows:
        instance = InstanceHandle.model_validate_json(row["handle"])
        if instance.provider == provider.name and provider.instance_alive(instance):
            return instance
    return None


def provision_first(provider: Provider, ranked: list, job_id: str, attempt: int) -> tuple[InstanceHandle, list[dict]]:
    """Provision the best offer that has capacity now; the others tried are recorded."""
    tried: list[dict] = []
    for offer in ranked[:MAX_OFFERS_TRIED]:
        try:
            return provider.provision(offer, tags={"orbit/job": job_id, "orbit/attempt": str(attempt)}), tried
        except NoCapacity as exc:
            tried.append({"offer": offer.offer_id, "error": str(exc)})
    raise NoCapacity(f"none of the {len(tried)} best offers has capacity now: {tried[0]['error'] if tried else ''}",
                     provider=provider.name, fix="the job is retried as an interruption; or widen resources")


def checkpoint_plan(ledger: Ledger, provider: Provider, template, offer, *, job_id: str, attempt: int) -> tuple[int, dict]:
    """The durable checkpoint interval in steps, and its decision row.

    `interval_policy: young-daly` converts the policy's interval (from the offer's reclaim
    rate, the measured save time and the notice) into steps with the measured step time;
    `fixed` keeps the template's `every_steps`. Both record the policy's figure."""
    from ..policy.interval import checkpoint_interval
    from ..policy.reclaim_rate import ReclaimRateEstimator
    from .offers import measured_save_seconds
    from .observations import measured_step_seconds, observed_reclaims

    est = ReclaimRateEstimator.for_offer(offer)
    seen = observed_reclaims(ledger).get(offer.offer_id)
    if seen:
        est.observe(seen[0], seen[1] * 3600.0)
    save_s = measured_save_seconds(ledger, template.name)
    step_s = measured_step_seconds(ledger, template.name)
    interval_s = checkpoint_interval(est.mtbf_s, save_s, notice_s=provider.notice_seconds, min_s=0.0)
    policy_steps = max(1, int(round(interval_s / step_s))) if step_s else None
    fixed = template.checkpoint.every_steps
    steps = policy_steps if template.checkpoint.interval_policy == "young-daly" and policy_steps else fixed
    row = {
        "decision_id": R.event("decision")["event_id"], "job_id": job_id, "attempt": attempt,
        "kind": "checkpoint_interval", "chosen": str(steps), "runner_up": str(fixed if steps != fixed else policy_steps),
        "inputs": R.dumps({"policy": template.checkpoint.interval_policy, "mtbf_s": est.mtbf_s,
                           "rate": est.as_record(), "save_s": save_s, "step_s": step_s,
                           "notice_s": provider.notice_seconds, "interval_s": interval_s,
                           "policy_steps": policy_steps, "template_steps": fixed}),
        "ts": utcnow(),
    }
    return steps, row
