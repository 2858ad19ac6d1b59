"""Dispatch: QUEUED -> DISPATCHING -> RUNNING: choose an offer, provision, launch.

Exactly one process dispatches an attempt: QUEUED -> DISPATCHING is a compare-and-set in
the ledger, so of two runs of one attempt (a UI click and a sensor) one wins and the other
re-attaches. DISPATCHING has an owner (the winning run) and a deadline; whatever goes wrong
after the move ends the attempt there and then: the instance, if one was provisioned, is
released and billed, and the job is LOST (retryable: the next attempt tries again) or
FAILED with its failure class and the reason, never left DISPATCHING.

A job on several instances (`resources.nodes`) rents its group all or none and launches every
node (control/group.py), or launches on the nodes its last attempt's recovery kept for it.
"""
from __future__ import annotations

import json
import math
import time

from ..core.errors import NoCapacity, OrbitError
from ..core.execution import MAX_NODES
from ..core.failures import classify_dispatch_error
from ..core.lifecycle import JobState
from ..core.offers import Offer
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..policy.checkpointing import OrbitInterval, StaticYoungDaly
from ..policy.offer_choice import MAX_OFFERS_TRIED
from ..policy.reclaim_rate import NoticeReliability, RateBook
from ..providers.base import InstanceHandle, LaunchSpec, Provider, RunHandle
from ..settings import Settings
from . import checkpoints as C
from .billing import instance_row, release
from .context import Reporter, bundle_and_provider, eval_suite_for
from .deadline import choose, on_demand_offers
from .group import launch_group, member_rows, planned_group, rent_group
from .market_clock import time_scale
from .observations import measured_step_seconds, observed_reclaims, probed_offers
from .placement import measured_save_seconds, rank_for
from .recovery import offers_to_avoid
from .trends import horizon_hours

# An AWS instance can take ~10 minutes to boot; after this the reconciler ends the attempt.
DISPATCH_TIMEOUT_S = 20 * 60.0


def dispatch(settings: Settings, ledger: Ledger, job: dict, *, dagster_run_id: str | None,
             reporter: Reporter) -> tuple[RunHandle, Provider] | None:
    """Launch the queued attempt; None if another process is already dispatching it."""
    job_id, attempt = job["job_id"], int(job["attempt"])
    if not R.transition(ledger, job_id, JobState.DISPATCHING, attempt=attempt, only_from={JobState.QUEUED},
                        reason=f"dagster run {dagster_run_id or '-'}", deadline_at=time.time() + DISPATCH_TIMEOUT_S,
                        detail={"dagster_run_id": dagster_run_id}):
        return None
    run_id = R.run_id_for(job_id, attempt)
    provisioned: list[InstanceHandle] = []
    provider: Provider | None = None
    try:
        bundle, provider = bundle_and_provider(settings, ledger, job_id, attempt, verify=True)
        return _launch(settings, ledger, job, bundle, provider, provisioned, dagster_run_id=dagster_run_id,
                       reporter=reporter)
    except BaseException as exc:
        end_failed_dispatch(settings, ledger, provider, provisioned, job_id=job_id, attempt=attempt, run_id=run_id,
                            exc=exc)
        raise


def end_failed_dispatch(settings: Settings, ledger: Ledger, provider: Provider | None, provisioned: list[InstanceHandle],
                        *, job_id: str, attempt: int, run_id: str, exc: BaseException) -> None:
    """Release what was rented and end the attempt with its class and reason."""
    failure_class, retryable = classify_dispatch_error(exc)
    reason = f"dispatch failed: {exc}" if isinstance(exc, OrbitError) else f"dispatch failed: {type(exc).__name__}: {exc}"
    interrupted = not isinstance(exc, Exception)  # the run was terminated (a person, or its process ended)
    for instance in provisioned:
        if provider is not None:
            try:
                release(settings, ledger, provider, instance, job_id=job_id, run_id=run_id, attempt=attempt,
                        checkpoints=[], lost=False, last_progress=None, reason=reason[:500])
            except Exception as release_exc:  # noqa: BLE001 - the reconciler retries the release
                ledger.commit({"events": [R.event("release_failed", job_id=job_id, instance_id=instance.instance_id,
                                                  reason=str(release_exc)[:500])]})
    if interrupted:
        R.transition(ledger, job_id, JobState.CANCELLED, attempt=attempt, reason="the run dispatching it was terminated",
                     extra={"events": [R.event("dispatch_interrupted", job_id=job_id, run_id=run_id)]})
        return
    R.transition(ledger, job_id, JobState.LOST if retryable else JobState.FAILED, attempt=attempt,
                 reason=reason[:2000], failure_class=failure_class.value,
                 extra={"events": [R.event("dispatch_failed", job_id=job_id, run_id=run_id, reason=reason[:2000],
                                           failure_class=failure_class.value, retryable=retryable)]})


