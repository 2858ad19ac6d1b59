"""Drive one job through a placed segment of a real trace on the embedded market, and read
back what happened on the trace's clock (tests/integration/test_policy_replay.py).

The driver plays the part the Dagster sensors play, without Dagster: it launches each
queued attempt with `run_attempt` once the zone has capacity (the sensor would retry a
dispatch until it does; the replay's job waits for free), and while an attempt runs it asks
`consider_migrations` every decision tick (the price sensor's door: a rising risk or a
deadline that needs on-demand). Everything below it is the product: dispatch and its
policies, the sim market's host processes, the agent, the checkpoint store, the ledger.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from orbit_dagster.catalog import PROVIDER_NOTICE_S
from orbit_dagster.catalog.reclaim_model import load_reclaim_model
from orbit_dagster.catalog.trace_market import trace_market
from orbit_dagster.catalog.trace_market import trace_offer as market_offer
from orbit_dagster.catalog.traces import Trace, load_trace, next_available, reclaim_offsets
from orbit_dagster.control import attempt as attempt_module
from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.migration import consider_migrations
from orbit_dagster.control.observations import measured_step_seconds
from orbit_dagster.control.placement import measured_save_seconds
from orbit_dagster.control.providers import using
from orbit_dagster.control.submit import submit
from orbit_dagster.core.errors import OrbitError
from orbit_dagster.core.offers import Offer
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.sim.market import MarketConfig, TraceReclaims, load_traces_for, read_market, write_market
from orbit_dagster.providers.sim.provider import SimProvider
from orbit_dagster.settings import Settings
from tests.launch_replay import Launch, Move, Tick

WORKLOAD = Path(__file__).parent / "paced_workload"
TEMPLATE = "replay-paced"
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
# A decision tick reads the work done from the ledger, which the follow loop writes every 2 s:
# the tick records what it read and decides in one go, never between a read and a write.
LEDGER_VIEW = threading.Lock()


def trace_offer(trace: Trace, *, at_s: float = 0.0) -> Offer:
    """The offer a trace was measured on, as the sim market rents it (``catalog.trace_market.
    trace_offer``): one instance of the zone whose replay `place_segment` positions."""
    model = load_reclaim_model()
    market = trace_market(trace, default_spot_usd_per_hour=model.spot_usd_per_hour,
                          default_on_demand_usd_per_hour=model.on_demand_usd_per_hour)
    return market_offer(trace, market, at_s=at_s, provider="sim",
                        offer_id=f"sim:{market.instance_type or 'unknown'}:{market.zone or 'zone'}")


def place_segment(sim_dir: Path, *, trace_path: str, offer: Offer, at_s: float, scale: float,
                  notice_s: float = PROVIDER_NOTICE_S["aws"]) -> MarketConfig:
    """Restart the market clock with one trace only, and `offer`'s zone at trace second `at_s`
    now: from here on the zone is up, down and reclaimed exactly when the trace says,
    `scale` times faster than the wall clock (the notice too). A replay of a chosen segment,
    for comparing the control plane with `orbit simulate` on the same stretch of trace."""
    if not scale > 0:
        raise OrbitError("sim market scale must be > 0", field="scale", value=scale, fix="e.g. 60 or 180")
    trace = load_traces_for((str(trace_path),))[0]
    if not 0 <= at_s < trace.duration_s:
        raise OrbitError(f"segment start {at_s} s is outside the trace ({trace.duration_s:.0f} s)", field="at_s",
                         value=at_s, fix="pass a trace second inside the trace")
    config = MarketConfig(epoch_wall=time.time(), trace_offset_s=0.0, scale=scale, notice_s=notice_s,
                          traces=(str(trace_path),), zone_offsets={offer.offer_id: at_s})
    return write_market(sim_dir, config)


def serialise_metric_flushes(monkeypatch) -> None:
    """Make the follow loop's metric flush wait for a tick in progress (LEDGER_VIEW)."""
    flush = attempt_module.AttemptMonitor.flush_metrics

    def locked(self) -> None:
        with LEDGER_VIEW:
            flush(self)

    monkeypatch.setattr(attempt_module.AttemptMonitor, "flush_metrics", locked)


