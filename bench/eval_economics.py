"""What evaluating a job costs against its training, and how long a resumed attempt waits behind
evaluations; before (one rented instance per evaluation, evaluations free to take any slot)
and after (one instance for a job's pending checkpoints, slots left to waiting trainings).

1. Cost, measured through the real control plane on the embedded sim market (real host and
   agent processes): one job trained to 6 checkpoints (`run_attempt`), its 6 evaluations
   with `evaluate_checkpoint(share=1)` one by one (before) or one call with `share=8`
   (after, the default of ORBIT_EVAL_SHARE); train $, eval $ and their ratio from
   `cost_by_job`, as `orbit cost --by job` prints them.
2. Queue wait of a resumed attempt: the two sensors' decisions replayed tick by tick with
   the real `control.capacity.capacity()` over a real ledger (pool of 4, trainings 3, as
   `ORBIT_POOLS=sim=4` renders), evaluations lasting what part 1 measured, the eval sensor
   and the queue sensor each every 2 s, a job reclaimed while the pool is full, LOST for
   1 s, then QUEUED for its attempt 2. "before" is main's rule (an evaluation may take any
   free slot), "after" this one (it leaves the slots waiting trainings can take). Dagster's
   own queue is not replayed: tests/integration/test_run_coordinator.py shows that the
   resumed attempt's run is dequeued first once the sensor requested it.

    python bench/eval_economics.py [--steps 36,120] [--record docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from recording import recorded_command, replace_section  # noqa: E402

from orbit_dagster.control.attempt import run_attempt  # noqa: E402
from orbit_dagster.control.capacity import POOL_TAG, TRAIN_POOL_TAG, Capacity, capacity  # noqa: E402
from orbit_dagster.control.evaluate import evaluate_checkpoint  # noqa: E402
from orbit_dagster.control.submit import submit  # noqa: E402
from orbit_dagster.ledger import records as R  # noqa: E402
from orbit_dagster.settings import Settings  # noqa: E402

BEGIN, END = "<!-- eval-economics:begin -->", "<!-- eval-economics:end -->"
CHECKPOINTS = 6
LIMITS = [{"key": POOL_TAG, "value": "sim", "limit": 4}, {"key": TRAIN_POOL_TAG, "value": "sim", "limit": 3}]


def one_job(settings: Settings, steps: int, share: int) -> dict:
    job = submit(settings, "charlm-finetune", {"config.steps": steps, "checkpoint.every_steps": steps // CHECKPOINTS},
                 experiment=f"share-{share}")
    t0 = time.time()
    assert run_attempt(settings, job, poll_s=0.1).state == "SUCCEEDED"
    train_s = time.time() - t0
    ledger = settings.ledger()
    keys = [r["checkpoint_key"] for r in ledger.rows(
        "SELECT checkpoint_key FROM evaluations WHERE job_id = ? AND state = 'PENDING' ORDER BY requested_at", [job])]
    assert len(keys) == CHECKPOINTS, keys
    t0, firsts = time.time(), []
    if share == 1:
        for key in keys:
            evaluate_checkpoint(settings, key, poll_s=0.1)
            firsts.append(time.time() - t0)
    else:
        evaluate_checkpoint(settings, keys[0], poll_s=0.1, share=share)
        firsts.append(time.time() - t0)
    eval_s = time.time() - t0
    row = ledger.one("SELECT train_usd, eval_usd, eval_per_train FROM cost_by_job WHERE job_id = ?", [job])
    states = {r["state"] for r in ledger.rows("SELECT state FROM evaluations WHERE job_id = ?", [job])}
    assert states == {"SUCCEEDED"}, states
    instances = ledger.scalar("SELECT count(*) FROM instances WHERE job_id = ? AND purpose = 'eval'", [job])
    return {"share": share, "steps": steps, "train_s": train_s, "eval_s": eval_s, "instances": instances, **row,
            "per_eval_s": eval_s / CHECKPOINTS}


# ---- part 2: the sensors' decisions, tick by tick --------------------------------------------

class MainRule(Capacity):
    """main's rule: an evaluation may take any free slot of the pool."""

    def may_eval(self, provider: str) -> bool:
        return provider not in self.limits or self.held(provider) < self.limits[provider]


def room(ledger, rule: str) -> Capacity:
    cap = capacity(ledger, LIMITS, [])
    if rule == "before":
        cap = MainRule(cap.limits, cap.train_limits, cap.trains, cap.evals, cap.waiting, cap.eval_groups)
    return cap


def set_state(ledger, job: str, state: str) -> None:
    with ledger.write() as tx:
        tx.execute("UPDATE jobs SET state = ? WHERE job_id = ?", [state, job])