def _launch(settings: Settings, ledger: Ledger, job: dict, bundle, provider: Provider,
            provisioned: list[InstanceHandle], *, dagster_run_id: str | None,
            reporter: Reporter) -> tuple[RunHandle, Provider]:
    job_id, attempt = job["job_id"], int(job["attempt"])
    template = bundle.spec.template
    store_uri = settings.store_uri_for(template.checkpoint.store)
    suite = eval_suite_for(settings, ledger, job_id, attempt)
    resume = C.newest_complete(ledger, store_uri, job_id, lineage=job["lineage"], eval_suite=suite)
    # The forecasts offer choice may use are judged over the hours this attempt is expected to run.
    steps_left = max(int(template.config.get("steps", 0)) - (int(resume["step"]) if resume else 0), 0)
    horizon = horizon_hours(steps_left * measured_step_seconds(ledger, template.name, time_scale(provider)))
    ranked, decision = rank_for(ledger, provider, bundle.spec.execution_request, job_id=job_id, attempt=attempt,
                                notice_s=provider.notice_seconds, template=template.name,
                                avoid=offers_to_avoid(ledger, job_id), horizon_h=horizon)
    market, market_row = choose(ledger, job, template, ranked[0], notice_s=provider.notice_seconds,
                                done_steps=int(resume["step"]) if resume else 0,
                                scale=time_scale(provider)) if ranked else ("spot", None)
    if market == "on_demand":  # the deadline cannot afford the spot market's reclaims any more
        ranked = on_demand_offers(ranked) or ranked
    run_id = R.run_id_for(job_id, attempt)
    # A group's nodes kept (or rented ahead) by the last attempt's recovery: control/group_recovery.py
    planned = planned_group(settings, ledger, provider, job_id, attempt) if template.resources.nodes > 1 else None
    standby = None if planned or template.resources.nodes > 1 else standby_instance(ledger, provider, job_id, attempt)
    if planned:
        group, tried = planned, []
    elif standby:
        group, tried = [standby], []
    elif template.resources.nodes > 1:
        ranked = offers_for_group(provider, ranked, template.resources.nodes)
        group, tried = rent_group(settings, ledger, provider, ranked, template.resources.nodes, job_id=job_id,
                                  attempt=attempt, provisioned=provisioned)
    else:
        instance, tried = provision_first(provider, ranked, job_id, attempt)
        provisioned.append(instance)
        group = [instance]
    instance, kept = group[0], bool(planned or standby)
    offer = instance.offer
    interval, interval_row, interval_plan = checkpoint_plan(
        ledger, provider, template, offer, job_id=job_id, attempt=attempt, nodes=len(group),
        done_steps=int(resume["step"]) if resume else 0, instance_started_at=instance.started_at.timestamp())
    decision["inputs"] = R.dumps({**json.loads(decision["inputs"]), "tried": tried,
                                  "standby": instance.instance_id if standby else None,
                                  **({"group": [i.instance_id for i in group]} if len(group) > 1 or planned else {})})
    if kept:  # provisioned ahead (a migration, a group's recovery): it becomes this attempt's
        decision["chosen"] = instance.offer.offer_id
    ledger.commit({"decisions": [decision, interval_row] + ([market_row] if market_row else []),
                   "instances": [] if kept else [instance_row(i, "train", job_id, run_id, dagster_run_id=dagster_run_id)
                                                 for i in group],
                   "group_members": member_rows(group, job_id=job_id, attempt=attempt) if len(group) > 1 else []})
    if kept:
        provisioned.extend(group)  # from here on, a failed launch releases them too
    spec = LaunchSpec(
        task="train",
        attempt=attempt,
        store_uri=provider.host_store_uri(instance, store_uri),
        resume_from=provider.stage_checkpoint(instance, resume["uri"]) if resume and len(group) == 1 else None,
        resume_sha256=resume["sha256"] if resume else None,
        checkpoint_every=interval,
        interval_plan=interval_plan,
        memory_every=template.checkpoint.memory_every_steps,
        env=dict(bundle.spec.execution_request.env),
        secret_env=tuple(bundle.spec.execution_request.secret_env),
        # The first instance of an offer measures its effective TFLOPS for the catalog.
        probe=offer.offer_id not in probed_offers(ledger),
    )
    if len(group) > 1:
        handle = launch_group(provider, group, bundle.path, spec, store_uri=store_uri,
                              resume_uri=resume["uri"] if resume else None, rdzv_id=run_id)
    else:
        handle = provider.launch(instance, bundle.path, spec)
    now = utcnow()
    run_row = {
        "run_id": run_id, "job_id": job_id, "attempt": attempt, "lineage": job["lineage"],
        "bundle_hash": bundle.bundle_hash, "dagster_run_id": dagster_run_id, "instance_id": instance.instance_id,
        "provider": provider.name, "offer_id": offer.offer_id,
        "resume_from": resume["checkpoint_key"] if resume else None, "handle": handle.model_dump_json(),
        "imported": 0, "experiment": job["experiment"], "project": job["project"], "started_at": now,
        "state": "RUNNING", "state_at": now,
    }
    R.transition(
        ledger, job_id, JobState.RUNNING, attempt=attempt,
        reason=f"on {offer.offer_id}" + (f", resumed from {resume['checkpoint_key']}" if resume else ""),
        extra={"runs": [run_row],
               "run_states": [{"run_id": run_id, "state": "RUNNING", "reason": "launched", "ts": now}],
               "events": [R.event("launched", job_id=job_id, run_id=run_id, instance_id=instance.instance_id,
                                  offer=offer.offer_id, resume_from=resume["checkpoint_key"] if resume else None,
                                  checkpoint_every=interval, lineage=job["lineage"])]},
    )
    reporter.log(f"{job_id} attempt {attempt}: running on {offer.offer_id} "
                 f"({', '.join(i.instance_id for i in group)}), "
                 f"durable checkpoint every {interval} steps"
                 + (f", resumed from {resume['checkpoint_key']}" if resume else ", from scratch"))
    return handle, provider