def paced_template(dest: Path, *, steps: int, step_seconds: float, name: str = TEMPLATE,
                   checkpoint: str = "every_steps: 10000000, memory_every_steps: 10000000, interval_policy: orbit",
                   tail_seconds: float = 0.0, allow_overrides: str = "deadline_hours") -> str:
    """A template for the paced workload: by default the `orbit` interval policy decides alone
    (the template's cadence is out of its way), and many interruptions are allowed."""
    path = dest / f"{name}.yaml"
    path.write_text(f"""name: {name}
workload: {WORKLOAD}
entrypoint: train.py
eval: null
placement: sim
launch_mode: host_process
resources: {{gpu: any, gpu_count: 1, cpu_threads: 1}}
checkpoint: {{{checkpoint}, store: fs, keep_latest: 1000}}
max_interruptions: 1000
config: {{steps: {steps}, step_seconds: {step_seconds}, seed: 7, tail_seconds: {tail_seconds}}}
allow_overrides: [{allow_overrides}]
""")
    return str(path)


@dataclass
class SegmentRun:
    """One job on one placed segment: the settings of its own home, its market and offer."""

    settings: Settings
    trace_path: str
    offer: Offer
    at_s: float  # trace second of the zone when the market clock restarts
    scale: float
    tick_wall_s: float  # how often the driver asks consider_migrations (wall seconds)
    margin_wall_s: float  # do not dispatch into an up-run that ends sooner than this
    job_id: str | None = None
    market: MarketConfig | None = None
    attempts: list = field(default_factory=list)
    migrations: list = field(default_factory=list)
    tick_calls: list = field(default_factory=list)  # each consider_migrations call: what the ledger knew

    @property
    def trace(self) -> Trace:
        return load_trace(self.trace_path)

    def provider_factory(self, settings: Settings) -> SimProvider:
        """The sim provider `control/providers.py` builds, renting this one offer only (so
        that every attempt lands on the placed zone, as the replay's job does)."""
        config = read_market(settings.sim_dir)
        return SimProvider(settings.sim_dir, offers=[self.offer], schedule=TraceReclaims(config),
                           notice_seconds=config.notice_wall_s, market=config)

    def trace_time(self, wall: float) -> float:
        assert self.market is not None
        return self.at_s + (wall - self.market.epoch_wall) * self.scale

    def wall_time(self, trace_s: float) -> float:
        assert self.market is not None
        return self.market.epoch_wall + (trace_s - self.at_s) / self.scale

    def start(self, template: str, overrides: dict) -> None:
        self.market = place_segment(self.settings.sim_dir, trace_path=self.trace_path, offer=self.offer,
                                    at_s=self.at_s, scale=self.scale)
        self.job_id = submit(self.settings, template, overrides, experiment="replay")

    def wait_for_capacity(self, deadline_wall: float) -> None:
        """Sleep until the zone is up and stays up for at least the margin (never dispatch into
        the last instants of an up-run: that race is the driver's, not the policy's)."""
        trace = self.trace
        while time.time() < deadline_wall:
            t = self.trace_time(time.time())
            up = next_available(trace, t)
            if up is None:
                raise AssertionError("the segment ran past the end of the trace")
            if up <= t:
                left = reclaim_offsets(trace, t, trace.duration_s)
                if not left or left[0] / self.scale >= self.margin_wall_s:
                    return
                up = t + left[0] + trace.gap_seconds  # skip this up-run
                up = next_available(trace, up) or up
            time.sleep(max(0.02, min(self.wall_time(up) - time.time() + 0.01, 1.0)))
        raise AssertionError(f"job {self.job_id}: no capacity before the time limit")

    def drive(self, timeout_s: float) -> str:
        """Run the job to its end; its final state."""
        with using({"sim_host_process": self.provider_factory}):
            return self._drive(time.time() + timeout_s)

    def _drive(self, deadline_wall: float) -> str:
        ledger = self.settings.ledger()
        while True:
            job = R.require_job(ledger, self.job_id)
            if job["state"] in FINAL:
                return job["state"]
            if time.time() > deadline_wall:
                raise AssertionError(f"job {self.job_id} still {job['state']} at the time limit")
            if job["state"] == "QUEUED" and not self._standby(ledger, job):
                self.wait_for_capacity(deadline_wall)
            stop = threading.Event()
            ticker = threading.Thread(target=self._ticks, args=(stop,), daemon=True)
            ticker.start()
            try:
                self.attempts.append(run_attempt(self.settings, self.job_id, poll_s=0.05))
            finally:
                stop.set()
                ticker.join(30)

    def _standby(self, ledger, job) -> bool:
        """A migration provisioned the next attempt's instance already: launch at once."""
        return bool(ledger.scalar("""SELECT count(*) FROM instances WHERE job_id = ? AND run_id = ?
                                     AND stopped_at IS NULL""", [job["job_id"], R.run_id_for(job["job_id"],
                                                                                           int(job["attempt"]))]))

    def _ticks(self, stop: threading.Event) -> None:
        # A thread of its own: the provider factory is a context variable, set again here.
        with using({"sim_host_process": self.provider_factory}):
            ledger = self.settings.ledger()
            while not stop.wait(self.tick_wall_s):
                with LEDGER_VIEW:
                    now = time.time()
                    job = R.require_job(ledger, self.job_id)
                    known = ledger.scalar("""SELECT max(step) FROM metric_points WHERE run_id = ?
                                             AND source = 'train'""", [R.run_id_for(self.job_id, int(job["attempt"]))])
                    self.tick_calls.append(Tick(at=self.trace_time(now), known_step=known,
                                                step_s=measured_step_seconds(ledger, TEMPLATE, self.scale),
                                                save_s=measured_save_seconds(ledger, TEMPLATE, self.scale)))
                    self.migrations += consider_migrations(self.settings, now=datetime.fromtimestamp(now, timezone.utc))


