"""`orbit demo`: the example job through a real Dagster instance on the embedded spot market.

The default scenario reclaims the job's instance twice, when its training reaches half and
three quarters of its steps (steps 100 and 150 of 200): the market operator's override
(`SimProvider.inject_reclaim(at_step=...)`), with AWS's two-minute notice scaled 60 times
to 2 s, as the market's clock runs (a trace hour per wall minute). Set by progress, not by
the wall clock, so a fast machine and a loaded one meet the same two reclaims. The
daemon's sensors do the rest: launch, follow, emergency checkpoint on notice, re-materialise
from the last checkpoint, evaluate, rank, bill. Then the final weights are compared with an
uninterrupted run of the same bundle.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..control.providers import provider_for
from ..control.submit import submit
from ..core.bundle import JobBundle
from ..core.errors import OrbitError
from ..core.host_contract import EVENTS_FILE, Checkpoint, read_file
from ..deploy.instance import Daemon, ensure_dagster_home, wait_until_idle
from ..ledger import records as R
from ..providers.base import RunHandle
from ..providers.sim.market import MarketConfig, ensure_market, write_market
from ..settings import Settings, environment

TEMPLATE = "charlm-finetune"
SCALE = 60.0  # market seconds per wall second: a trace hour per wall minute
NOTICE_S = 120.0  # AWS's notice, in market seconds: 2 s of wall time at SCALE
# Where the two reclaims come, as shares of the job's steps: each attempt but the last is
# reclaimed once (the second resumes from the first's emergency checkpoint, past 1/2).
RECLAIM_AT = (0.5, 0.75)


@dataclass
class Progress:
    state: str
    attempt: int
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
    stats = ledger.one(
        """SELECT (SELECT coalesce(max(step), 0) FROM metric_points WHERE job_id = ? AND source = 'train') AS step,
                  (SELECT count(*) FROM checkpoints WHERE job_id = ? AND deleted_at IS NULL) AS checkpoints,
                  (SELECT count(*) FROM evaluations e JOIN checkpoints c ON c.checkpoint_key = e.checkpoint_key
                   WHERE e.job_id = ? AND c.deleted_at IS NULL
                     AND e.state IN ('SUCCEEDED', 'FAILED', 'SKIPPED')) AS evaluations,
                  (SELECT count(*) FROM evaluations WHERE experiment = ? AND state IN ('PENDING', 'RUNNING')) AS pending,
                  (SELECT max(evaluations) FROM current_best WHERE experiment = ?) AS best_evals,
                  (SELECT count(*) FROM evaluations WHERE experiment = ? AND state = 'SUCCEEDED') AS all_evals""",
        [job_id, job_id, job_id, experiment, experiment, experiment],
    )
    best_done = stats["best_evals"] is not None and stats["best_evals"] >= stats["all_evals"] and not stats["pending"]
    return Progress(row["state"], int(row["attempt"]), int(stats["step"]), int(stats["checkpoints"]),
                    int(stats["evaluations"]), best_done)


def run_demo(settings: Settings, *, overrides: dict | None = None, experiment: str | None = None,
             reclaims: bool = True, timeout_s: float = 1800, on_progress=None) -> dict:
    """Submit the example, let the daemon's sensors drive it, wait for training, evaluations
    and the best checkpoint, and return the summary."""
    overrides = dict(overrides or {})
    ensure_dagster_home(settings)
    experiment = experiment or f"demo-{uuid.uuid4().hex[:6]}"
    # The market reclaims only where the demo says (for the daemon started here).
    settings = settings.with_env(ORBIT_SIM_RECLAIMS="none")
    # A daemon already running for this instance is used (saying so); otherwise one is started.
    daemon = Daemon(settings).start()
    scenario, reference = None, None
    try:
        wait_for_daemon(settings)
        job_id = submit(settings, TEMPLATE, overrides, experiment=experiment)
        if reclaims:
            scenario = Reclaims(settings, job_id, provider_for(settings, "sim_host_process"))
        # The uninterrupted reference run of the same bundle, alongside (one more CPU thread).
        reference = ReferenceRun(settings, job_id).start()
        ledger = settings.ledger()
        deadline = time.time() + timeout_s
        while True:
            p = progress(ledger, job_id, experiment)
            if on_progress:
                on_progress(job_id, p)
            if p.finished:
                break
            if scenario is not None:
                scenario.arm(p)
            if time.time() > deadline:
                raise OrbitError(f"demo job {job_id} did not finish within {timeout_s:.0f} s (state {p.state})",
                                 fix=f"look at `orbit status {job_id}` and `orbit logs {job_id}`")
            time.sleep(1.0)
        if daemon.started:
            wait_until_idle(settings, quiet_s=5.0)  # let the follow-up runs (cost summary) finish first
    finally:
        daemon.stop()  # only the one started here
        if scenario is not None:  # back to a real-time market for whatever runs next here
            old = ensure_market(settings.sim_dir, trace_dir=settings.sim.traces, scale=1.0, notice_s=NOTICE_S)
            write_market(settings.sim_dir, MarketConfig(time.time(), old.trace_offset_s, 1.0, NOTICE_S, old.traces))
    result = summary(settings, job_id, experiment)
    settings.ledger().query("SELECT count(*) AS jobs FROM jobs")  # the SQL face's first use writes ledger.duckdb
    result["bit_identical"] = bit_identical(settings, job_id, reference.weights())
    if scenario is not None:
        result["scenario"] = scenario.describe()
    return result


class Reclaims:
    """The demo's two reclaims: each attempt's instance is told, once it runs, to be reclaimed
    when its workload reports the next planned step (the notice then, the reclaim 2 s later)."""

    def __init__(self, settings: Settings, job_id: str, provider):
        self.settings, self.job_id, self.provider = settings, job_id, provider
        bundle = JobBundle.load(R.bundle_for(settings.ledger(), job_id, 1)["path"], verify=False)
        steps = int(bundle.spec.template.config["steps"])
        self.steps = [int(steps * share) for share in RECLAIM_AT]
        self.armed: list[dict] = []
        self.notice_wall_s = NOTICE_S / SCALE
        market = ensure_market_for_demo(settings)
        self.market_scale = market.scale

    def arm(self, p: Progress) -> None:
        """Arm the next reclaim on the attempt now running (at most one per attempt)."""
        i = len(self.armed)
        if i >= len(self.steps) or p.state != "RUNNING" or p.attempt != i + 1:
            return
        run = R.run(self.settings.ledger(), R.run_id_for(self.job_id, p.attempt))
        if not run or run["state"] != "RUNNING" or not run["handle"]:
            return
        instance = RunHandle.model_validate_json(run["handle"]).instance
        self.provider.inject_reclaim(instance, at_step=self.steps[i], notice_seconds=self.notice_wall_s)
        self.armed.append({"attempt": p.attempt, "instance": instance.instance_id, "at_step": self.steps[i]})

    def describe(self) -> dict:
        return {"reclaims_at_steps": self.steps, "notice_wall_s": self.notice_wall_s, "scale": self.market_scale,
                "armed": self.armed}


def ensure_market_for_demo(settings: Settings) -> MarketConfig:
    """The market clock restarted now at the demo's speed (prices replay 60 times faster)."""
    old = ensure_market(settings.sim_dir, trace_dir=settings.sim.traces, scale=SCALE, notice_s=NOTICE_S)
    return write_market(settings.sim_dir, MarketConfig(time.time(), old.trace_offset_s, SCALE, NOTICE_S, old.traces))