def standby_instance(ledger: Ledger, provider: Provider, job_id: str, attempt: int) -> InstanceHandle | None:
    """The replacement a migration provisioned ahead for this attempt, if it is still up."""
    rows = ledger.rows("""SELECT handle FROM instances WHERE job_id = ? AND run_id = ? AND purpose = 'train'
                          AND stopped_at IS NULL AND handle IS NOT NULL""", [job_id, R.run_id_for(job_id, attempt)])
    for row in rows:
        instance = InstanceHandle.model_validate_json(row["handle"])
        if instance.provider == provider.name and provider.instance_alive(instance):
            return instance
    return None


def offers_for_group(provider: Provider, ranked: list[Offer], nodes: int) -> list[Offer]:
    """The ranked offers on which the provider can rent `nodes` instances of one shape in one
    zone; none is a config no provider accepts, refused before anything is rented."""
    able = [o for o in ranked if len(provider.group_offers(o, nodes)) >= nodes]
    if ranked and not able:
        largest = max(len(provider.group_offers(o, MAX_NODES)) for o in ranked)
        raise OrbitError(f"resources.nodes={nodes}: no offer of {provider.name} that fits the job can be rented "
                         f"{nodes} times in one zone (at most {largest})", field="resources.nodes", value=nodes,
                         fix=f"set resources.nodes to at most {largest}, or a placement with more instances of one "
                             "shape in one zone (an SSH inventory: more hosts of one GPU model, count and region)")
    return able


def provision_first(provider: Provider, ranked: list, job_id: str, attempt: int) -> tuple[InstanceHandle, list[dict]]:
    """Provision the best offer that has capacity now; the others tried are recorded."""
    tried: list[dict] = []
    for offer in ranked[:MAX_OFFERS_TRIED]:
        try:
            return provider.provision(offer, tags={"orbit/job": job_id, "orbit/attempt": str(attempt)}), tried
        except NoCapacity as exc:
            tried.append({"offer": offer.offer_id, "error": str(exc)})
    if not ranked:
        raise NoCapacity("no offer fits the job's resources", provider=provider.name, retryable=False,
                         fix="widen resources (gpu, gpu_count, max price) or choose another placement")
    raise NoCapacity(f"none of the {len(tried)} best offers has capacity now: {tried[0]['error'] if tried else ''}",
                     provider=provider.name, fix="the job is retried as an interruption; or widen resources")


