"""Evaluate one checkpoint with one suite on a rented instance; results hang off the checkpoint.

The `evaluations` row of (checkpoint, suite) is both the request and the result:
PENDING -> RUNNING (claimed by one run, compare-and-set) -> SUCCEEDED | FAILED, or SKIPPED
when the checkpoint was deleted. Before anything is rented the checkpoint's bytes are
checked against the ledger's sha256; the instance is released in a `finally`, whatever
happens, and an evaluation that outlives its timeout is stopped. A claim whose run died is
given back by `reconcile_evaluations`, so an evaluation is never lost nor run twice at once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from ..core.bundle import JobBundle
from ..core.errors import CheckpointIntegrityError, NotFound, OrbitError
from ..core.host_contract import Entry, Evaluation
from ..ledger import Ledger, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, LaunchSpec, Provider
from ..settings import Settings
from .billing import instance_row, release
from .checkpoints import check_against_ledger
from .context import NullReporter, Reporter
from .dispatch import provision_first
from .placement import rank_for
from .providers import provider_for

MAX_EVAL_TRIES = 3  # hosts tried within one run (an evaluation reclaimed mid-way starts again elsewhere)
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


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        return False


def valid_metrics(metrics: object) -> dict[str, float]:
    """An evaluation's output: a non-empty mapping of metric names to finite numbers."""
    if not isinstance(metrics, dict) or not metrics:
        raise OrbitError(f"the evaluation reported {type(metrics).__name__} {str(metrics)[:80]!r}, not metrics",
                         field="metrics", fix="the eval script reports {\"metrics\": {\"name\": number, ...}}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise OrbitError(f"metric name {str(name)[:80]!r} is not valid", field="metrics", value=str(name)[:80],
                             fix="names are non-empty strings of at most 200 characters")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise OrbitError(f"metric {name!r} = {str(value)[:80]!r} is not a finite number", field=f"metrics.{name}",
                             value=str(value)[:80], fix="report finite numbers only")
        out[name] = float(value)
    return out


def evaluate_checkpoint(settings: Settings, checkpoint_key: str, *, suite: str | None = None,
                        dagster_run_id: str | None = None, reporter: Reporter | None = None,
                        poll_s: float = 0.2) -> dict:
    reporter = reporter or NullReporter()
    ledger = settings.ledger()
    ckpt = R.checkpoint(ledger, checkpoint_key)
    if ckpt is None:
        raise NotFound(f"no checkpoint {checkpoint_key!r}", field="checkpoint", value=checkpoint_key,
                       fix="list checkpoints with `orbit status JOB`")
    bundle = JobBundle.load(R.bundle_for(ledger, ckpt["job_id"], max(int(ckpt["attempt"] or 1), 1))["path"])
    template = bundle.spec.template
    if template.eval is None:
        raise OrbitError(f"template {template.name} defines no evaluation", field="eval", fix="add an eval: section")
    suite = suite or template.eval.suite_id
    c = claim(ledger, checkpoint_key, suite, dagster_run_id=dagster_run_id)
    if c.already is not None:
        return {"checkpoint_key": checkpoint_key, "suite": suite, "state": c.already["state"],
                "already": True, "dagster_run_id": c.already["dagster_run_id"]}
    try:
        check_against_ledger(c.checkpoint)  # nothing is rented for a checkpoint that fails its check
        result = _run_on_instances(settings, ledger, bundle, c, dagster_run_id=dagster_run_id, reporter=reporter,
                                   poll_s=poll_s)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # the run was terminated: a person's cancel, not a failure to retry
            cancel_claim(ledger, checkpoint_key, suite, reason=f"its run {dagster_run_id} was terminated")
            raise
        reason = str(exc) if isinstance(exc, OrbitError) else f"{type(exc).__name__}: {exc}"
        give_back(ledger, checkpoint_key, suite, tries=c.tries, reason=reason, dagster_run_id=dagster_run_id)
        raise
    return result


def cancel_claim(ledger: Ledger, checkpoint_key: str, suite: str, *, reason: str) -> None:
    """RUNNING -> CANCELLED: not requested again (a person stopped it); its instance was released."""
    with ledger.write() as tx:
        tx.execute("""UPDATE evaluations SET state = 'CANCELLED', reason = ?, finished_at = ?
                      WHERE checkpoint_key = ? AND suite = ? AND state = 'RUNNING'""",
                   [reason, utcnow(), checkpoint_key, suite])


