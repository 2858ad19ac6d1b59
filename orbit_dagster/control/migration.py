"""Proactive migration: move a job off an offer whose risk keeps rising, make-before-break.

Risk of an offer, per window: its reclaim rate estimated from everything the ledger has
seen on it up to the end of the window (the prior from the spot-advisor band or the fitted
model, updated with reclaims and exposure across all jobs). The policy
(`policy.migration.should_migrate`) moves when that rose three windows in a row, the work
left is long enough for the move to pay, and it fits the budget. The move, in order:

1. provision the replacement on the target offer (recorded as the next attempt's instance);
2. checkpoint: the current host is asked to stop (SIGTERM), so the agent writes an
   emergency checkpoint of the newest state;
3. switch: the attempt ends `LOST / migration` (not an interruption) and the next attempt
   is dispatched onto the replacement, resuming from that checkpoint;
4. release: the old instance is billed and released by the run that followed it.
A failure before step 2 leaves the job where it was (the replacement is released).

The same move is planned on AWS's rebalance recommendation when the template says
`checkpoint.on_rebalance: migrate` and the policy says the work left is long enough
(`rebalance_move`): the price sensor asks at its next tick once the host's record is in the
ledger, and the move is one more migration run, made by `carry_out` like the others.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

from ..core.offers import Offer, on_demand
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..policy.migration import WINDOWS, decide_move, decide_on_rebalance, rebalance_rate, risk_rising
from ..policy.migration import risk_history as policy_risk_history
from ..policy.offer_choice import RESTORE_PRIOR_S
from ..providers.base import RunHandle
from ..settings import Settings
from .billing import instance_row, release
from .context import Attempts, bundle_and_provider
from .deadline import choose
from .market_clock import time_scale
from .observations import measured_step_seconds
from .placement import measured_save_seconds, rank_for
from .reconcile import active_attempts


def observed_on(ledger: Ledger, offer: Offer) -> tuple[list[float], list[tuple[float, float | None]]]:
    """What the ledger saw on the offer: its reclaims' times (a migration is not one) and its
    instances' (start, stop) spans (stop None: still up)."""
    lost = [float(r["state_at"]) for r in ledger.rows(
        """SELECT state_at FROM runs WHERE offer_id = ? AND state = 'LOST'
           AND coalesce(failure_class, '') <> 'migration'""", [offer.offer_id])]
    spans = [(float(r["started_at"]), None if r["stopped_at"] is None else float(r["stopped_at"]))
             for r in ledger.rows("SELECT started_at, stopped_at FROM instances WHERE offer_id = ?", [offer.offer_id])]
    return lost, spans


def risk_history(ledger: Ledger, offer: Offer, now: datetime, window_s: float, windows: int = WINDOWS,
                 scale: float = 1.0) -> list[float]:
    """The offer's estimated reclaim rate per (market) hour at the end of each of the last windows,
    from every instance the ledger has on it (`policy.migration.risk_history`); `scale`: market
    seconds per wall second of the offer's market."""
    lost, spans = observed_on(ledger, offer)
    return policy_risk_history(offer, lost, spans, now=now.timestamp(), window_s=window_s, windows=windows,
                               scale=scale)


def remaining_work_s(ledger: Ledger, template, run_id: str, scale: float) -> float:
    """The (market) seconds of training left: the template's steps past the attempt's last
    reported one, at the template's measured step time."""
    last_step = ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?", [run_id]) or 0
    return max(int(template.config.get("steps", 0)) - int(last_step), 0) * measured_step_seconds(
        ledger, template.name, scale)


