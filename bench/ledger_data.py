"""A large ledger with realistic shapes, generated deterministically for the scale benchmarks.

Shapes (full size; `Shape.quick()` divides them): 1,000 jobs in 100 experiments of 10
projects; each job 103 durable checkpoints (~100,000 in all; QUEUED jobs have none) over 1-3 attempts (reclaims),
each checkpoint evaluated by 3 suites (`eval`: eval/loss + eval/accuracy, `mmlu`:
mmlu/accuracy, `gsm8k`: gsm8k/accuracy), 4 train/loss points per checkpoint interval, one
eval instance and its bill per evaluation, bills per train instance split per checkpoint,
and 1,000,000 events spread over the real event kinds. One experiment (`exp-big`) holds
`big_share` of the jobs: the worst case of one experiment holding many checkpoints.

Job states mirror a busy fleet: 5% RUNNING, 3% QUEUED, 85% SUCCEEDED, the rest FAILED or
CANCELLED; 5% of jobs were retried from scratch (their early checkpoints belong to an old
lineage); 1% of checkpoints were deleted by retention; the newest evaluations of running
jobs are PENDING or RUNNING.

    python bench/ledger_data.py --out /tmp/big [--quick]   # writes /tmp/big/ledger/ledger.sqlite
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orbit_dagster.ledger import Ledger  # noqa: E402
from orbit_dagster.ledger.migrations import ledger_url_for  # noqa: E402

T0 = 1_767_225_600.0  # 2026-01-01 UTC: every generated time is relative to it
SUITES = {"eval": ("eval/loss", "eval/accuracy"), "mmlu": ("mmlu/accuracy",), "gsm8k": ("gsm8k/accuracy",)}
# Event kinds the code writes, with the weight of each in the generated history. `host_probe`
# is not among them: the agent probes an offer once (see PROBES).
EVENT_KINDS = {
    "host_started": 14, "host_resumed": 8, "launched": 10, "submitted": 6, "requeued": 5,
    "evaluation_failed": 12, "checkpoint_rejected": 6, "checkpoint_conflict": 1, "retention": 8,
    "price_above_max": 3, "decision": 0, "release_failed": 1, "dispatch_failed": 2, "dispatch_abandoned": 1,
    "notice": 4, "host_notice": 4, "host_lost": 4, "migration_started": 1,
}
# Kinds that mark an ended attempt: given to finished runs only (a running job has none yet,
# except the few noticed now).
ENDING = {"notice", "host_notice", "host_lost", "migration_started"}
PROBES = 50  # TFLOPS probes: the first instance of each offer runs one


@dataclass(frozen=True)
class Shape:
    jobs: int = 1000
    experiments: int = 100
    projects: int = 10
    checkpoints_per_job: int = 103  # QUEUED jobs have none yet: ~100,000 in all
    events: int = 1_000_000
    big_share: float = 0.25
    seed: int = 7

    @classmethod
    def quick(cls) -> "Shape":
        return cls(jobs=100, experiments=10, projects=3, checkpoints_per_job=20, events=20_000)

    def fingerprint(self) -> str:
        """The shape and the schema's indexes: a changed index makes a new ledger."""
        from orbit_dagster.ledger.schema import metadata

        indexes = sorted(f"{ix.name}:{[c.name for c in ix.columns]}" for t in metadata.tables.values() for ix in t.indexes)
        return hashlib.sha256(json.dumps([asdict(self), indexes], sort_keys=True).encode()).hexdigest()[:12]


def job_plan(shape: Shape, rng: random.Random) -> list[dict]:
    """Per job: experiment, project, state, attempts, lineage(s)."""
    big = int(shape.jobs * shape.big_share)
    out = []
    for j in range(shape.jobs):
        exp = "exp-big" if j < big else f"exp-{(j - big) % max(shape.experiments - 1, 1):03d}"
        u = rng.random()
        state = ("RUNNING" if u < 0.05 else "QUEUED" if u < 0.08 else "FAILED" if u < 0.12
                 else "CANCELLED" if u < 0.15 else "SUCCEEDED")
        attempts = 1 if rng.random() < 0.6 else 2 if rng.random() < 0.75 else 3
        out.append({"job_id": f"job-{j:05d}", "experiment": exp, "state": state, "attempts": attempts,
                    "from_scratch": rng.random() < 0.05, "created_at": T0 + j * 600.0})
    return out


