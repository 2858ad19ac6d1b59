"""Evaluate one checkpoint with one suite on a rented instance; results hang off the checkpoint.

The `evaluations` row of (checkpoint, suite) is both the request and the result:
PENDING -> RUNNING (claimed by one run, compare-and-set) -> SUCCEEDED | FAILED, or SKIPPED
when the checkpoint was deleted. Before anything is rented the checkpoint's bytes are
checked against the ledger's sha256; the instance is released in a `finally`, whatever
happens, and an evaluation that outlives its timeout is stopped. A claim whose run died is
given back by `reconcile_evaluations`, so an evaluation is never lost nor run twice at once.

A run may evaluate more than its own checkpoint (`share`): it then claims other PENDING
evaluations of the same job and suite, each by the same compare-and-set, and one agent on
one instance evaluates them in turn (control/eval_host.py), each result recorded on its own
row as it arrives. The instance is then named after the run (`instances.dagster_run_id`),
so reconcile releases it whichever of the run's claims it gives back first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..core.bundle import JobBundle
from ..core.errors import CheckpointIntegrityError, NotFound, OrbitError
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, Provider
from ..settings import Settings
from .billing import release
from .checkpoints import check_against_ledger
from .context import NullReporter, Reporter
from .eval_host import MAX_EVAL_TRIES, evaluate_batch, shared_lines
from .eval_output import valid_metrics
from .providers import provider_for

__all__ = ["MAX_EVAL_TRIES", "MAX_EVAL_RUNS", "evaluate_checkpoint", "claim", "claim_more", "give_back",
           "return_untried", "cancel_claim", "valid_metrics", "pending_evaluations", "eval_run_key",
           "stale_evaluations", "abandon_evaluation", "skip_deleted", "reconcile_evaluations"]
MAX_EVAL_RUNS = 3  # runs per (checkpoint, suite) before it is FAILED for good


@dataclass
class EvalClaim:
    checkpoint: dict
    suite: str
    tries: int
    already: dict | None = None  # a finished result, or the run that holds the claim


def claim(ledger: Ledger, checkpoint_key: str, suite: str, *, dagster_run_id: str | None) -> EvalClaim:
    """Take (checkpoint, suite) for this run: PENDING/BACKFILL/FAILED/CANCELLED -> RUNNING. A
    SUCCEEDED result, or a claim another run holds, is returned in `already` instead (nothing
    is rented)."""
    with ledger.write() as tx:
        ckpt = tx.one("SELECT * FROM checkpoints WHERE checkpoint_key = ?", [checkpoint_key])
        if ckpt is None:
            raise NotFound(f"no checkpoint {checkpoint_key!r}", field="checkpoint", value=checkpoint_key,
                           fix="list checkpoints with `orbit status JOB`")
        row = tx.one("SELECT * FROM evaluations WHERE checkpoint_key = ? AND suite = ?" + tx.for_update,
                     [checkpoint_key, suite])
        if row is not None and row["state"] in ("SUCCEEDED", "RUNNING"):
            return EvalClaim(ckpt, suite, int(row["tries"] or 0), already=row)
        deleted = ckpt["deleted_at"] is not None
        if deleted:  # recorded (the transaction commits), refused below: nothing is rented
            _set_state(tx, checkpoint_key, suite, ckpt, "SKIPPED", reason="the checkpoint was deleted before evaluation")
        else:
            return _take(tx, ckpt, row, checkpoint_key, suite, dagster_run_id)
    raise CheckpointIntegrityError(f"checkpoint {checkpoint_key} was deleted ({ckpt['deleted_reason']}); it is not "
                                   "evaluated", field="checkpoint", value=checkpoint_key,
                                   fix="evaluate a live checkpoint (`orbit status JOB`)")


def _take(tx, ckpt: dict, row: dict | None, checkpoint_key: str, suite: str, dagster_run_id: str | None) -> EvalClaim:
    """The claim itself, in the caller's transaction."""
    tries = int(row["tries"] or 0) + 1 if row else 1
    now = utcnow()
    if row is None:
        tx.insert("evaluations", [{"checkpoint_key": checkpoint_key, "suite": suite, "job_id": ckpt["job_id"],
                                   "experiment": ckpt["experiment"], "state": "RUNNING", "tries": tries,
                                   "dagster_run_id": dagster_run_id, "requested_at": now, "started_at": now}])
    else:
        tx.execute("""UPDATE evaluations SET state = 'RUNNING', tries = ?, dagster_run_id = ?, started_at = ?,
                      reason = NULL WHERE checkpoint_key = ? AND suite = ?""",
                   [tries, dagster_run_id, now, checkpoint_key, suite])
    return EvalClaim(ckpt, suite, tries)


