"""Evaluations on a rented instance: one agent evaluates a batch of claimed checkpoints in turn.

A batch is the claims one run holds (control/evaluate.py claims them, each compare-and-set):
its own checkpoint first, then other PENDING evaluations of the same job and suite. They
share one instance, so the rental start and the agent's start (Python, torch, the bundle
check) are paid once instead of once per checkpoint. Each result is recorded the moment its
`evaluation` record arrives (SUCCEEDED, its metric points, the instance), so a batch cut
short keeps what it finished. What it did not finish is given back, by the rules below:
- the instance was lost (reclaim, infrastructure): the unfinished rest goes to another
  instance, up to MAX_EVAL_TRIES instances;
- the workload failed (user error): the checkpoint it was evaluating is given back with the
  reason (a try counted, FAILED after MAX_EVAL_RUNS); the ones after it never ran, so they
  are PENDING again with their try not counted.
The bill is split per evaluated checkpoint (`core.costs`): each gets the seconds up to its
result, the rest (boot, shutdown, a failed evaluation) goes to the first unfinished one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core.bundle import JobBundle
from ..core.errors import OrbitError
from ..core.host_contract import Evaluation
from ..ledger import Ledger, as_datetime, utcnow
from ..ledger import records as R
from ..providers.base import InstanceHandle, LaunchSpec, Provider, RunStatus
from ..settings import Settings
from .billing import instance_row, release
from .context import Reporter
from .dispatch import provision_first
from .eval_output import valid_metrics
from .placement import rank_for
from .providers import provider_for

MAX_EVAL_TRIES = 3  # hosts tried within one run (an evaluation reclaimed mid-way starts again elsewhere)


@dataclass
class BatchOutcome:
    results: dict[str, dict] = field(default_factory=dict)  # checkpoint key -> its result
    failed: dict[str, str] = field(default_factory=dict)  # checkpoint key -> why (given back)
    log_tail: str = ""


def evaluate_batch(settings: Settings, ledger: Ledger, bundle: JobBundle, claims: list, *,
                   dagster_run_id: str | None, reporter: Reporter, poll_s: float, give_back, return_untried
                   ) -> BatchOutcome:
    """Evaluate `claims` (EvalClaim, in order) on as few instances as the market allows.
    `give_back(claim, reason)` ends a failed try; `return_untried(claim)` returns a claim that
    never ran. Every claim ends SUCCEEDED or given back here; only an exception (provisioning
    failed, the run was terminated) leaves claims RUNNING for the caller to give back."""
    out = BatchOutcome()
    provider = provider_for(settings, bundle.spec.execution_request.backend_key)
    todo, reclaimed, last_error = list(claims), set(), ""
    suite, job_id = claims[0].suite, claims[0].checkpoint["job_id"]
    for host_try in range(1, MAX_EVAL_TRIES + 1):
        ranked, _ = rank_for(ledger, provider, bundle.spec.execution_request, job_id=job_id, attempt=0,
                             notice_s=provider.notice_seconds, template=bundle.spec.template.name, avoid=reclaimed)
        instance, _ = provision_first(provider, ranked, job_id, 0)
        status, handle = None, None
        try:
            ledger.commit({"instances": [instance_row(instance, "eval", job_id, None, todo[0].checkpoint["checkpoint_key"],
                                                      suite=suite, dagster_run_id=dagster_run_id)]})
            staged = [(provider.stage_checkpoint(instance, c.checkpoint["uri"]), c) for c in todo]
            spec = LaunchSpec(task="eval", attempt=host_try,
                              store_uri=provider.host_store_uri(instance,
                                                                settings.store_uri_for(bundle.spec.template.checkpoint.store)),
                              eval_checkpoint=staged[0][0], eval_sha256=staged[0][1].checkpoint["sha256"],
                              eval_more=tuple((uri, c.checkpoint["sha256"]) for uri, c in staged[1:]),
                              env=dict(bundle.spec.execution_request.env),
                              secret_env=tuple(bundle.spec.execution_request.secret_env))
            handle = provider.launch(instance, bundle.path, spec)
            recorder = _Recorder(ledger, staged, instance, dagster_run_id, out, give_back, reporter)
            status = _follow(provider, handle, recorder, poll_s=poll_s, timeout_s=settings.eval_timeout_s * len(todo))
        finally:
            _release(settings, ledger, provider, instance, todo, out)
        if handle is not None:
            out.log_tail = provider.logs(handle, 20)
        todo = [c for c in todo if _key(c) not in out.results and _key(c) not in out.failed]
        if not todo:
            return out
        last_error = status.reason or f"exit code {status.exit_code}"
        if status.state == "exited" and status.exit_code == 0:
            for c in todo:
                _fail(out, give_back, c, "the evaluation ended without reporting metrics")
            return out
        if status.state != "lost" and status.failure_class not in ("reclaim", "infrastructure"):
            _fail(out, give_back, todo[0], last_error)  # the checkpoint it was on; the rest never ran
            for c in todo[1:]:
                return_untried(c)
            return out
        reclaimed.add(instance.offer.offer_id)
        reporter.log(f"evaluation of {', '.join(map(_key, todo))} lost its instance ({last_error}); "
                     "trying another offer")
    for c in todo:
        _fail(out, give_back, c, last_error)
    return out


def _key(claim) -> str:
    return claim.checkpoint["checkpoint_key"]


def _fail(out: BatchOutcome, give_back, claim, reason: str) -> None:
    out.failed[_key(claim)] = reason
    give_back(claim, reason)


class _Recorder:
    """Records each `evaluation` record as it arrives: the checkpoint it names (its staged uri),
    else the next unfinished one (an agent that does not name it)."""

    def __init__(self, ledger: Ledger, staged: list, instance: InstanceHandle, dagster_run_id: str | None,
                 out: BatchOutcome, give_back, reporter: Reporter):
        self.ledger, self.staged, self.instance, self.run_id = ledger, staged, instance, dagster_run_id
        self.out, self.give_back, self.reporter = out, give_back, reporter
        self.since = time.time()

    def _claim_for(self, uri: str | None):
        open_ = [c for u, c in self.staged if _key(c) not in self.out.results and _key(c) not in self.out.failed
                 and (uri is None or u == uri)]
        return open_[0] if open_ else None

    def __call__(self, ev: Evaluation) -> None:
        c = self._claim_for(ev.checkpoint)
        if c is None:
            return  # a record for a checkpoint already done (re-read), or not ours
        now, key = time.time(), _key(c)
        try:
            metrics = valid_metrics(ev.metrics)
        except OrbitError as exc:
            _fail(self.out, self.give_back, c, str(exc))
        else:
            _finish(self.ledger, c, metrics, self.instance, self.run_id, now - self.since)
            self.out.results[key] = {"checkpoint_key": key, "suite": c.suite, "metrics": metrics,
                                     "seconds": now - self.since, "instance_id": self.instance.instance_id,
                                     "state": "SUCCEEDED", "already": False, "finished_at": now}
            self.reporter.log(f"evaluated {key} ({c.suite}): {metrics}")
        self.since = now
        nxt = self._claim_for(None)
        if nxt is not None:  # its clock starts now, not when the batch was claimed (the stale check reads it)
            with self.ledger.write() as tx:
                tx.execute("UPDATE evaluations SET started_at = ? WHERE checkpoint_key = ? AND suite = ? "
                           "AND state = 'RUNNING'", [utcnow(), _key(nxt), nxt.suite])


def _follow(provider: Provider, handle, on_result, *, poll_s: float, timeout_s: float) -> RunStatus:
    offset = 0
    deadline = time.time() + timeout_s
    while True:
        events, offset = provider.read_events(handle, offset)
        status = provider.status(handle)
        if status.state in ("exited", "lost"):
            more, offset = provider.read_events(handle, offset)
            events += more
        for ev in events:
            if isinstance(ev, Evaluation):
                on_result(ev)
        if status.state in ("exited", "lost"):
            return status
        if time.time() > deadline:
            return RunStatus(state="exited", exit_code=None, failure_class="infrastructure",
                             reason=f"evaluation timed out after {timeout_s:.0f} s")
        time.sleep(poll_s)


def _finish(ledger: Ledger, claim, metrics: dict, instance: InstanceHandle, dagster_run_id: str | None,
            seconds: float) -> None:
    ckpt, suite, key, now = claim.checkpoint, claim.suite, _key(claim), utcnow()
    with ledger.write() as tx:
        tx.insert("metric_points", [{
            "job_id": ckpt["job_id"], "experiment": ckpt["experiment"], "run_id": f"eval:{key}:{suite}",
            "checkpoint_key": key, "suite": suite, "step": int(ckpt["step"]), "name": name, "value": float(value),
            "source": "eval", "ts": now} for name, value in metrics.items()])
        tx.execute("""UPDATE evaluations SET state = 'SUCCEEDED', metrics = ?, instance_id = ?, dagster_run_id = ?,
                      seconds = ?, finished_at = ?, reason = NULL WHERE checkpoint_key = ? AND suite = ?""",
                   [R.dumps(metrics), instance.instance_id, dagster_run_id, seconds, now, key, suite])


def shared_lines(ledger: Ledger, instance_id: str) -> list[tuple]:
    """(result time, key) of the evaluations an instance finished: what its seconds bought."""
    return [(as_datetime(r["finished_at"]), r["checkpoint_key"]) for r in ledger.rows(
        """SELECT finished_at, checkpoint_key FROM evaluations WHERE instance_id = ? AND state = 'SUCCEEDED'
           ORDER BY finished_at""", [instance_id])]


def _release(settings: Settings, ledger: Ledger, provider: Provider, instance: InstanceHandle, todo: list,
             out: BatchOutcome) -> None:
    """Stop the meter; each evaluated checkpoint gets its seconds, the rest the first unfinished."""
    done = shared_lines(ledger, instance.instance_id)
    open_ = [_key(c) for c in todo if _key(c) not in out.results]
    rest = open_[0] if open_ else (done[-1][1] if done else _key(todo[0]))
    release(settings, ledger, provider, instance, job_id=todo[0].checkpoint["job_id"], run_id=None, attempt=0,
            checkpoints=done, lost=False, last_progress=None, reason="evaluation ended", purpose="eval",
            eval_checkpoint=rest, suite=todo[0].suite)
    for row in ledger.rows("""SELECT checkpoint_key, sum(usd) AS usd FROM costs WHERE instance_id = ?
                              GROUP BY checkpoint_key""", [instance.instance_id]):
        if row["checkpoint_key"] in out.results:
            out.results[row["checkpoint_key"]]["usd"] = float(row["usd"] or 0.0)