def _instance(iid: str, job_id: str, run_id: str | None, purpose: str, start: float, stop: float | None,
              usd_s: float, **kw) -> dict:
    return {"instance_id": iid, "provider": "sim", "offer_id": f"sim:a2-highgpu-1g/{kw.pop('zone', 'us-central1-a')}",
            "instance_type": "a2-highgpu-1g", "gpu": "A100-40G", "gpu_count": 1, "region": "us-central1",
            "zone": "us-central1-a", "usd_per_second": usd_s, "spot": 1, "purpose": purpose, "job_id": job_id,
            "run_id": run_id, "started_at": start, "stopped_at": stop, "stop_reason": None if stop is None else "done",
            "billed_usd": None if stop is None else (stop - start) * usd_s, "handle": None, **kw}


class Writer:
    """Buffered inserts, one transaction per chunk."""

    def __init__(self, ledger: Ledger, chunk: int = 20_000):
        self.ledger, self.chunk, self.buf, self.count = ledger, chunk, {}, {}

    def add(self, table: str, row: dict) -> None:
        self.buf.setdefault(table, []).append(row)
        self.count[table] = self.count.get(table, 0) + 1
        if len(self.buf[table]) >= self.chunk:
            self.flush(table)

    def flush(self, table: str | None = None) -> None:
        for t in [table] if table else list(self.buf):
            if self.buf.get(t):
                with self.ledger.write() as tx:
                    tx.insert(t, self.buf[t])
                self.buf[t] = []


def generate(home: Path, shape: Shape) -> dict:
    """Write the ledger under `home/ledger/`; returns the row counts."""
    rng = random.Random(shape.seed)
    ledger = Ledger.open(ledger_url_for(home), home=home)
    w = Writer(ledger)
    for p in range(shape.projects):
        w.add("projects", {"project": f"proj-{p}", "created_at": T0, "updated_at": T0})
    plan = job_plan(shape, rng)
    exps = sorted({j["experiment"] for j in plan})
    for i, e in enumerate(exps):
        w.add("experiments", {"experiment": e, "project": f"proj-{i % shape.projects}", "template_metric": "eval/loss",
                              "template_mode": "min", "created_at": T0, "updated_at": T0})
    project_of = {e: f"proj-{i % shape.projects}" for i, e in enumerate(exps)}
    runs_all: list[dict] = []
    ev_seq = 0
    for job in plan:
        _one_job(w, rng, shape, job, project_of[job["experiment"]], runs_all)
    # Events: the real kinds, weighted; each belongs to a job and one of its runs.
    kinds = [k for k, wt in EVENT_KINDS.items() for _ in range(wt)]
    ended = [r for r in runs_all if r["state"] != "RUNNING"]
    running = [r for r in runs_all if r["state"] == "RUNNING"]
    for i in range(shape.events):
        kind = "host_probe" if i < PROBES else kinds[rng.randrange(len(kinds))]
        pool = ended if kind in ENDING or not running else (running if rng.random() < 0.05 else ended)
        if kind == "notice" and running and rng.random() < 0.01:
            pool = running  # a few running attempts hold a notice now
        run = pool[rng.randrange(len(pool))]
        ev_seq += 1
        w.add("events", {"event_id": f"ev-{ev_seq:08d}", "ts": run["started_at"] + rng.random() * 3600, "kind": kind,
                         "job_id": run["job_id"], "run_id": run["run_id"], "instance_id": run["instance_id"],
                         "checkpoint_key": None, "detail": json.dumps({"n": i})})
    w.flush()
    # No ANALYZE: the product never runs it, so the planner sees what it sees in production.
    ledger.dispose()
    return w.count


