"""The log of an attempt: the workload's (live from the host while it runs, collected after),
preceded by what the control plane recorded about the attempt (its states and reasons), so
an attempt that never launched still says why."""
from __future__ import annotations

import json
from datetime import datetime, timezone

from ..core.errors import NotFound
from ..ledger import records as R
from ..providers.base import RunHandle
from ..settings import Settings
from .context import bundle_and_provider


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(float(ts), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if ts else "-"


def attempt_history(settings: Settings, job_id: str, attempt: int) -> list[str]:
    """The attempt's state changes and the control plane's events about it, oldest first."""
    ledger = settings.ledger()
    lines = [f"{_when(r['ts'])}  {r['state']:<11} {r['failure_class'] or '':<14} {r['reason'] or ''}".rstrip()
             for r in ledger.rows("SELECT ts, state, failure_class, reason FROM job_states WHERE job_id = ? AND attempt = ? "
                                  "ORDER BY id", [job_id, attempt])]
    for r in ledger.rows("""SELECT ts, kind, detail FROM events WHERE job_id = ? AND kind IN
                            ('dispatch_failed', 'dispatch_abandoned', 'checkpoint_rejected', 'checkpoint_unusable',
                             'release_failed', 'launched') ORDER BY ts""", [job_id]):
        detail = json.loads(r["detail"] or "{}")
        if detail.get("attempt") not in (None, attempt) and r["kind"] != "launched":
            continue
        shown = detail.get("reason") or detail.get("offer") or ""
        lines.append(f"{_when(r['ts'])}  {r['kind']:<11} {shown}".rstrip())
    return lines


def attempt_ending(settings: Settings, job_id: str, attempt: int) -> str:
    """How the attempt ended, from its last recorded state: `LOST (reclaim): reason`, or
    `RUNNING (still going)` for one that has not ended."""
    last = settings.ledger().one("SELECT state, failure_class, reason FROM job_states WHERE job_id = ? AND attempt = ? "
                                 "ORDER BY id DESC LIMIT 1", [job_id, attempt])
    if last is None:
        return "no state recorded"
    state = last["state"]
    if state in ("QUEUED", "DISPATCHING", "RUNNING", "CREATED"):
        return f"{state} (still going)"
    why = f" ({last['failure_class']})" if last["failure_class"] else ""
    return f"{state}{why}" + (f": {last['reason']}" if last["reason"] else "")


def job_log(settings: Settings, job_id: str, attempt: int | None = None, tail: int = 200) -> str:
    """Every attempt's log, oldest first, each headed by how it ended (`attempt`: that one only)."""
    job = R.require_job(settings.ledger(), job_id)
    attempts = [attempt] if attempt is not None else range(1, int(job["attempt"]) + 1)
    return "\n\n".join(attempt_log(settings, job_id, a, tail) for a in attempts)


def attempt_log(settings: Settings, job_id: str, attempt: int | None = None, tail: int = 200) -> str:
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    attempt = attempt or int(job["attempt"])
    if attempt < 1 or attempt > int(job["attempt"]):
        raise NotFound(f"job {job_id} has no attempt {attempt}", field="--attempt", value=attempt,
                       fix=f"attempts so far: 1..{job['attempt']}")
    header = ([f"== {job_id} attempt {attempt} of {job['attempt']}: {attempt_ending(settings, job_id, attempt)} ==",
               f"== {job_id} attempt {attempt}: control plane =="] + attempt_history(settings, job_id, attempt))
    collected = settings.artifacts_dir / job_id / f"attempt-{attempt}" / "agent.log"
    body: list[str] = []
    if collected.is_file():
        body = collected.read_text(errors="replace").splitlines()[-tail:]
    else:
        run = R.run(ledger, R.run_id_for(job_id, attempt))
        if run is not None and run["handle"]:
            _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
            body = provider.logs(RunHandle.model_validate_json(run["handle"]), tail).splitlines()
    if not body:
        body = ["(no workload log: this attempt never launched on a host)"]
    return "\n".join(header + [f"== {job_id} attempt {attempt}: workload =="] + body)
