"""Recovery figures, measured side by side in one run on the embedded sim market.

1. notice -> emergency checkpoint durable (s): the host's notice to its checkpoint landing;
2. notice -> new attempt running (s): to the next attempt's agent starting, (a) with the
   control plane driven directly and (b) through a real Dagster daemon (sensors, queued
   run, run process start);
3. emergency save of a full fine-tune (every tensor changed: a full save) vs a head-only
   fine-tune (a delta against the last durable checkpoint): bytes and seconds;
4. checkpoint overhead: seconds per step of the same training with no checkpoints, with
   the template's tiers (memory snapshot every 5 steps, durable every 40), and with a
   durable checkpoint every 5 steps, as % over the no-checkpoint baseline.

    python bench/recovery.py [--repeat 3] [--record docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from recording import recorded_command  # noqa: E402

from orbit_dagster.control.attempt import run_attempt  # noqa: E402
from orbit_dagster.control.providers import provider_for  # noqa: E402
from orbit_dagster.control.recovery import recover_lost  # noqa: E402
from orbit_dagster.control.submit import cancel, submit  # noqa: E402
from orbit_dagster.core.bundle import build_bundle  # noqa: E402
from orbit_dagster.core.submission import TaskSubmission, apply_overrides  # noqa: E402
from orbit_dagster.core.templates import load_template  # noqa: E402
from orbit_dagster.ledger import records as R  # noqa: E402
from orbit_dagster.providers.base import RunHandle  # noqa: E402
from orbit_dagster.settings import Settings  # noqa: E402


def host_events(settings: Settings, job: str, attempt: int) -> list[dict]:
    path = settings.artifacts_dir / job / f"attempt-{attempt}" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait(predicate, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError("benchmark step did not happen in time")


def one_recovery(settings: Settings, *, through_dagster: bool) -> tuple[float, float]:
    """(notice -> emergency durable, notice -> next attempt's agent started), seconds."""
    ledger = settings.ledger()
    job = submit(settings, "charlm-finetune", {"config.steps": 2000, "checkpoint.every_steps": 500})
    runner = None if through_dagster else threading.Thread(target=run_attempt, args=(settings, job), daemon=True)
    if runner:
        runner.start()
    wait(lambda: (ledger.scalar("SELECT max(step) FROM metric_points WHERE run_id = ?", [R.run_id_for(job, 1)]) or 0) >= 20)
    handle = RunHandle.model_validate_json(R.run(ledger, R.run_id_for(job, 1))["handle"])
    provider = provider_for(settings, "sim_host_process")
    provider.inject_reclaim(handle.instance, in_seconds=5, notice_seconds=4)
    if runner:
        runner.join()
        recover_lost(settings, job)
        runner = threading.Thread(target=run_attempt, args=(settings, job), daemon=True)
        runner.start()
    wait(lambda: ledger.rows("SELECT ts FROM events WHERE kind = 'host_started' AND run_id = ?", [R.run_id_for(job, 2)]))
    ev1 = host_events(settings, job, 1)
    notice = next(e for e in ev1 if e["type"] == "notice")
    durable = next(e for e in ev1 if e["type"] == "checkpoint" and e["tier"] == "emergency")
    second_started = json.loads(ledger.rows("SELECT detail FROM events WHERE kind = 'host_started' AND run_id = ?",
                                            [R.run_id_for(job, 2)])[0]["detail"])["ts"]
    cancel(settings, job)  # the follower stops the workload and bills it
    if runner:
        runner.join()
    wait(lambda: not ledger.scalar("SELECT count(*) FROM instance_usage WHERE job_id = ? AND running", [job]))
    return durable["ts"] - notice["received_at"], second_started - notice["received_at"]


def emergency_save(trainable: str, workdir: Path) -> tuple[int, float, float]:
    """(bytes, save seconds, notice -> durable seconds) of the emergency checkpoint a SIGTERM triggers."""
    import signal

    t = apply_overrides(load_template("charlm-finetune"), {"config.steps": 100000, "config.trainable": trainable,
                                                            "checkpoint.every_steps": 20})
    bundle = build_bundle(t, TaskSubmission(template=t.name), f"bench-emergency-{trainable}", workdir / "b")
    work = workdir / f"e-{trainable}-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": str(bundle.path / "runtime"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "orbit_dagster.runtime.agent", str(bundle.path), "--workdir",
                             str(work), "--store", (work / "store").as_uri()], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events_file = work / "artifacts" / "events.jsonl"
    wait(lambda: events_file.exists() and '"tier": "durable"' in events_file.read_text())
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    ev = [json.loads(line) for line in events_file.read_text().splitlines()]
    notice = next(e for e in ev if e["type"] == "notice")
    em = next(e for e in ev if e["type"] == "checkpoint" and e["tier"] == "emergency")
    return em["bytes"], em["save_seconds"], em["ts"] - notice["received_at"]


def step_seconds(checkpoint_every: int, memory_every: int, steps: int, workdir: Path) -> float:
    t = apply_overrides(load_template("charlm-finetune"), {"config.steps": steps})
    bundle = build_bundle(t, TaskSubmission(template=t.name), f"bench-{checkpoint_every}-{memory_every}", workdir / "b")
    env = {**os.environ, "PYTHONPATH": str(bundle.path / "runtime"), "OMP_NUM_THREADS": "1"}
    work = workdir / f"w-{checkpoint_every}-{memory_every}"
    subprocess.run([sys.executable, "-m", "orbit_dagster.runtime.agent", str(bundle.path), "--workdir", str(work),
                    "--store", (work / "store").as_uri(), "--checkpoint-every", str(checkpoint_every),
                    "--memory-every", str(memory_every)], env=env, check=True, capture_output=True)
    ev = [json.loads(line) for line in (work / "artifacts" / "events.jsonl").read_text().splitlines()]
    metrics = [e for e in ev if e["type"] == "metrics"]
    # From the first report to the last, excluding start-up (imports, data, model build).
    return (metrics[-1]["ts"] - metrics[0]["ts"]) / (metrics[-1]["step"] - metrics[0]["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--skip-dagster", action="store_true")
    p.add_argument("--record", type=Path, default=None, help="rewrite the recovery section of this markdown file")
    args = p.parse_args()
    os.environ["ORBIT_SIM_RECLAIMS"] = "none"
    rows = []
    with tempfile.TemporaryDirectory(prefix="orbit-bench-") as tmp:
        tmp = Path(tmp)
        direct = [one_recovery(Settings.from_env(tmp / f"direct-{i}"), through_dagster=False) for i in range(args.repeat)]
        rows.append(("notice -> emergency checkpoint durable (s)", [d[0] for d in direct]))
        rows.append(("notice -> new attempt running, control plane alone (s)", [d[1] for d in direct]))
        if not args.skip_dagster:
            from orbit_dagster.deploy.instance import Daemon

            settings = Settings.from_env(tmp / "dagster")
            os.environ["ORBIT_HOME"] = str(settings.home)
            with Daemon(settings):
                via = [one_recovery(settings, through_dagster=True) for _ in range(args.repeat)]
            rows.append(("notice -> new attempt running, through Dagster (s)", [d[1] for d in via]))
        for trainable, label in (("all", "full fine-tune (full save)"), ("head", "head-only fine-tune (delta)")):
            saves = [emergency_save(trainable, tmp) for _ in range(args.repeat)]
            rows.append((f"emergency checkpoint bytes, {label}", [s[0] for s in saves]))
            rows.append((f"emergency save seconds, {label}", [s[1] for s in saves]))
            rows.append((f"SIGTERM -> emergency durable (s), {label}", [s[2] for s in saves]))
        # The three configurations side by side in each repeat, so they share the machine's
        # state; the overhead is the median of the per-repeat ratios.
        base, tiers, heavy = [], [], []
        for _ in range(args.repeat):
            base.append(step_seconds(10**9, 10**9, args.steps, tmp))
            tiers.append(step_seconds(40, 5, args.steps, tmp))
            heavy.append(step_seconds(5, 5, args.steps, tmp))
    overhead = [
        ("step time, no checkpoints (s)", base, None),
        ("step time, memory every 5 + durable every 40 (s)", tiers,
         statistics.median(t / b - 1 for t, b in zip(tiers, base)) * 100),
        ("step time, durable every 5 (s)", heavy, statistics.median(h / b - 1 for h, b in zip(heavy, base)) * 100),
    ]
    lines = [f"Measured {date.today().isoformat()} on {platform.processor() or platform.machine()} "
             f"({os.cpu_count()} cores), median of {args.repeat} (min-max); overhead = median of per-repeat ratios. "
             f"Command: `{recorded_command('recovery', sys.argv[1:])}`.", "",
             "| figure | median | min | max | overhead vs no checkpoints |", "|---|---|---|---|---|"]
    for name, values in rows:
        lines.append(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} | |")
    for name, values, pct in overhead:
        lines.append(f"| {name} | {statistics.median(values):.4f} | {min(values):.4f} | {max(values):.4f} | "
                     + (f"{pct:+.1f}%" if pct is not None else "baseline") + " |")
    text = "\n".join(lines)
    print(text)
    if args.record:
        record(args.record, text)


def record(path: Path, body: str) -> None:
    begin, end = "<!-- recovery:begin -->", "<!-- recovery:end -->"
    section = f"{begin}\n## Recovery and checkpoint overhead (bench/recovery.py)\n\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