def fleet_notices(ledger: Ledger, provider: str):
    """What this provider's reclaims taught us about its notices: how many came without one.

    A notice is known from its event, or from the emergency checkpoint it caused: the host's
    event file goes with its disk at the reclaim, and may not have been read before."""
    row = ledger.one(
        """SELECT count(*) AS reclaims,
                  coalesce(sum(CASE WHEN NOT EXISTS (SELECT 1 FROM events e WHERE e.run_id = r.run_id
                                                     AND e.kind IN ('notice', 'host_notice'))
                                     AND NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.run_id = r.run_id
                                                     AND c.tier = 'emergency')
                                    THEN 1 ELSE 0 END), 0) AS missed
           FROM runs r WHERE r.provider = ? AND r.state = 'LOST' AND r.failure_class = 'reclaim'""", [provider])
    notices = NoticeReliability()
    notices.observe(int(row["reclaims"]), int(row["missed"]))
    return notices


def checkpoint_plan(ledger: Ledger, provider: Provider, template, offer, *, job_id: str, attempt: int,
                    done_steps: int = 0, instance_started_at: float | None = None,
                    nodes: int | None = None) -> tuple[int, dict, dict]:
    """The first durable checkpoint interval in steps, its decision row, and the plan the
    agent re-asks after each durable save (runtime/checkpoint_schedule.py).

    `every_steps` is the template's cadence: checkpoints (which are also what is evaluated
    and ranked) come at least that often. `interval_policy: orbit` (the default) may ask for
    more: the same `policy.checkpointing.OrbitInterval` that `orbit simulate` replays, from
    the offer's reclaim rate (its prior updated with every reclaim the ledger saw on it), the
    fleet's record of notices, the measured save time and the work left; `young-daly` is
    Daly's interval for the offer's MTBF; `fixed` is the cadence alone. The policy decides
    here for the instance's age 0, in seconds of work, turned into steps with the measured
    step time; `orbit`'s rule (`OrbitInterval.rule`) goes to the host, which asks it again
    after each durable save for the instance's age then, as `orbit simulate` does. Times go
    to the policy in the market's seconds (`market_clock.time_scale`); the group size is the
    template's (`Resources.nodes`), or `nodes` when the attempt runs on another number (an
    elastic group after a reclaim)."""

    scale = time_scale(provider)
    book = RateBook()
    est = book.for_offer(offer)
    seen = observed_reclaims(ledger).get(offer.offer_id)
    if seen:
        est.observe(seen[0], seen[1] * 3600.0 * scale)
    save_s = measured_save_seconds(ledger, template.name, scale)
    step_s = measured_step_seconds(ledger, template.name, scale)
    notice_s = provider.notice_seconds * scale
    cadence = template.checkpoint.every_steps
    work_left_s = max(int(template.config.get("steps", 0)) - done_steps, 0) * step_s or math.inf
    name = template.checkpoint.interval_policy
    decision: dict = {"interval_s": None, "reason": "the template's cadence", "inputs": {}}
    rule = None
    if name == "orbit":
        policy = OrbitInterval.for_offer(offer, save_s=save_s, notice_s=notice_s, rates=book,
                                         notices=fleet_notices(ledger, provider.name),
                                         nodes=nodes or template.resources.nodes)
        decision = policy.decide(age_s=0.0, work_left_s=work_left_s)
        rule = policy.rule().as_record()
    elif name == "young-daly":
        tau = StaticYoungDaly(est.mtbf_s, save_s).interval(0.0, work_left_s)
        decision = {"interval_s": tau, "reason": f"Daly's interval for MTBF {est.mtbf_s:.0f} s", "inputs": {}}
    interval_s = decision.get("interval_s")
    policy_steps = (max(1, int(round(interval_s / step_s)))
                    if interval_s is not None and math.isfinite(interval_s) and step_s else None)
    steps = min(cadence, policy_steps) if policy_steps else cadence
    row = {
        "decision_id": R.event("decision")["event_id"], "job_id": job_id, "attempt": attempt,
        "kind": "checkpoint_interval", "chosen": str(steps),
        "runner_up": str(policy_steps if steps == cadence else cadence),
        "inputs": R.dumps({"policy": name, "age_s": 0.0, "step": done_steps, "reason": decision.get("reason"),
                           "policy_inputs": decision.get("inputs"),
                           "interval_s": interval_s, "policy_steps": policy_steps, "cadence_steps": cadence,
                           "save_s": save_s, "step_s": step_s, "notice_s": notice_s, "time_scale": scale,
                           "work_left_s": None if math.isinf(work_left_s) else work_left_s, "rate": est.as_record()}),
        "ts": utcnow(),
    }
    plan = {"policy": name, "rule": rule, "cadence_steps": cadence, "steps": int(template.config.get("steps", 0)) or None,
            "step_s": step_s or None, "time_scale": scale, "instance_started_at": instance_started_at}
    return steps, row, plan
