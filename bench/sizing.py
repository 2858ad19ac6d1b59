"""Control-plane sizing for docs/deploy.md, measured side by side in one run.

1. Sensor evaluation time at N jobs, embedded (SQLite) vs team (PostgreSQL): N queued jobs
   for `job_queue_sensor`, N pending evaluations for `checkpoint_evaluation_sensor`, each
   evaluated in-process against the profile's real Dagster instance and ledger (median of
   3). This is orbit's part of a tick; the daemon then creates one run per request.
2. Memory per followed job: a real daemon (team profile) with K training attempts on the
   sim market, once with ORBIT_FOLLOW=run (a run worker follows each attempt) and once
   with ORBIT_FOLLOW=daemon (hand-off); the PSS and RSS of each run worker and of the
   daemon, its code server and their supervisor, sampled while all K train.

    python bench/sizing.py [--jobs 20,200,1000] [--follow 3] [--record docs/benchmarks.md]

PostgreSQL: a throwaway cluster (bench/pg_cluster.py), as in the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from recording import recorded_command  # noqa: E402


@contextlib.contextmanager
def profile_env(profile: str, home: Path, pg_url: str | None):
    saved = {k: os.environ.get(k) for k in ("ORBIT_HOME", "ORBIT_PROFILE", "ORBIT_POSTGRES_URL", "ORBIT_LEDGER_URL",
                                             "ORBIT_SIM_RECLAIMS")}
    os.environ.update({"ORBIT_HOME": str(home), "ORBIT_PROFILE": profile, "ORBIT_SIM_RECLAIMS": "none"})
    os.environ.pop("ORBIT_LEDGER_URL", None)
    if pg_url:
        os.environ["ORBIT_POSTGRES_URL"] = pg_url
    else:
        os.environ.pop("ORBIT_POSTGRES_URL", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fill(ledger, n: int) -> None:
    """N queued jobs and N checkpoints waiting for their evaluation, in one transaction."""
    from orbit_dagster.core.lifecycle import JobState
    from orbit_dagster.ledger import records as R

    now = datetime.now(timezone.utc)
    with ledger.write() as tx:
        for i in range(n):
            job = f"sized-{i:05d}"
            R.insert_job(tx, {"job_id": job, "experiment": "sizing", "project": "p", "placement": "sim",
                              "created_at": now},
                         [R.state_row(job, 1, JobState.CREATED), R.state_row(job, 1, JobState.QUEUED)])
        tx.insert("checkpoints", [{"checkpoint_key": f"sized-{i:05d}/a1/10", "job_id": f"sized-{i:05d}",
                                   "experiment": "sizing", "attempt": 1, "step": 10, "created_at": now,
                                   "registered_at": now} for i in range(n)])
        tx.insert("evaluations", [{"checkpoint_key": f"sized-{i:05d}/a1/10", "suite": "heldout",
                                   "job_id": f"sized-{i:05d}", "experiment": "sizing", "state": "PENDING",
                                   "tries": 0, "requested_at": now} for i in range(n)])


def tick_seconds(n: int) -> dict[str, float]:
    import dagster as dg

    from orbit_dagster.deploy.instance import dagster_instance
    from orbit_dagster.resources import OrbitResource
    from orbit_dagster.sensors.evaluations import checkpoint_evaluation_sensor
    from orbit_dagster.sensors.queue import job_queue_sensor
    from orbit_dagster.settings import Settings

    settings = Settings.from_env()
    fill(settings.ledger(), n)
    out = {}
    with dagster_instance(settings) as instance:
        for sensor in (job_queue_sensor, checkpoint_evaluation_sensor):
            times = []
            for _ in range(3):
                with dg.build_sensor_context(instance=instance, resources={"orbit": OrbitResource()}) as ctx:
                    t = time.perf_counter()
                    result = sensor(ctx)
                    times.append(time.perf_counter() - t)
            out[sensor.name] = statistics.median(times)
            out[sensor.name + ":requests"] = len(result.run_requests)
    return out


def proc_memory(pid: int) -> tuple[float, float]:
    """(PSS, RSS) in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) / 1024
    return fields.get("Pss", 0.0), fields.get("Rss", 0.0)


