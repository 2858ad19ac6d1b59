"""The control-plane kill soak: jobs train while every process of ours is SIGKILLed at random.

`Soak` runs N jobs of one config on the embedded market through a real daemon, and at points
set by the hosts' own training progress (read from their event files, which go on while the
control plane is dead) SIGKILLs, by a seeded draw: a run worker, the code server, the
Dagster daemon, the supervisor's process group, the whole control plane at once (a reboot
of the control plane's processes), the whole control plane with the hosts (a reboot of the
machine), a host's process alone (its workload left behind) or a host's process group; with
PostgreSQL (the team profile) also a PostgreSQL crash-restart. After each kill it waits a
drawn pause and starts `orbit daemon` again if none runs. Then it waits for the jobs to end
and `check()` reads what is left, independently of the code under test where it matters:
checkpoint files on disk and checkpoint events in the hosts' own files, processes in /proc.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import dagster as dg

from orbit_dagster.cli.demo import ReferenceRun
from orbit_dagster.control.submit import submit
from orbit_dagster.deploy.instance import Daemon, dagster_instance
from orbit_dagster.ledger import records as R
from orbit_dagster.settings import Settings
from tests.reliability.control_plane import (
    bill_of,
    checkpoints_on_disk,
    control_plane,
    materializations,
    processes_of,
    sigkill,
    wait_gone,
)

ACTIONS = ("run_worker", "code_server", "daemon", "supervisor_group", "control_plane", "machine", "host_process",
           "host_group")
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
# Reconcile's promise: within one interval (2 minutes) of the daemon being back, of the end.
RECONCILE_S = 120.0


@dataclass
class Kill:
    action: str
    at_progress: int
    pause_s: float
    killed: int = 0
    at: float = 0.0


@dataclass
class Soak:
    settings: Settings
    seed: int
    jobs: int = 2
    kills: int = 3
    steps: int = 160
    every: int = 80
    actions: tuple[str, ...] = ACTIONS
    pause_s: tuple[float, float] = (0.0, 8.0)
    first: str | None = "control_plane"
    restart_postgres: Callable[[], None] | None = None
    say: Callable[[str], None] = print
    job_ids: list[str] = field(default_factory=list)
    done: list[Kill] = field(default_factory=list)
    daemons_started: int = 0

    @property
    def home(self) -> Path:
        return self.settings.home

    def plan(self) -> list[Kill]:
        """The kills: first, `first` (by default the whole control plane, while the jobs train),
        then `kills` drawn from the seed, each at a share of the jobs' total training."""
        rng = random.Random(self.seed)
        total = self.jobs * self.steps
        marks = sorted(rng.uniform(0.25, 0.8) * total for _ in range(self.kills))
        actions = list(self.actions) + (["postgres"] if self.restart_postgres else [])
        drawn = [Kill(rng.choice(actions), int(m), round(rng.uniform(*self.pause_s), 1)) for m in marks]
        return ([Kill(self.first, int(0.15 * total), 3.0)] if self.first else []) + drawn

    # ---- what the hosts did (their own files, not the ledger) -------------------------
    def _host_events(self) -> list[dict]:
        """Every event line the hosts wrote, each with the job and purpose its instance was rented
        for (from the instance's own spec)."""
        out = []
        for root in (self.home / "sim" / "instances").glob("*"):
            path = root / "work" / "artifacts" / "events.jsonl"
            if not path.is_file():
                continue
            try:
                tags = json.loads((root / "instance.json").read_text()).get("tags") or {}
            except (OSError, ValueError):
                tags = {}
            for line in path.read_text(errors="replace").splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill
                if isinstance(ev, dict):
                    out.append({**ev, "_job": tags.get("orbit/job"), "_attempt": tags.get("orbit/attempt")})
        return out

    def host_progress(self) -> int:
        """Steps trained on all hosts together (each instance's highest step, summed)."""
        best: dict[str, int] = {}
        # Each sim instance keeps its host workspace in <instance>/work (providers/sim/host.py).
        events = (inst / "work" / "artifacts" / "events.jsonl" for inst in (self.home / "sim" / "instances").glob("*"))
        for path in (e for e in events if e.is_file()):
            top = 0
            for line in path.read_text(errors="replace").splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev.get("step"), int):
                    top = max(top, ev["step"])
            best[str(path)] = top
        return sum(best.values())

    def host_checkpoints(self) -> set[str]:
        """The checkpoints the hosts say they wrote (a store URI ends `<job>/<checkpoint dir>`)."""
        return {R.checkpoint_key(str(ev["uri"]).rstrip("/").split("/")[-2], int(ev["attempt"]), int(ev["step"]))
                for ev in self._host_events() if ev.get("type") == "checkpoint" and ev.get("uri")}

    # ---- the control plane ------------------------------------------------------------
    def ensure_daemon(self) -> None:
        if not any(p.kind == "supervisor" for p in control_plane(self.home)):
            Daemon(self.settings, say=self.say).start()
            self.daemons_started += 1

    def victims(self, action: str, rng: random.Random) -> tuple[list, bool]:
        procs = [p for p in processes_of(self.home) if p.kind != "reference"]
        of = lambda *kinds: [p for p in procs if p.kind in kinds]  # noqa: E731
        pick = lambda ps: [rng.choice(ps)] if ps else []  # noqa: E731
        if action == "run_worker":
            return pick(of("run_worker")), False
        if action == "code_server":
            return of("code_server"), False
        if action == "daemon":
            return of("daemon"), False
        if action == "supervisor_group":
            return of("supervisor"), True
        if action == "control_plane":
            return [p for p in procs if p.kind not in ("host", "agent")], True
        if action == "machine":
            return procs, True
        if action == "host_process":
            return pick(of("host")), False
        if action == "host_group":
            return pick(of("host")), True
        raise ValueError(action)

    def kill(self, k: Kill, rng: random.Random) -> None:
        if k.action == "postgres":
            self.restart_postgres()
            k.killed = 1
        else:
            deadline = time.time() + 60  # e.g. no host runs while the control plane relaunches
            while not self.victims(k.action, random.Random(0))[0] and time.time() < deadline:
                self.ensure_daemon()
                time.sleep(0.5)
            procs, groups = self.victims(k.action, rng)
            if k.action == "machine":  # every process at once, hosts by their groups
                pids = sigkill([p for p in procs if p.kind == "host"], self.home, groups=True)
                pids += sigkill([p for p in procs if p.kind != "host"], self.home, groups=False)
            elif k.action in ("host_process", "host_group"):
                pids = sigkill(procs, self.home, groups=k.action == "host_group")
            else:
                pids = sigkill(procs, self.home, groups=groups)
            wait_gone(pids)
            k.killed = len(pids)
        k.at = time.time()
        self.say(f"soak: {k.action} at host progress {self.host_progress()}: {k.killed} killed; "
                 f"pause {k.pause_s} s")
        time.sleep(k.pause_s)
        self.ensure_daemon()

    def run(self, timeout_s: float = 1500.0) -> None:
        rng = random.Random(self.seed + 1)
        overrides = {"config.steps": self.steps, "checkpoint.every_steps": self.every,
                     "checkpoint.interval_policy": "fixed"}
        self.ensure_daemon()
        self.job_ids = [submit(self.settings, "charlm-finetune", overrides, experiment="soak")
                        for _ in range(self.jobs)]
        reference = ReferenceRun(self.settings, self.job_ids[0]).start()
        deadline = time.time() + timeout_s
        ledger = self.settings.ledger()
        for k in self.plan():
            while self.host_progress() < k.at_progress and not self.ended(ledger):
                assert time.time() < deadline, f"soak: no progress to {k.at_progress} steps"
                self.ensure_daemon()
                time.sleep(0.5)
            if self.ended(ledger):
                break
            self.kill(k, rng)
            self.done.append(k)
        while not self.settled(ledger):
            assert time.time() < deadline, f"soak: jobs not settled: {self.states(ledger)}"
            self.ensure_daemon()
            time.sleep(1.0)
        self.reference = reference.weights()

    def states(self, ledger) -> dict[str, str]:
        return {j: R.require_job(ledger, j)["state"] for j in self.job_ids}

    def ended(self, ledger) -> bool:
        return all(s in TERMINAL for s in self.states(ledger).values())

    def settled(self, ledger) -> bool:
        """Jobs ended, their evaluations done, no run in progress."""
        if not self.ended(ledger):
            return False
        if ledger.scalar("SELECT count(*) FROM evaluations WHERE state IN ('PENDING', 'RUNNING')"):
            return False
        with dagster_instance(self.settings) as instance:
            return not instance.get_run_records(dg.RunsFilter(statuses=[
                dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]))

    def stop(self) -> None:
        """End the daemon this soak started last (its earlier ones were killed)."""
        for p in control_plane(self.home):
            if p.kind == "supervisor":
                try:
                    os.killpg(p.pgid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 40
        while time.time() < deadline and any(p.kind == "supervisor" for p in control_plane(self.home)):
            time.sleep(0.5)

    # ---- the outcome --------------------------------------------------------------------
    def check(self) -> dict:
        """What is left, as a table row; raises on the first broken promise."""
        ledger = self.settings.ledger()
        states = self.states(ledger)
        assert all(s == "SUCCEEDED" for s in states.values()), states
        with dagster_instance(self.settings) as instance:
            counts = materializations(instance, "checkpoint")
        # An attempt rents one instance, whoever races for it (a launch run's successor, a re-attach).
        relaunched = {r["run_id"]: r["n"] for r in ledger.rows(
            """SELECT run_id, count(*) AS n FROM instances WHERE purpose = 'train' AND job_id IN ({})
               GROUP BY run_id HAVING count(*) > 1""".format(", ".join("?" for _ in self.job_ids)), self.job_ids)}
        duplicated = {k: n for k, n in counts.items() if n > 1}
        lost, billed_off = [], []
        for job in self.job_ids:
            registered = {r["checkpoint_key"]: r for r in R.checkpoints(ledger, job, live_only=False)}
            live = {k for k, r in registered.items() if r["deleted_at"] is None}
            on_disk = checkpoints_on_disk(self.settings, job)
            lost += sorted(on_disk - set(registered)) + sorted(live - on_disk)
            attributed, billed = bill_of(ledger, job)
            if round(attributed, 2) != round(billed, 2) or abs(attributed - billed) > 1e-9:
                billed_off.append((job, attributed, billed))
        written = {k for k in self.host_checkpoints() if k.split("/", 1)[0] in self.job_ids}
        all_keys = {r["checkpoint_key"] for job in self.job_ids for r in R.checkpoints(ledger, job, live_only=False)}
        lost += sorted(written - all_keys)
        finals = {r["job_id"]: r["weights_sha256"] for r in ledger.rows(
            """SELECT c.job_id, c.weights_sha256 FROM checkpoints c WHERE c.job_id IN ({})
               AND c.step = (SELECT max(step) FROM checkpoints x WHERE x.job_id = c.job_id)""".format(
                ", ".join("?" for _ in self.job_ids)), self.job_ids)}
        late = {}
        for job in self.job_ids:  # the end recorded within the reconcile interval of the workload's exit
            ended = float(R.require_job(ledger, job)["state_at"])
            exits = [float(ev["ts"]) for ev in self._host_events() if ev.get("type") == "exit"
                     and ev["_job"] == job and ev.get("_attempt") not in (None, "0") and isinstance(ev.get("ts"), (int, float))]
            exited = max((t for t in exits if t <= ended + 1), default=ended)
            if ended - exited > RECONCILE_S:
                late[job] = round(ended - exited, 1)
        running = ledger.scalar("SELECT count(*) FROM instances WHERE stopped_at IS NULL")
        left = [p for p in processes_of(self.home) if p.kind in ("host", "agent")]
        assert not duplicated, f"checkpoints reported more than once: {duplicated}"
        assert not relaunched, f"attempts launched more than once: {relaunched}"
        assert not lost, f"checkpoints lost: {lost}"
        assert not billed_off, f"attributed != billed: {billed_off}"
        assert running == 0 and not left, (running, left)
        assert not late, f"ended later than the reconcile interval after the workload's exit: {late}"
        assert self.reference is not None and set(finals.values()) == {self.reference}, (finals, self.reference)
        return {
            "jobs": len(self.job_ids), "kills": len(self.done),
            "actions": ", ".join(k.action for k in self.done), "daemon_starts": self.daemons_started,
            "attempts": int(ledger.scalar("SELECT coalesce(sum(attempt), 0) FROM jobs WHERE job_id IN ({})".format(
                ", ".join("?" for _ in self.job_ids)), self.job_ids)),
            "checkpoints": len(all_keys), "stuck": 0, "lost": 0, "duplicated": 0, "left_running": 0,
            "attributed_eq_billed": True, "bit_identical": True,
        }