def _one_job(w: Writer, rng: random.Random, shape: Shape, job: dict, project: str, runs_all: list[dict]) -> None:
    jid, exp, n_att = job["job_id"], job["experiment"], job["attempts"]
    state = job["state"]
    lineage = f"lin-{jid}-1"
    old_lineage = f"lin-{jid}-0" if job["from_scratch"] else lineage
    queued = state == "QUEUED"
    n_ckpt = 0 if queued else shape.checkpoints_per_job
    t = job["created_at"]
    w.add("jobs", {"job_id": jid, "template": "charlm-finetune", "template_version": 1, "kind": "train",
                   "experiment": exp, "project": project, "placement": "sim", "max_interruptions": 5, "imported": 0,
                   "created_at": t, "state": state, "attempt": n_att, "lineage": lineage, "reason": "",
                   "state_at": t + 86400, "detail": "{}"})
    w.add("bundles", {"job_id": jid, "attempt": 1, "bundle_hash": hashlib.sha256(jid.encode()).hexdigest(),
                      "path": f"/nonexistent/bundles/{jid}", "template_id": "charlm-finetune@1", "created_at": t})
    for s in ("CREATED", "QUEUED"):
        w.add("job_states", {"job_id": jid, "attempt": 1, "state": s, "reason": "submitted", "ts": t})
    loss0 = 2.0 + rng.random()
    usd_s = 0.0004 + rng.random() * 0.0004
    per_att = max(n_ckpt // n_att, 1)
    prev_key = None
    for a in range(1, n_att + 1):
        run_id = f"{jid}#{a}"
        last = a == n_att
        r_state = ("QUEUED" if queued else state) if last else "LOST"
        start = t + 60
        steps = range((a - 1) * per_att + 1, (n_ckpt if last else a * per_att) + 1)
        stop = None if r_state in ("RUNNING", "QUEUED") else start + len(steps) * 300 + 120
        train_iid = f"i-{jid}-a{a}"
        if r_state != "QUEUED":
            run = {"run_id": run_id, "job_id": jid, "attempt": a, "lineage": old_lineage if a == 1 else lineage,
                   "instance_id": train_iid, "provider": "sim", "offer_id": f"sim:a2-highgpu-1g/us-central1-{a}",
                   "experiment": exp, "project": project, "started_at": start, "state": r_state, "state_at": start,
                   "failure_class": "reclaim" if r_state == "LOST" else None, "handle": "{}"}
            w.add("runs", run)
            runs_all.append(run)
            w.add("run_states", {"run_id": run_id, "state": "RUNNING", "reason": "launched", "ts": start})
            w.add("instances", _instance(train_iid, jid, run_id, "train", start, stop, usd_s,
                                         zone=f"us-central1-{a}"))
            w.add("job_states", {"job_id": jid, "attempt": a, "state": "RUNNING", "reason": "launched", "ts": start})
            if r_state == "LOST":
                w.add("job_states", {"job_id": jid, "attempt": a, "state": "LOST", "failure_class": "reclaim",
                                     "reason": "spot instance reclaimed", "ts": stop})
        for k, idx in enumerate(steps):
            step = idx * 100
            key = f"{jid}/a{a}/{step}"
            created = start + (k + 1) * 300
            lin = old_lineage if (job["from_scratch"] and idx <= n_ckpt * 0.3) else lineage
            loss = loss0 * (0.3 + 0.7 * (1 - idx / (n_ckpt + 1))) + rng.gauss(0, 0.02)
            deleted = created + 86400 if rng.random() < 0.01 else None
            w.add("checkpoints", {"checkpoint_key": key, "job_id": jid, "experiment": exp, "run_id": run_id, "attempt": a,
                                  "lineage": lin, "step": step, "tier": "emergency" if (k == len(steps) - 1 and not last)
                                  else "durable", "parent_key": prev_key, "uri": f"file:///ckpt/{jid}/step-{step:09d}-a{a}",
                                  "sha256": hashlib.sha256(key.encode()).hexdigest(), "bytes": 5_085_007,
                                  "train_loss": loss, "save_seconds": 0.03, "created_at": created,
                                  "registered_at": created + 1, "deleted_at": deleted,
                                  "deleted_reason": "retention" if deleted else None})
            prev_key = key
            for q in range(4):
                w.add("metric_points", {"job_id": jid, "experiment": exp, "run_id": run_id, "step": step - 75 + 25 * q,
                                        "name": "train/loss", "value": loss + 0.01 * (3 - q), "source": "train",
                                        "ts": created - 75 + 25 * q})
            w.add("costs", {"cost_id": f"{train_iid}:{k}", "instance_id": train_iid, "job_id": jid, "run_id": run_id,
                            "attempt": a, "checkpoint_key": key, "kind": "train", "start_at": created - 300,
                            "end_at": created, "seconds": 300.0, "gpu_count": 1, "usd_per_second": usd_s,
                            "usd": 300 * usd_s})
            newest = idx > n_ckpt - 3 and r_state == "RUNNING"
            for suite, names in SUITES.items():
                _evaluation(w, rng, jid, exp, key, step, suite, names, loss, created, usd_s, pending=newest)
        if stop is not None:
            kind = "wasted" if r_state == "LOST" else "overhead"
            w.add("costs", {"cost_id": f"{train_iid}:end", "instance_id": train_iid, "job_id": jid, "run_id": run_id,
                            "attempt": a, "kind": kind, "start_at": stop - 120, "end_at": stop, "seconds": 120.0,
                            "gpu_count": 1, "usd_per_second": usd_s, "usd": 120 * usd_s})


def _evaluation(w: Writer, rng: random.Random, jid: str, exp: str, key: str, step: int, suite: str,
                names: tuple[str, ...], loss: float, created: float, usd_s: float, *, pending: bool) -> None:
    state = ("PENDING" if rng.random() < 0.8 else "RUNNING") if pending else (
        "FAILED" if rng.random() < 0.01 else "SUCCEEDED")
    start, end = created + 600, created + 900
    row = {"checkpoint_key": key, "suite": suite, "job_id": jid, "experiment": exp, "state": state,
           "tries": 0 if state == "PENDING" else 1, "requested_at": created + 1}
    if state != "PENDING":
        row.update(started_at=start, dagster_run_id=f"dr-{key}-{suite}")
    if state in ("SUCCEEDED", "FAILED"):
        iid = f"e-{key}-{suite}"
        values = {n: (loss + rng.gauss(0.05, 0.02) if n.endswith("loss") else max(0.0, 1 - loss / 4 + rng.gauss(0, 0.02)))
                  for n in names}
        row.update(finished_at=end, seconds=300.0, instance_id=iid,
                   metrics=json.dumps(values) if state == "SUCCEEDED" else None)
        w.add("instances", _instance(iid, jid, None, "eval", start, end, usd_s, checkpoint_key=key, suite=suite))
        w.add("costs", {"cost_id": f"{iid}:0", "instance_id": iid, "job_id": jid, "attempt": 0, "checkpoint_key": key,
                        "suite": suite, "kind": "eval", "start_at": start, "end_at": end, "seconds": 300.0,
                        "gpu_count": 1, "usd_per_second": usd_s, "usd": 300 * usd_s})
        if state == "SUCCEEDED":
            for n, v in values.items():
                w.add("metric_points", {"job_id": jid, "experiment": exp, "run_id": f"eval:{key}:{suite}",
                                        "checkpoint_key": key, "suite": suite, "step": step, "name": n, "value": v,
                                        "source": "eval", "ts": end})
    w.add("evaluations", row)


def ensure(cache: Path, shape: Shape) -> Path:
    """The home of a generated ledger of this shape, generated once per shape."""
    home = cache / f"ledger-{shape.fingerprint()}"
    done = home / "generated.json"
    if not done.exists():
        if home.exists():
            import shutil

            shutil.rmtree(home)
        t = time.time()
        counts = generate(home, shape)
        done.write_text(json.dumps({"shape": asdict(shape), "rows": counts, "seconds": round(time.time() - t, 1)}))
    return home


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="cache directory (a home per shape under it)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    home = ensure(args.out, Shape.quick() if args.quick else Shape())
    print(home, (home / "generated.json").read_text())


if __name__ == "__main__":
    main()