def plan_migrations(settings: Settings, *, now: datetime | None = None, window_s: float | None = None) -> list[dict]:
    """Decide for every running attempt (the decision row is recorded either way): a rebalance
    recommendation its host reported (`rebalance_move`), its deadline (`to_on_demand`), its
    offer's rising risk. The moves the policies ask for, each {job_id, attempt, run_id,
    instance_id, provider, from, to, target, reason, trigger} (`rebalance`, `deadline`, `risk`)."""
    ledger = settings.ledger()
    now = now or datetime.now(timezone.utc)
    window_s = window_s or settings.migration_window_s
    moves = []
    # Once per tick, not once per attempt: bundles and providers, moves already started, and
    # each offer's risk history (many attempts share an offer).
    contexts = Attempts(settings, ledger)
    moving = {r["run_id"] for r in ledger.rows(
        """SELECT DISTINCT e.run_id FROM runs r JOIN events e ON e.run_id = r.run_id
           WHERE r.state = 'RUNNING' AND e.kind = 'migration_started'""")}
    # Attempts whose host reported AWS's rebalance recommendation and that have no answer yet.
    recommended = {r["run_id"] for r in ledger.rows(
        """SELECT DISTINCT e.run_id FROM runs r JOIN events e ON e.run_id = r.run_id
           WHERE r.state = 'RUNNING' AND e.kind = 'host_rebalance'
             AND NOT EXISTS (SELECT 1 FROM decisions d WHERE d.decision_id = 'rebalance:' || r.run_id)""")}
    histories: dict[tuple[str, float], list[float]] = {}
    for row in active_attempts(ledger):
        job_id, attempt = row["job_id"], int(row["attempt"])
        handle = RunHandle.model_validate_json(row["handle"])
        current = handle.instance.offer
        if row["run_id"] in moving:
            continue
        if row["run_id"] in recommended:
            # Before the deadline's and the risk's questions: the recommendation is the newest
            # word on this instance. A move it brings is this tick's move; else those questions
            # are asked as on any tick.
            move = rebalance_move(ledger, row, handle, contexts, now=now.timestamp())
            if move is not None:
                moves.append(move)
                continue
        if not current.spot or handle.nodes:
            continue  # (moving a group of nodes is not built: a reclaim of one is handled, docs/multi-node.md)
        deadline_move = to_on_demand(settings, ledger, row, current, now=now.timestamp(), contexts=contexts)
        if deadline_move is not None:
            moves.append(deadline_move)
            continue
        bundle, provider = contexts(job_id, attempt)
        scale = time_scale(provider)
        if (current.offer_id, scale) not in histories:
            histories[(current.offer_id, scale)] = risk_history(ledger, current, now, window_s, scale=scale)
        history = histories[(current.offer_id, scale)]
        if not risk_rising(history, WINDOWS - 1):
            continue
        template = bundle.spec.template
        ranked, _ = rank_for(ledger, provider, bundle.spec.execution_request, job_id=job_id, attempt=attempt,
                             notice_s=provider.notice_seconds, template=template.name, avoid={current.offer_id})
        remaining_s = remaining_work_s(ledger, template, row["run_id"], scale)
        asked = decide_move(history, current=current, ranked=ranked, remaining_work_s=remaining_s,
                            save_s=measured_save_seconds(ledger, template.name, scale), restore_s=RESTORE_PRIOR_S,
                            notice_s=provider.notice_seconds * scale)
        if asked is None:
            continue
        target, decision = asked
        window = int(now.timestamp() // window_s)
        ledger.commit({"decisions": [{
            "decision_id": f"migration:{row['run_id']}:{window}", "job_id": job_id, "attempt": attempt,
            "kind": "migration", "chosen": target.offer_id if decision.migrate else current.offer_id,
            "runner_up": current.offer_id if decision.migrate else target.offer_id,
            "inputs": R.dumps(decision.as_record()), "ts": utcnow()}]})
        if decision.migrate:
            moves.append({"job_id": job_id, "attempt": attempt, "run_id": row["run_id"],
                          "instance_id": handle.instance.instance_id, "provider": provider.name,
                          "from": current.offer_id, "to": target.offer_id, "target": target.model_dump_json(),
                          "reason": decision.reason, "trigger": "risk"})
    return moves


def to_on_demand(settings: Settings, ledger: Ledger, row: dict, current: Offer, *,
                 now: float | None = None, contexts: Attempts | None = None) -> dict | None:
    """A deadline job on spot whose policy now says on-demand: the move to the same shape on demand."""
    bundle, provider = (contexts or Attempts(settings, ledger))(row["job_id"], int(row["attempt"]))
    template = bundle.spec.template
    if template.deadline_hours is None:
        return None
    job = R.require_job(ledger, row["job_id"])
    # The work done is where training is now (the move saves the newest state on its way
    # out), or where the attempt resumed from while it restores: not its last checkpoint,
    # nor 0 before this attempt's first one.
    done = ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ? AND source = 'train'",
                         [row["run_id"]]) or ledger.scalar(
        "SELECT c.step FROM checkpoints c JOIN runs r ON r.resume_from = c.checkpoint_key WHERE r.run_id = ?",
        [row["run_id"]]) or 0
    market, decision = choose(ledger, job, template, current, notice_s=provider.notice_seconds, done_steps=int(done),
                              holding="spot", scale=time_scale(provider), now=now)
    if market != "on_demand" or decision is None:
        return None
    ledger.commit({"decisions": [decision]})
    target = on_demand(current)
    handle = RunHandle.model_validate_json(row["handle"])
    return {"job_id": row["job_id"], "attempt": int(row["attempt"]), "run_id": row["run_id"],
            "instance_id": handle.instance.instance_id, "provider": provider.name, "from": current.offer_id,
            "to": target.offer_id, "target": target.model_dump_json(),
            "reason": "the deadline needs on-demand now: " + str(json.loads(decision["inputs"])["reason"]),
            "trigger": "deadline"}


def carry_out(settings: Settings, move: dict) -> dict:
    """Make one planned move (what the migration run does); nothing when the attempt has moved on."""
    ledger = settings.ledger()
    run = R.run(ledger, move["run_id"])
    if run is None or run["state"] != "RUNNING" or ledger.scalar(
            "SELECT count(*) FROM events WHERE run_id = ? AND kind = 'migration_started'", [move["run_id"]]):
        return {**move, "replacement": None, "skipped": "the attempt is no longer running there"}
    _, provider = bundle_and_provider(settings, ledger, move["job_id"], int(move["attempt"]))
    return migrate(settings, ledger, provider, RunHandle.model_validate_json(run["handle"]), job_id=move["job_id"],
                   attempt=int(move["attempt"]), target=Offer.model_validate_json(move["target"]), reason=move["reason"])