def wait_for_daemon(settings: Settings, timeout_s: float = 120.0) -> None:
    """The market clock restarts only once the daemon's sensors are ticking (saying so meanwhile)."""
    from ..deploy.instance import wait_for_daemon as wait
    from ..deploy.services import say

    wait(settings, timeout_s=timeout_s, say=say)


class ReferenceRun:
    """An uninterrupted run of the job's first bundle on this machine, outside the market."""

    def __init__(self, settings: Settings, job_id: str):
        self.bundle = Path(R.bundle_for(settings.ledger(), job_id, 1)["path"])
        self.tmp = tempfile.TemporaryDirectory(prefix="orbit-reference-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ReferenceRun":
        env = {**environment(), "PYTHONPATH": str(self.bundle / "runtime"), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "orbit_dagster.runtime.agent", str(self.bundle),
                                      "--workdir", self.tmp.name, "--store", (Path(self.tmp.name) / "store").as_uri()],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def weights(self) -> str | None:
        if self.proc is None or self.proc.wait() != 0:
            return None
        entries, _ = read_file(Path(self.tmp.name) / "artifacts" / EVENTS_FILE, 0, limit=1 << 30)
        checkpoints = [e for e in entries if isinstance(e, Checkpoint)]  # through the host contract's reader
        self.tmp.cleanup()
        return checkpoints[-1].weights_sha256 if checkpoints else None


def bit_identical(settings: Settings, job_id: str, reference: str | None) -> bool | None:
    final = settings.ledger().one(
        "SELECT weights_sha256 FROM checkpoints WHERE job_id = ? ORDER BY step DESC, attempt DESC LIMIT 1", [job_id])
    if not final or reference is None or R.require_job(settings.ledger(), job_id)["state"] != "SUCCEEDED":
        return None
    return final["weights_sha256"] == reference


def summary(settings: Settings, job_id: str, experiment: str) -> dict:
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    best = ledger.one("SELECT * FROM current_best WHERE experiment = ?", [experiment])
    cost = ledger.one(
        """SELECT coalesce(sum(usd), 0) AS usd,
                  coalesce(sum(CASE WHEN kind = 'wasted' THEN seconds * gpu_count END), 0) AS wasted
           FROM costs WHERE job_id = ?""", [job_id])
    billed = ledger.one(
        """SELECT coalesce(sum(billed_usd), 0) AS usd, coalesce(sum(stopped_at - started_at), 0) AS seconds
           FROM instances WHERE job_id = ? AND stopped_at IS NOT NULL""", [job_id])
    attempts = ledger.rows(
        """SELECT r.attempt, r.resume_from, r.state,
                  (SELECT max(step) FROM metric_points m WHERE m.run_id = r.run_id) AS last_step
           FROM runs r WHERE r.job_id = ? ORDER BY r.attempt""", [job_id])
    steps = {r["checkpoint_key"]: r["step"] for r in ledger.rows(
        "SELECT checkpoint_key, step FROM checkpoints WHERE job_id = ?", [job_id])}
    lost_steps = 0
    for prev, nxt in zip(attempts, attempts[1:]):
        if prev["state"] == "LOST":
            resumed = steps.get(nxt["resume_from"], 0)
            lost_steps += max(0, int(prev["last_step"] or 0) - resumed)
    counts = ledger.one(
        """SELECT (SELECT count(*) FROM checkpoints WHERE job_id = ?) AS checkpoints,
                  (SELECT count(*) FROM checkpoints WHERE job_id = ? AND tier = 'emergency') AS emergency,
                  (SELECT count(*) FROM evaluations WHERE job_id = ? AND state = 'SUCCEEDED') AS evaluations""",
        [job_id, job_id, job_id])
    return {
        "job": job_id,
        "experiment": experiment,
        "state": job["state"],
        "attempts": int(job["attempt"]),
        "jobs": 1,
        "checkpoints": int(counts["checkpoints"]),
        "emergency_checkpoints": int(counts["emergency"]),
        "evaluations": int(counts["evaluations"]),
        "best_checkpoint": best["checkpoint_key"] if best else None,
        "best_metric": {"name": best["metric_name"], "value": best["metric_value"]} if best else None,
        "interruptions": R.interruptions(ledger, job_id),
        "recovered": sum(1 for prev, nxt in zip(attempts, attempts[1:]) if prev["state"] == "LOST" and nxt["resume_from"]),
        "lost_steps": lost_steps,
        "wasted_gpu_seconds": round(float(cost["wasted"]), 3),
        "cost_usd": round(float(cost["usd"]), 8),
        "billed_usd": round(float(billed["usd"]), 8),
        "instance_seconds": round(float(billed["seconds"]), 3),
        "ledger": ledger.display,
    }