# ---------------------------------------------------------------- what happened, on the trace clock

def timeline(run: SegmentRun, step_seconds: float) -> dict:
    """The real run, read back from the ledger, in trace seconds: each attempt's instance,
    work start, checkpoints and decisions."""
    ledger = run.settings.ledger()
    tt = run.trace_time
    job = R.require_job(ledger, run.job_id)
    attempts = []
    for r in ledger.rows("SELECT * FROM runs WHERE job_id = ? ORDER BY attempt", [run.job_id]):
        inst = ledger.one("SELECT * FROM instances WHERE instance_id = ?", [r["instance_id"]])
        ckpts = ledger.rows("""SELECT step, tier, created_at, save_seconds FROM checkpoints WHERE run_id = ?
                               ORDER BY step""", [r["run_id"]])
        resumed = ledger.scalar("SELECT step FROM checkpoints WHERE checkpoint_key = ?", [r["resume_from"]]) or 0
        points = ledger.rows("""SELECT step, ts FROM metric_points WHERE run_id = ? AND source = 'train'
                                AND name = 'train/loss' ORDER BY step""", [r["run_id"]])
        # the first step began one pace after work started; every step keeps the pace
        work_start = min((p["ts"] - (p["step"] - resumed) * step_seconds for p in points), default=None)
        # how far behind its pace the workload's steps ran (the host's scheduling, not a
        # decision): what a loaded machine adds to a step's time on the trace clock
        lateness = max((p["ts"] - work_start - (p["step"] - resumed) * step_seconds for p in points), default=0.0)
        decided = [{"steps": int(d["chosen"]), **json.loads(d["inputs"])} for d in ledger.rows(
            """SELECT chosen, inputs FROM decisions WHERE job_id = ? AND attempt = ?
               AND kind = 'checkpoint_interval'""", [run.job_id, r["attempt"]])]
        # dispatch's (age 0), then the agent's at each durable save
        at_dispatch = [d for d in decided if d.get("decided_on") != "host"]
        on_host = sorted((d for d in decided if d.get("decided_on") == "host"), key=lambda d: d["step"])
        market = ledger.one("""SELECT chosen, inputs, ts FROM decisions WHERE job_id = ? AND attempt = ?
                               AND kind = 'spot_or_on_demand' ORDER BY ts LIMIT 1""", [run.job_id, r["attempt"]])
        notices = [json.loads(e["detail"] or "{}") for e in ledger.rows(
            "SELECT detail FROM events WHERE run_id = ? AND kind = 'host_notice'", [r["run_id"]])]
        # what control.dispatch.fleet_notices counts as a notice the ledger knows of
        notice_events = ledger.scalar("""SELECT count(*) FROM events WHERE run_id = ?
                                         AND kind IN ('notice', 'host_notice')""", [r["run_id"]])
        spec = json.loads((run.settings.sim_dir / "instances" / r["instance_id"] / "instance.json").read_text())
        attempts.append({
            "attempt": r["attempt"], "state": r["state"], "failure_class": r["failure_class"],
            "reclaim_at": None if spec.get("reclaim_at") is None else tt(spec["reclaim_at"]),
            "spot": bool(inst["spot"]), "offer": inst["offer_id"],
            "instance_start": tt(inst["started_at"]), "instance_stop": tt(inst["stopped_at"]),
            "work_start": None if work_start is None else tt(work_start), "resumed_step": resumed,
            "last_step": max((p["step"] for p in points), default=None), "lateness_s": lateness * run.scale,
            "checkpoints": [{"step": c["step"], "tier": c["tier"], "at": tt(c["created_at"] - (c["save_seconds"] or 0)),
                             "save_s": c["save_seconds"]} for c in ckpts],
            "interval": at_dispatch[0] if at_dispatch else None, "dispatch_intervals": len(at_dispatch),
            "host_intervals": on_host,
            "market": None if market is None else {"chosen": market["chosen"], "at": tt(market["ts"]),
                                                   **json.loads(market["inputs"])},
            "notices": [{"at": tt(n["received_at"]), "source": n.get("source")} for n in notices],
            "notice_recorded": bool(notice_events),
        })
    switches = [{"chosen": d["chosen"], "attempt": d["attempt"], "at": tt(d["ts"]), **json.loads(d["inputs"])}
                for d in ledger.rows("""SELECT * FROM decisions WHERE job_id = ? AND kind = 'spot_or_on_demand'
                                        ORDER BY ts""", [run.job_id])]
    moves = ledger.rows("SELECT ts, detail FROM events WHERE job_id = ? AND kind = 'migration_started' ORDER BY ts",
                        [run.job_id])
    return {"job_id": run.job_id, "state": job["state"], "submitted": tt(float(job["created_at"])),
            "step_s": step_seconds * run.scale,
            "attempts": attempts, "deadline_decisions": switches,
            "migrations": [{"at": tt(m["ts"]), **json.loads(m["detail"] or "{}")} for m in moves],
            "tick_calls": list(run.tick_calls)}