def processes() -> dict[int, tuple[int, str]]:
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out[int(p.name)] = (ppid, (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return out


def follow_memory(k: int, mode: str) -> dict[str, float]:
    """Memory of a daemon with K training attempts (team profile), followed as `mode` says."""
    os.environ["ORBIT_FOLLOW"] = mode
    # Hand off after 5 s rather than the default 60 s, so the samples below come after it.
    os.environ["ORBIT_HANDOFF_AFTER_S"] = "5"
    from orbit_dagster.control.submit import cancel, submit
    from orbit_dagster.deploy.instance import Daemon, wait_for_daemon
    from orbit_dagster.settings import Settings

    settings = Settings.from_env()
    daemon = Daemon(settings, say=lambda line: None).start()
    try:
        wait_for_daemon(settings, timeout_s=180)
        jobs = [submit(settings, "charlm-finetune", {"config.steps": 4000, "config.micro_batch": 4,
                                                     "config.grad_accum": 1}, experiment="sizing-follow")
                for _ in range(k)]
        ledger = settings.ledger()
        deadline = time.time() + 300
        while ledger.scalar("SELECT count(*) FROM runs WHERE state = 'RUNNING'") < k:
            if time.time() > deadline:
                raise SystemExit(f"{k} attempts did not reach RUNNING within 300 s")
            time.sleep(1)
        time.sleep(15)  # the launching runs hand off and end (daemon mode)
        samples: dict[str, list[float]] = {"run worker PSS": [], "run worker RSS": [], "daemon+code server PSS": [],
                                           "orbit supervisor PSS": []}
        for _ in range(5):
            procs = processes()
            sup = daemon.proc.pid
            # The supervisor's children: its code server and dagster-daemon; the run workers are
            # the code server's (multiprocessing) children.
            dagster_daemon = [pid for pid, (pp, _) in procs.items() if pp == sup]
            workers = [pid for pid, (pp, cmd) in procs.items() if pp in dagster_daemon and "spawn_main" in cmd]
            for pid in workers:
                pss, rss = proc_memory(pid)
                samples["run worker PSS"].append(pss)
                samples["run worker RSS"].append(rss)
            samples["daemon+code server PSS"].append(sum(proc_memory(p)[0] for p in dagster_daemon))
            samples["orbit supervisor PSS"].append(proc_memory(sup)[0])
            samples.setdefault("run workers seen", []).append(len(workers))
            time.sleep(3)
        for job in jobs:
            cancel(settings, job)
        time.sleep(10)
    finally:
        daemon.stop()
        os.environ.pop("ORBIT_FOLLOW", None)
        os.environ.pop("ORBIT_HANDOFF_AFTER_S", None)
    return {name: statistics.median(values) if values else 0.0 for name, values in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="20,200,1000")
    ap.add_argument("--follow", type=int, default=3)
    ap.add_argument("--record", default=None)
    args = ap.parse_args()
    from bench.pg_cluster import PostgresCluster, pg_bin

    sizes = [int(x) for x in args.jobs.split(",")]
    cluster = PostgresCluster(pg_bin()).start()
    started = time.time()
    rows = []
    try:
        for n in sizes:
            row = {"n": n}
            for profile in ("embedded", "team"):
                home = Path(tempfile.mkdtemp(prefix=f"orbit-sizing-{profile}-"))
                pg = cluster.url(f"sizing_{n}") if profile == "team" else None
                with profile_env(profile, home, pg):
                    row[profile] = tick_seconds(n)
            rows.append(row)
            print(f"N={n}: " + ", ".join(f"{p} {s}: {row[p][s]:.3f} s" for p in ("embedded", "team")
                                          for s in ("job_queue_sensor", "checkpoint_evaluation_sensor")), flush=True)
        memory = {}
        for mode in ("run", "daemon"):
            with profile_env("team", Path(tempfile.mkdtemp(prefix="orbit-sizing-follow-")),
                             cluster.url(f"sizing_follow_{mode}")):
                memory[mode] = follow_memory(args.follow, mode)
            print(f"memory, ORBIT_FOLLOW={mode} (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in memory[mode].items()),
                  flush=True)
    finally:
        cluster.stop()
    report = render(rows, memory, args, time.time() - started)
    print(report)
    if args.record:
        record(Path(args.record), report)


def render(rows, memory, args, seconds: float) -> str:
    lines = [
        "<!-- sizing:begin -->",
        "## Control-plane sizing (bench/sizing.py)",
        "",
        f"Command: `{recorded_command('sizing', sys.argv[1:])}` (run {date.today()}, "
        f"{seconds:.0f} s, {platform.machine()} with {os.cpu_count()} cores shared with other work; PostgreSQL "
        "15 throwaway cluster on loopback). Sensor time is orbit's evaluation of one tick against the "
        "profile's real Dagster instance and ledger, median of 3; the daemon then creates one run per request.",
        "",
        "| jobs queued / evaluations pending | job_queue_sensor SQLite | PostgreSQL | PG / SQLite "
        "| checkpoint_evaluation_sensor SQLite | PostgreSQL | PG / SQLite | run requests (queue, eval) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, t = r["embedded"], r["team"]
        q = ("job_queue_sensor", "checkpoint_evaluation_sensor")
        lines.append(f"| {r['n']} | {e[q[0]]:.3f} s | {t[q[0]]:.3f} s | {t[q[0]] / e[q[0]]:.2f} "
                     f"| {e[q[1]]:.3f} s | {t[q[1]]:.3f} s | {t[q[1]] / e[q[1]]:.2f} "
                     f"| {t[q[0] + ':requests']}, {t[q[1] + ':requests']} |")
    lines += [
        "",
        f"Memory while a daemon (team profile) has {args.follow} training attempts at once, median of 5 "
        "samples 3 s apart from 15 s after all three run (MiB; PSS counts shared pages once), with a run "
        "following each attempt and with hand-off (ORBIT_HANDOFF_AFTER_S=5, so the samples come after it; a run "
        "worker seen then is a short run: a checkpoint collected, an evaluation, the cost summary):",
        "",
        "| ORBIT_FOLLOW | run workers seen | a run worker's PSS | its RSS | dagster-daemon + code server PSS "
        "| orbit supervisor PSS |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in memory.items():
        worker = (f"{m['run worker PSS']:.0f} | {m['run worker RSS']:.0f}" if m["run workers seen"] else "- | -")
        lines.append(f"| {mode} | {m['run workers seen']:.0f} | {worker} | {m['daemon+code server PSS']:.0f} "
                     f"| {m['orbit supervisor PSS']:.0f} |")
    lines.append("<!-- sizing:end -->")
    return "\n".join(lines)


def record(path: Path, section: str) -> None:
    text = path.read_text()
    begin, end = "<!-- sizing:begin -->", "<!-- sizing:end -->"
    if begin in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