def consider_migrations(settings: Settings, *, now: datetime | None = None, window_s: float | None = None) -> list[dict]:
    """Plan and carry out at once (the tests' and benches' door; the daemon moves through `rental_job` runs)."""
    return [carry_out(settings, m) for m in plan_migrations(settings, now=now, window_s=window_s)]


def migrate(settings: Settings, ledger: Ledger, provider, handle: RunHandle, *, job_id: str, attempt: int,
            target: Offer, reason: str) -> dict:
    run_id, next_run = R.run_id_for(job_id, attempt), R.run_id_for(job_id, attempt + 1)
    replacement = provider.provision(target, tags={"orbit/job": job_id, "orbit/attempt": str(attempt + 1),
                                                   "orbit/migration-from": handle.instance.instance_id})
    try:
        ledger.commit({
            "instances": [instance_row(replacement, "train", job_id, next_run)],
            "events": [R.event("migration_started", job_id=job_id, run_id=run_id, instance_id=handle.instance.instance_id,
                               to_offer=target.offer_id, replacement=replacement.instance_id, reason=reason)],
        })
        provider.terminate(handle.instance, "migration: checkpoint and stop")  # SIGTERM -> emergency checkpoint
    except BaseException:
        release(settings, ledger, provider, replacement, job_id=job_id, run_id=next_run, attempt=attempt + 1,
                 checkpoints=[], lost=False, last_progress=None, reason="migration aborted")
        raise
    return {"job_id": job_id, "attempt": attempt, "from": handle.instance.offer.offer_id, "to": target.offer_id,
            "replacement": replacement.instance_id}


def rebalance_move(ledger: Ledger, row: dict, handle: RunHandle, contexts: Attempts, *, now: float) -> dict | None:
    """`checkpoint.on_rebalance: migrate`: the attempt's host reported AWS's rebalance
    recommendation (its agent has asked for the early durable checkpoint already). Decide with
    the migration policy (`policy.migration.decide_on_rebalance`: the move when the work left is
    long enough for it to pay, the recommendation counted as one more reclaim on the offer).
    With that setting the decision is recorded once per attempt (`inputs.action`: `migrate` or
    `checkpoint`); returns the move for the migration run when it says move, else None (the
    early checkpoint stands, or the template asked for no move: nothing is recorded then)."""
    job_id, attempt, run_id = row["job_id"], int(row["attempt"]), row["run_id"]
    bundle, provider = contexts(job_id, attempt)
    template = bundle.spec.template
    if template.checkpoint.on_rebalance != "migrate":
        return None
    current = handle.instance.offer
    scale = time_scale(provider)
    remaining_s = remaining_work_s(ledger, template, run_id, scale)
    inputs: dict = {"decision": "migration", "migrate": False, "trigger": "rebalance",
                    "inputs": {"remaining_work_s": remaining_s, "current": current.offer_id}}
    target = None
    if handle.nodes or not current.spot:
        inputs["reason"] = ("a group of nodes is not moved (docs/multi-node.md)" if handle.nodes
                            else "the instance is not spot")
    else:
        lost, spans = observed_on(ledger, current)
        rate = rebalance_rate(current, lost, spans, now=now, scale=scale)
        ranked, _ = rank_for(ledger, provider, bundle.spec.execution_request, job_id=job_id, attempt=attempt,
                             notice_s=provider.notice_seconds, template=template.name, avoid={current.offer_id})
        asked = decide_on_rebalance(rate, current=current, ranked=ranked, remaining_work_s=remaining_s,
                                    save_s=measured_save_seconds(ledger, template.name, scale),
                                    restore_s=RESTORE_PRIOR_S, notice_s=provider.notice_seconds * scale)
        if asked is None:
            inputs["reason"] = "no other offer to move to"
        else:
            target, decision = asked
            inputs = {**decision.as_record(), "trigger": "rebalance"}
    move = bool(inputs["migrate"])
    inputs["action"] = "migrate" if move else "checkpoint"
    ledger.commit({"decisions": [{
        "decision_id": f"rebalance:{run_id}", "job_id": job_id, "attempt": attempt, "kind": "migration",
        "chosen": target.offer_id if move else current.offer_id,
        "runner_up": current.offer_id if move else (target.offer_id if target is not None else None),
        "inputs": R.dumps(inputs), "ts": utcnow()}]})
    if not move:
        return None
    return {"job_id": job_id, "attempt": attempt, "run_id": run_id, "instance_id": handle.instance.instance_id,
            "provider": provider.name, "from": current.offer_id, "to": target.offer_id,
            "target": target.model_dump_json(), "reason": "rebalance recommendation: " + inputs["reason"],
            "trigger": "rebalance"}