def _set_state(tx, checkpoint_key: str, suite: str, ckpt: dict, state: str, *, reason: str = "") -> None:
    tx.insert("evaluations", [{"checkpoint_key": checkpoint_key, "suite": suite, "job_id": ckpt["job_id"],
                               "experiment": ckpt["experiment"], "state": state, "tries": 0, "requested_at": utcnow()}])
    tx.execute("UPDATE evaluations SET state = ?, reason = ?, finished_at = ? WHERE checkpoint_key = ? AND suite = ?",
               [state, reason, utcnow(), checkpoint_key, suite])


def give_back(ledger: Ledger, checkpoint_key: str, suite: str, *, tries: int, reason: str,
              dagster_run_id: str | None) -> str:
    """End a failed try: PENDING again (another run will try), or FAILED after MAX_EVAL_RUNS."""
    state = "FAILED" if tries >= MAX_EVAL_RUNS else "PENDING"
    ckpt = R.checkpoint(ledger, checkpoint_key) or {}
    with ledger.write() as tx:
        tx.execute("""UPDATE evaluations SET state = ?, reason = ?, finished_at = ? WHERE checkpoint_key = ? AND suite = ?
                      AND state = 'RUNNING'""", [state, reason[:2000], utcnow(), checkpoint_key, suite])
        tx.insert("events", [R.event("evaluation_failed", job_id=ckpt.get("job_id"), checkpoint_key=checkpoint_key,
                                     suite=suite, reason=reason[:2000], tries=tries, dagster_run_id=dagster_run_id,
                                     final=state == "FAILED")])
    return state


def evaluate_checkpoint(settings: Settings, checkpoint_key: str, *, suite: str | None = None,
                        dagster_run_id: str | None = None, reporter: Reporter | None = None,
                        poll_s: float = 0.2, share: int = 1, exclude: frozenset[str] | set[str] = frozenset()) -> dict:
    """Evaluate one checkpoint and, with `share` > 1, up to `share - 1` other PENDING
    evaluations of the same job and suite on the same instance (not those in `exclude`: the
    checkpoints another run is queued for). Their results are in `shared`, their failures
    (given back) in `shared_failed`; only this checkpoint's own failure raises."""
    reporter = reporter or NullReporter()
    ledger = settings.ledger()
    ckpt = R.checkpoint(ledger, checkpoint_key)
    if ckpt is None:
        raise NotFound(f"no checkpoint {checkpoint_key!r}", field="checkpoint", value=checkpoint_key,
                       fix="list checkpoints with `orbit status JOB`")
    bundle_row = R.bundle_for(ledger, ckpt["job_id"], max(int(ckpt["attempt"] or 1), 1))
    bundle = JobBundle.load(bundle_row["path"])
    template = bundle.spec.template
    if template.eval is None:
        raise OrbitError(f"template {template.name} defines no evaluation", field="eval", fix="add an eval: section")
    suite = suite or template.eval.suite_id
    c = claim(ledger, checkpoint_key, suite, dagster_run_id=dagster_run_id)
    if c.already is not None:
        return {"checkpoint_key": checkpoint_key, "suite": suite, "state": c.already["state"],
                "already": True, "dagster_run_id": c.already["dagster_run_id"]}
    claims = [c]
    try:
        check_against_ledger(c.checkpoint)  # nothing is rented for a checkpoint that fails its check
        if share > 1:
            claims += claim_more(ledger, c, bundle_row["path"], limit=share - 1, exclude=set(exclude),
                                 dagster_run_id=dagster_run_id)
        out = evaluate_batch(settings, ledger, bundle, claims, dagster_run_id=dagster_run_id, reporter=reporter,
                             poll_s=poll_s, give_back=lambda k, why: _give_back(ledger, k, why, dagster_run_id),
                             return_untried=lambda k: return_untried(ledger, k))
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the run was terminated: a person's cancel, not a failure to retry
            for k in claims:
                cancel_claim(ledger, k.checkpoint["checkpoint_key"], suite,
                             reason=f"its run {dagster_run_id} was terminated")
            raise
        reason = str(exc) if isinstance(exc, OrbitError) else f"{type(exc).__name__}: {exc}"
        give_back(ledger, checkpoint_key, suite, tries=c.tries, reason=reason, dagster_run_id=dagster_run_id)
        for k in claims[1:]:
            return_untried(ledger, k)
        raise
    if checkpoint_key in out.failed:
        raise OrbitError(f"evaluation of {checkpoint_key} failed: {out.failed[checkpoint_key]}\n{out.log_tail}",
                         field="checkpoint", value=checkpoint_key,
                         fix="see the log above; `orbit logs JOB` has the whole of it")
    others = [k.checkpoint["checkpoint_key"] for k in claims[1:]]
    return {**out.results[checkpoint_key], "shared": [out.results[k] for k in others if k in out.results],
            "shared_failed": {k: out.failed[k] for k in others if k in out.failed}}