def queue_wait(home: Path, rule: str, eval_s: float, *, horizon_s: int = 900) -> float | None:
    """Seconds from the reclaimed job's QUEUED to its queue sensor's request (None: not in horizon)."""
    ledger = Settings.from_env(home).ledger()
    with ledger.write() as tx:
        for job, state in [("trainer", "RUNNING"), ("evals", "SUCCEEDED")]:
            R.insert_job(tx, {"job_id": job, "experiment": "e", "project": "p", "placement": "sim",
                              "created_at": 1.0}, [R.state_row(job, 1, state)])
            tx.execute("UPDATE jobs SET state = ? WHERE job_id = ?", [state, job])
        tx.insert("evaluations", [{"checkpoint_key": f"evals/a1/{i}", "suite": "s", "job_id": "evals",
                                   "experiment": "e", "state": "PENDING", "tries": 0, "requested_at": float(i)}
                                  for i in range(200)])
    ends: dict[str, float] = {}  # running evaluation -> when it ends
    lost_at, queued_at = 60, 61
    for t in range(horizon_s):
        for key, end in list(ends.items()):
            if end <= t:
                with ledger.write() as tx:
                    tx.execute("UPDATE evaluations SET state = 'SUCCEEDED' WHERE checkpoint_key = ?", [key])
                del ends[key]
        if t == lost_at:
            set_state(ledger, "trainer", "LOST")
        if t == queued_at:
            set_state(ledger, "trainer", "QUEUED")
        if t % 2 == 0:  # the eval sensor's tick: start what the rule allows
            cap = room(ledger, rule)
            for row in ledger.rows("SELECT checkpoint_key FROM evaluations WHERE state = 'PENDING' "
                                   "ORDER BY requested_at LIMIT 10"):
                if not cap.may_eval("sim"):
                    break
                cap.evals["sim"].add(row["checkpoint_key"])
                with ledger.write() as tx:
                    tx.execute("UPDATE evaluations SET state = 'RUNNING' WHERE checkpoint_key = ?",
                               [row["checkpoint_key"]])
                # staggered ends (each evaluation eval_s, started at different times)
                ends[row["checkpoint_key"]] = t + eval_s * (1 + 0.25 * (len(ends) % 3))
        elif t >= queued_at and room(ledger, rule).may_train("sim"):  # the queue sensor's tick
            return float(t - queued_at)
    return None


def table(rows: list[dict]) -> list[str]:
    out = ["| steps | path | eval instances | train $ | eval $ | eval $ / train $ | training s | evaluating s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "before: an instance per evaluation" if r["share"] == 1 else f"after: one shared instance (share {r['share']})"
        out.append(f"| {r['steps']} | {name} | {r['instances']} | {r['train_usd']:.6f} | {r['eval_usd']:.6f} | "
                   f"{r['eval_per_train']:.2f} | {r['train_s']:.1f} | {r['eval_s']:.1f} |")
    return out


def where_we_lose(rows: list[dict]) -> str:
    """The cell the shared path is worse in: time to the last result when the pool could have
    run every evaluation at once (before's evaluations ran one after another here)."""
    before = [r for r in rows if r["share"] == 1]
    after = [r for r in rows if r["share"] > 1]
    one = max(r["per_eval_s"] for r in before)
    last = max(r["eval_s"] for r in after)
    return (f"Where we lose: the last result. One rental per evaluation took up to {one:.1f} s each here; with "
            f"{CHECKPOINTS} free slots the six would run at once and all be done in about that, while the shared "
            f"instance evaluates them in turn and its last result came {last:.1f} s after it was requested. The "
            "ratio above is also the best case for sharing: the job's six checkpoints were all pending when the "
            "run started; checkpoints registered one by one while the job trains are evaluated by as many runs as "
            "find them pending.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="36,120", help="training steps of each job, comma-separated (6 checkpoints "
                                                      "among them)")
    ap.add_argument("--record", type=Path, default=None)
    args = ap.parse_args()
    os.environ["ORBIT_SIM_RECLAIMS"] = "none"
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="orbit-bench-") as tmp:
        steps = [int(n) for n in args.steps.split(",")]
        rows = [one_job(Settings.from_env(Path(tmp) / f"share-{s}-{n}"), n, s) for n in steps for s in (1, 8)]
        eval_s = max(r["per_eval_s"] for r in rows if r["share"] == 1)
        waits = {rule: queue_wait(Path(tmp) / f"queue-{rule}", rule, eval_s) for rule in ("before", "after")}
    lines = table(rows)
    fmt = {k: ("not within 900 s" if v is None else f"{v:.0f} s") for k, v in waits.items()}
    lines += ["", f"Queue wait of a resumed attempt, QUEUED -> its run requested (pool 4, trainings 3, evaluations "
                  f"of {eval_s:.0f}-{eval_s * 1.5:.0f} s, sensors every 2 s): before {fmt['before']}, "
                  f"after {fmt['after']}.", "", where_we_lose(rows)]
    print("\n".join(lines))
    if args.record:
        body = "\n".join([
            f"Measured {date.today().isoformat()} on {platform.machine()} ({os.cpu_count()} cores, load "
            f"{load:.1f} at start), charlm-finetune, {args.steps} steps, {CHECKPOINTS} checkpoints each, sim market "
            "(no reclaims), real host and agent processes. Command:",
            f"`{recorded_command('eval_economics', sys.argv[1:])}`", "", *lines, ""])
        replace_section(args.record, BEGIN, END,
                        f"\n## Evaluation against training (bench/eval_economics.py)\n\n{body}")


if __name__ == "__main__":
    main()
