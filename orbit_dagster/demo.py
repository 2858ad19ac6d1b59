"""`orbit demo`: the example job through a real Dagster instance on the embedded sim market."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from .control.settings import Settings
from .control.submit import submit
from .core.errors import OrbitError
from .instance import Daemon, daemon_alive, ensure_dagster_home, wait_until_idle
from .ledger import records as R

TEMPLATE = "charlm-finetune"


@dataclass
class Progress:
    state: str
    step: int
    checkpoints: int
    evaluations: int
    best_done: bool

    @property
    def finished(self) -> bool:
        if self.state in ("FAILED", "CANCELLED"):
            return True
        return self.state == "SUCCEEDED" and self.evaluations >= self.checkpoints and self.best_done


def progress(ledger, job_id: str, experiment: str) -> Progress:
    row = R.require_job(ledger, job_id)
    stats = ledger.rows(
        """SELECT (SELECT coalesce(max(step), 0) FROM metric_points WHERE job_id = ? AND source = 'train') AS step,
                  (SELECT count(*) FROM live_checkpoints WHERE job_id = ?) AS checkpoints,
                  (SELECT count(*) FROM evaluations e SEMI JOIN live_checkpoints c USING (checkpoint_key)
                    WHERE e.job_id = ?) AS evaluations,
                  (SELECT max(evaluations) FROM current_best WHERE experiment = ?) AS best_evals,
                  (SELECT count(*) FROM evaluations e JOIN owners o USING (job_id) WHERE o.experiment = ?) AS all_evals""",
        [job_id, job_id, job_id, experiment, experiment],
    )[0]
    best_done = stats["best_evals"] is not None and stats["best_evals"] >= stats["all_evals"]
    return Progress(row["state"], int(stats["step"]), int(stats["checkpoints"]), int(stats["evaluations"]), best_done)


def run_demo(settings: Settings, *, overrides: dict | None = None, experiment: str | None = None,
             timeout_s: float = 1800, on_progress=None) -> dict:
    """Submit the example, let the daemon's sensors drive it, wait for training, evaluations
    and the best checkpoint, and return the summary."""
    ensure_dagster_home(settings)
    experiment = experiment or f"demo-{uuid.uuid4().hex[:6]}"
    daemon = None if daemon_alive(settings) else Daemon(settings).start()
    try:
        job_id = submit(settings, TEMPLATE, overrides or {}, experiment=experiment)
        ledger = settings.ledger()
        deadline = time.time() + timeout_s
        while True:
            p = progress(ledger, job_id, experiment)
            if on_progress:
                on_progress(job_id, p)
            if p.finished:
                break
            if time.time() > deadline:
                raise OrbitError(f"demo job {job_id} did not finish within {timeout_s:.0f} s (state {p.state})",
                                 fix=f"look at `orbit status {job_id}` and `orbit logs {job_id}`")
            time.sleep(1.0)
        if daemon is not None:
            wait_until_idle(settings)  # let the follow-up runs (cost summary) finish first
    finally:
        if daemon is not None:
            daemon.stop()
    return summary(settings, job_id, experiment)


def summary(settings: Settings, job_id: str, experiment: str) -> dict:
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    best = ledger.rows("SELECT * FROM current_best WHERE experiment = ?", [experiment])
    cost = ledger.rows(
        """SELECT coalesce(sum(usd), 0) AS usd,
                  coalesce(sum(usd) FILTER (WHERE kind <> 'eval'), 0) AS train_usd,
                  coalesce(sum(seconds) FILTER (WHERE kind = 'wasted'), 0) AS wasted
           FROM costs WHERE job_id = ?""",
        [job_id],
    )[0]
    billed = ledger.rows(
        """SELECT coalesce(sum(u.seconds * u.usd_per_second), 0) AS usd, coalesce(sum(u.seconds), 0) AS seconds
           FROM instance_usage u WHERE u.job_id = ?""",
        [job_id],
    )[0]
    n_ckpts = int(ledger.scalar("SELECT count(*) FROM checkpoints WHERE job_id = ?", [job_id]) or 0)
    n_evals = int(ledger.scalar("SELECT count(*) FROM evaluations WHERE job_id = ?", [job_id]) or 0)
    b = best[0] if best else None
    return {
        "job": job_id,
        "experiment": experiment,
        "state": job["state"],
        "attempts": int(job["attempt"]),
        "jobs": 1,
        "checkpoints": n_ckpts,
        "evaluations": n_evals,
        "best_checkpoint": b["checkpoint_key"] if b else None,
        "best_metric": {"name": b["metric_name"], "value": b["metric_value"]} if b else None,
        "cost_usd": round(float(cost["usd"]), 8),
        "billed_usd": round(float(billed["usd"]), 8),
        "instance_seconds": round(float(billed["seconds"]), 3),
        "wasted_gpu_seconds": round(float(cost["wasted"]), 3),
        "ledger": str(ledger.catalog_path),
    }