def measured_launches(tl: dict, deadline_s: float | None = None) -> tuple[list, Move | None]:
    """The replay's inputs measured from the real run: each attempt's platform timings and the
    control plane's beliefs at its dispatch, and the timings of a move to on-demand."""
    def asked(decision: dict | None) -> float | None:
        """When the control plane read the clock for a deadline decision: from the time left it computed."""
        if decision is None or deadline_s is None:
            return None
        return tl["submitted"] + deadline_s - decision["time_left_s"]

    launches = []
    for a in tl["attempts"]:
        iv = a["interval"]
        seen = [n["at"] for n in a["notices"] if n.get("source") == "metadata"]
        emergency = [c["step"] for c in a["checkpoints"] if c["tier"] == "emergency"]
        launches.append(Launch(dispatch_at=asked(a["market"]) or a["instance_start"], instance_at=a["instance_start"],
                               work_at=a["work_start"], save_s=iv["save_s"], step_s=iv["step_s"], spot=a["spot"],
                               notice_seen_at=min(seen) if seen else None, released_at=a["instance_stop"],
                               stopped_step=emergency[0] if emergency else None,
                               decision_ages={d["step"]: d["age_s"] for d in a["host_intervals"]},
                               # a host's speed, not a decision: on a loaded machine an emergency
                               # save may not be durable before the reclaim wipes the host
                               emergency_durable=bool(emergency) if a["state"] != "SUCCEEDED" else None,
                               notice_recorded=a["notice_recorded"]))
    move = None
    ticks = [d for d in tl["deadline_decisions"] if d["chosen"] == "on_demand" and d.get("holding") == "spot"]
    if ticks:
        at = asked(ticks[0])
        old = next(a for a in tl["attempts"] if a["attempt"] == ticks[0]["attempt"])
        new = next(a for a in tl["attempts"] if a["attempt"] == ticks[0]["attempt"] + 1)
        emergency = [c["at"] for c in old["checkpoints"] if c["tier"] == "emergency"]
        # SIGTERM reached the old agent one step before its emergency save began (or it stopped)
        told = emergency[0] - tl["step_s"] if emergency else old["instance_stop"]
        move = Move(emergency_after_s=told - at,
                    instance_after_s=new["instance_start"] - at, work_after_s=new["work_start"] - at,
                    dispatch_after_s=(asked(new["market"]) or new["instance_start"]) - at)
    return launches, move