def claim_more(ledger: Ledger, first: EvalClaim, bundle_path: str, *, limit: int, exclude: set[str],
               dagster_run_id: str | None) -> list[EvalClaim]:
    """Claim (each compare-and-set) up to `limit` other PENDING evaluations of `first`'s job and
    suite whose checkpoints are live, pass their check and come from the same bundle (the eval
    script is the bundle's), oldest checkpoint first. One that fails its check is given back."""
    job_id, suite = first.checkpoint["job_id"], first.suite
    rows = ledger.rows("""SELECT e.checkpoint_key, c.attempt FROM evaluations e
                          JOIN checkpoints c ON c.checkpoint_key = e.checkpoint_key
                          WHERE e.job_id = ? AND e.suite = ? AND e.state = 'PENDING' AND c.deleted_at IS NULL
                          AND e.checkpoint_key <> ? ORDER BY c.attempt, c.step""",
                       [job_id, suite, first.checkpoint["checkpoint_key"]])
    out: list[EvalClaim] = []
    for row in rows:
        if len(out) >= limit:
            break
        if row["checkpoint_key"] in exclude or \
                R.bundle_for(ledger, job_id, max(int(row["attempt"] or 1), 1))["path"] != bundle_path:
            continue
        c = claim(ledger, row["checkpoint_key"], suite, dagster_run_id=dagster_run_id)
        if c.already is not None:
            continue  # another run took it meanwhile
        try:
            check_against_ledger(c.checkpoint)
        except CheckpointIntegrityError as exc:
            _give_back(ledger, c, str(exc), dagster_run_id)
            continue
        out.append(c)
    return out


def _give_back(ledger: Ledger, c: EvalClaim, reason: str, dagster_run_id: str | None) -> str:
    return give_back(ledger, c.checkpoint["checkpoint_key"], c.suite, tries=c.tries, reason=reason,
                     dagster_run_id=dagster_run_id)


def return_untried(ledger: Ledger, c: EvalClaim) -> None:
    """RUNNING -> PENDING with its try not counted: claimed for a batch that ended before it ran."""
    with ledger.write() as tx:
        tx.execute("""UPDATE evaluations SET state = 'PENDING', tries = ?, started_at = NULL
                      WHERE checkpoint_key = ? AND suite = ? AND state = 'RUNNING'""",
                   [max(c.tries - 1, 0), c.checkpoint["checkpoint_key"], c.suite])


def cancel_claim(ledger: Ledger, checkpoint_key: str, suite: str, *, reason: str) -> None:
    """RUNNING -> CANCELLED: not requested again (a person stopped it); its instance was released."""
    with ledger.write() as tx:
        tx.execute("""UPDATE evaluations SET state = 'CANCELLED', reason = ?, finished_at = ?
                      WHERE checkpoint_key = ? AND suite = ? AND state = 'RUNNING'""",
                   [reason, utcnow(), checkpoint_key, suite])