def _run_on_instances(settings: Settings, ledger: Ledger, bundle: JobBundle, c: EvalClaim, *,
                      dagster_run_id: str | None, reporter: Reporter, poll_s: float) -> dict:
    ckpt, suite, key = c.checkpoint, c.suite, c.checkpoint["checkpoint_key"]
    template = bundle.spec.template
    provider = provider_for(settings, bundle.spec.execution_request.backend_key)
    last_error, reclaimed = "", set()
    for host_try in range(1, MAX_EVAL_TRIES + 1):
        ranked, _ = rank_for(ledger, provider, bundle.spec.execution_request, job_id=ckpt["job_id"], attempt=0,
                             notice_s=provider.notice_seconds, template=template.name, avoid=reclaimed)
        instance, _ = provision_first(provider, ranked, ckpt["job_id"], 0)
        t0, metrics, status, good, usd = time.time(), None, None, False, 0.0
        try:
            ledger.commit({"instances": [instance_row(instance, "eval", ckpt["job_id"], None, key, suite=suite,
                                                      dagster_run_id=dagster_run_id)]})
            spec = LaunchSpec(task="eval", attempt=host_try,
                              store_uri=provider.host_store_uri(instance, settings.store_uri_for(template.checkpoint.store)),
                              eval_checkpoint=provider.stage_checkpoint(instance, ckpt["uri"]), eval_sha256=ckpt["sha256"],
                              env=dict(bundle.spec.execution_request.env),
                              secret_env=tuple(bundle.spec.execution_request.secret_env))
            handle = provider.launch(instance, bundle.path, spec)
            status, metrics = _follow(provider, handle, poll_s=poll_s, timeout_s=settings.eval_timeout_s)
            if status.state == "exited" and status.exit_code == 0:
                metrics, good = valid_metrics(metrics), True
        finally:
            extra = _result_rows(ckpt, suite, metrics) if good else {}
            usd = release(settings, ledger, provider, instance, job_id=ckpt["job_id"], run_id=None, attempt=0,
                    checkpoints=[], lost=False, last_progress=None, reason="evaluation ended", purpose="eval",
                    eval_checkpoint=key, suite=suite, extra=extra)
        if status.state == "exited" and status.exit_code == 0:
            _finish(ledger, key, suite, metrics, instance, dagster_run_id, time.time() - t0)
            reporter.log(f"evaluated {key} ({suite}): {metrics}")
            return {"checkpoint_key": key, "suite": suite, "metrics": metrics, "seconds": time.time() - t0,
                    "instance_id": instance.instance_id, "state": "SUCCEEDED", "already": False, "usd": usd}
        last_error = status.reason or f"exit code {status.exit_code}"
        if status.state != "lost" and status.failure_class not in ("reclaim", "infrastructure"):
            break
        reclaimed.add(instance.offer.offer_id)
        reporter.log(f"evaluation of {key} lost its instance ({last_error}); trying another offer")
    tail = provider.logs(handle, 20)
    raise OrbitError(f"evaluation of {key} failed: {last_error}\n{tail}", field="checkpoint", value=key,
                     fix="see the log above; `orbit logs JOB` has the whole of it")


def _reported(events: list[Entry], metrics: dict | None) -> dict | None:
    """The metrics of the last `evaluation` record read, else those already had."""
    return next((e.metrics for e in reversed(events) if isinstance(e, Evaluation)), metrics)


def _follow(provider: Provider, handle, *, poll_s: float, timeout_s: float):
    offset, metrics = 0, None
    deadline = time.time() + timeout_s
    while True:
        events, offset = provider.read_events(handle, offset)
        metrics = _reported(events, metrics)
        status = provider.status(handle)
        if status.state in ("exited", "lost"):
            events, offset = provider.read_events(handle, offset)
            metrics = _reported(events, metrics)
            return status, metrics
        if time.time() > deadline:
            from ..providers.base import RunStatus

            return RunStatus(state="exited", exit_code=None, failure_class="infrastructure",
                             reason=f"evaluation timed out after {timeout_s:.0f} s"), None
        time.sleep(poll_s)


def _result_rows(ckpt: dict, suite: str, metrics: dict) -> dict[str, list[dict]]:
    now = utcnow()
    return {"metric_points": [{
        "job_id": ckpt["job_id"], "experiment": ckpt["experiment"], "run_id": f"eval:{ckpt['checkpoint_key']}:{suite}",
        "checkpoint_key": ckpt["checkpoint_key"], "suite": suite, "step": int(ckpt["step"]), "name": name,
        "value": float(value), "source": "eval", "ts": now} for name, value in metrics.items()]}


def _finish(ledger: Ledger, key: str, suite: str, metrics: dict, instance: InstanceHandle,
            dagster_run_id: str | None, seconds: float) -> None:
    with ledger.write() as tx:
        tx.execute("""UPDATE evaluations SET state = 'SUCCEEDED', metrics = ?, instance_id = ?, dagster_run_id = ?,
                      seconds = ?, finished_at = ?, reason = NULL WHERE checkpoint_key = ? AND suite = ?""",
                   [R.dumps(metrics), instance.instance_id, dagster_run_id, seconds, utcnow(), key, suite])


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
    for inst in ledger.rows("""SELECT handle, job_id FROM instances WHERE purpose = 'eval' AND checkpoint_key = ?
                               AND suite = ? AND stopped_at IS NULL""", [row["checkpoint_key"], row["suite"]]):
        instance = InstanceHandle.model_validate_json(inst["handle"])
        release(settings, ledger, _provider_of_job(settings, ledger, inst["job_id"]), instance, job_id=inst["job_id"],
                run_id=None, attempt=0, checkpoints=[], lost=False, last_progress=None,
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