def pending_evaluations(ledger: Ledger, limit: int) -> list[dict]:
    """Evaluations waiting for a run, oldest first (their checkpoints still live)."""
    return ledger.rows(
        """SELECT e.checkpoint_key, e.suite, e.job_id, e.tries, j.placement FROM evaluations e
           JOIN checkpoints c ON c.checkpoint_key = e.checkpoint_key JOIN jobs j ON j.job_id = e.job_id
           WHERE e.state = 'PENDING' AND c.deleted_at IS NULL ORDER BY e.requested_at LIMIT ?""", [limit])


def eval_run_key(checkpoint_key: str, suite: str, tries: int) -> str:
    """One run key per (checkpoint, suite, try), whoever requests it (sensor, schedule, backfill)."""
    return f"eval:{checkpoint_key}:{suite}:try-{int(tries) + 1}"


def stale_evaluations(settings: Settings, run_alive: Callable[[str | None], bool]) -> list[dict]:
    """Claims whose run is gone or past the timeout, each with why (reads only)."""
    now = time.time()
    out = []
    for row in settings.ledger().rows("""SELECT e.checkpoint_key, e.suite, e.job_id, e.tries, e.dagster_run_id,
                                                e.started_at FROM evaluations e WHERE e.state = 'RUNNING'"""):
        late = row["started_at"] is not None and now - float(row["started_at"]) > settings.eval_timeout_s + 60
        if late or not run_alive(row["dagster_run_id"]):
            out.append({**row, "why": "timed out" if late else "its run ended without finishing it"})
    return out


def abandon_evaluation(settings: Settings, row: dict) -> str:
    """Release what the claim rented and give it back (PENDING again, or FAILED after MAX_EVAL_RUNS)."""
    ledger = settings.ledger()
    # The instance rented for it: the one named after it, or the one its run shares (a batch's
    # instance is named after the batch's first checkpoint). Billing is once per instance.
    for inst in ledger.rows("""SELECT handle, job_id FROM instances WHERE purpose = 'eval' AND stopped_at IS NULL
                               AND ((checkpoint_key = ? AND suite = ?) OR dagster_run_id = ?)""",
                            [row["checkpoint_key"], row["suite"], row["dagster_run_id"] or "-"]):
        instance = InstanceHandle.model_validate_json(inst["handle"])
        release(settings, ledger, _provider_of_job(settings, ledger, inst["job_id"]), instance, job_id=inst["job_id"],
                run_id=None, attempt=0, checkpoints=shared_lines(ledger, instance.instance_id), lost=False,
                last_progress=None,
                reason="evaluation abandoned", purpose="eval", eval_checkpoint=row["checkpoint_key"],
                suite=row["suite"])
    state = give_back(ledger, row["checkpoint_key"], row["suite"], tries=int(row["tries"] or 1),
                      reason=f"evaluation {row['why']}", dagster_run_id=row["dagster_run_id"])
    return f"{row['checkpoint_key']} ({row['suite']}): {row['why']}; now {state}"


def skip_deleted(settings: Settings) -> int:
    """Pending evaluations of checkpoints deleted meanwhile are SKIPPED, never rented for."""
    with settings.ledger().write() as tx:
        return tx.execute("""UPDATE evaluations SET state = 'SKIPPED', reason = 'the checkpoint was deleted',
                             finished_at = ? WHERE state = 'PENDING' AND checkpoint_key IN
                             (SELECT checkpoint_key FROM checkpoints WHERE deleted_at IS NOT NULL)""", [utcnow()])


def reconcile_evaluations(settings: Settings, run_alive: Callable[[str | None], bool]) -> list[str]:
    """Give back stale claims and skip deleted checkpoints at once (the CLI's and tests' door)."""
    done = [abandon_evaluation(settings, row) for row in stale_evaluations(settings, run_alive)]
    skip_deleted(settings)
    return done


def _provider_of_job(settings: Settings, ledger: Ledger, job_id: str) -> Provider:
    bundle = JobBundle.load(R.bundle_for(ledger, job_id, 1 << 30)["path"], verify=False)
    return provider_for(settings, bundle.spec.execution_request.backend_key)
