"""One tick of every sensor with 1,000 active jobs on the sim provider, and where the time goes.

Set-up (not timed), in a fresh home with the sim market (no reclaims):
- 1,000 jobs submitted through `control.submit.submit` (real bundles), each moved
  QUEUED -> DISPATCHING -> RUNNING with the rows `control.dispatch` writes (run with its
  RunHandle, train instance, run state, `launched` event);
- 1,000 live hosts are stood in for by `--hosts` real sim hosts (`SimProvider.provision`:
  real processes with heartbeats and metadata endpoints): instance i's directory holds a
  symlink to the state file of real host i mod H, and its handle names that host's metadata
  URL, so every per-instance call the sensors make (state file read, pid check, HTTP
  metadata request, run status files) is made for real, 1,000 times, against H processes;
- a real Dagster instance (SQLite storage under the home), the job partitions added, and,
  in the `followed` scenario, one STARTED run per job tagged with its partition (what a
  live `training_run` materialisation looks like to the sensors).

Scenarios: `followed` (steady state: every attempt has its live run), `unfollowed` (the
runs are gone, e.g. after a daemon restart: the interruption sensor checks every host and
asks to re-attach all 1,000) and `handed off` (ORBIT_FOLLOW=daemon's steady state: no run,
every attempt handed off; the interruption sensor checks every host and reads the new
lines of its event stream, and asks for a run only where there is something to collect). Each sensor is evaluated through Dagster
(`SensorDefinition.evaluate_tick` on a sensor context over the instance); the figure is
the wall time of one tick (median and max over `--ticks`). The interruption sensor
(`control.reconcile.reconcile`) and the price-feed sensor (`control.prices.ingest_prices`
+ `control.migration.consider_migrations`) are then profiled with cProfile.

    python bench/sensor_tick.py [--quick] [--jobs 1000] [--hosts 8] [--ticks 2] [--record docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import platform
import pstats
import statistics
import sys
import sysconfig
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL_S = 2.0


def build_fleet(home: Path, jobs: int, hosts: int) -> tuple[list, list[str]]:
    """Submit `jobs` jobs and make them RUNNING on stand-ins for `jobs` hosts; returns the real hosts."""
    from orbit_dagster.control.billing import instance_row
    from orbit_dagster.control.providers import provider_for
    from orbit_dagster.control.submit import submit
    from orbit_dagster.core.lifecycle import JobState
    from orbit_dagster.ledger import records as R
    from orbit_dagster.ledger import utcnow
    from orbit_dagster.providers.base import InstanceHandle, RunHandle
    from orbit_dagster.settings import Settings

    settings = Settings.from_env(home)
    provider = provider_for(settings, "sim_host_process")
    offers = provider.list_offers()
    real = [provider.provision(offers[i % len(offers)], tags={"orbit/bench": "sensor-tick"}) for i in range(hosts)]
    ledger = settings.ledger()
    job_ids = []
    for i in range(jobs):
        job_id = submit(settings, "charlm-finetune", experiment=f"exp-{i % 20:02d}", project="bench")
        host = real[i % hosts]
        iid = f"sim-bench{i:05d}"
        d = provider.instances / iid
        (d / "work" / "artifacts").mkdir(parents=True)
        (d / "state.json").symlink_to(provider.instances / host.instance_id / "state.json")
        (d / "child.json").write_text("{}")  # the workload has started (what the host writes)
        instance = InstanceHandle(provider="sim", instance_id=iid, offer=host.offer, started_at=host.started_at,
                                  address={"dir": str(d), "metadata_url": host.address["metadata_url"]})
        handle = RunHandle(provider="sim", instance=instance, run_ref=str(d / "work"), task="train", attempt=1,
                           launched_at=datetime.now(timezone.utc))
        run_id = R.run_id_for(job_id, 1)
        job = R.job(ledger, job_id)
        R.transition(ledger, job_id, JobState.DISPATCHING, attempt=1, only_from={JobState.QUEUED},
                     reason="bench", deadline_at=time.time() + 1200)
        ledger.commit({"instances": [instance_row(instance, "train", job_id, run_id)]})
        now = utcnow()
        R.transition(ledger, job_id, JobState.RUNNING, attempt=1, reason=f"on {host.offer.offer_id}", extra={
            "runs": [{"run_id": run_id, "job_id": job_id, "attempt": 1, "lineage": job["lineage"],
                      "instance_id": iid, "provider": "sim", "offer_id": host.offer.offer_id,
                      "handle": handle.model_dump_json(), "imported": 0, "experiment": job["experiment"],
                      "project": job["project"], "started_at": now, "state": "RUNNING", "state_at": now}],
            "run_states": [{"run_id": run_id, "state": "RUNNING", "reason": "launched", "ts": now}],
            "events": [R.event("launched", job_id=job_id, run_id=run_id, instance_id=iid, offer=host.offer.offer_id)]})
        job_ids.append(job_id)
    return real, job_ids


def dagster_runs(instance, job_ids: list[str]) -> None:
    """One STARTED run per job, tagged as a `training_run` materialisation of its partition."""
    import uuid

    from dagster import DagsterRunStatus
    from dagster._core.storage.dagster_run import DagsterRun

    for job_id in job_ids:
        instance.add_run(DagsterRun(job_name="train_job", run_id=str(uuid.uuid4()), status=DagsterRunStatus.STARTED,
                                    tags={"dagster/partition": job_id, "orbit/job": job_id, "orbit/attempt": "1",
                                          "orbit/kind": "train"}))


def tick(sensor, instance, home: Path, cursor: str | None):
    import dagster as dg
    from dagster._core.definitions.partitions.context import partition_loading_context

    from orbit_dagster.definitions import defs
    from orbit_dagster.resources import OrbitResource, from_environment

    # The resources the code location wires (the rental providers too), the home this bench made.
    resources = {**from_environment(), "orbit": OrbitResource(home=str(home))}
    with dg.build_sensor_context(instance=instance, cursor=cursor, sensor_name=sensor.name, definitions=defs,
                                 resources=resources) as ctx:
        # As the daemon does: partition keys of run requests are checked against the instance.
        with partition_loading_context(dynamic_partitions_store=instance):
            t = time.perf_counter()
            data = sensor.evaluate_tick(ctx)
            return time.perf_counter() - t, data


def profile(fn, top: int = 8) -> tuple[float, list[str]]:
    """Total seconds; orbit's functions by cumulative time, then any function by its own time."""
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    total = time.perf_counter() - t
    stats = pstats.Stats(prof, stream=io.StringIO()).stats

    stdlib = sysconfig.get_paths()["stdlib"] + "/"

    def label(file: str, line: int, name: str) -> str:
        # Paths relative to the checkout, site-packages or the standard library: no machine's layout.
        short = file.replace(str(REPO) + "/", "").split("site-packages/")[-1].replace(stdlib, "")
        return f"{short}:{line}({name})"

    ours = sorted(((k, v) for k, v in stats.items() if "orbit_dagster/" in k[0]), key=lambda kv: -kv[1][3])
    rows = [f"{v[3]:7.3f} s cumulative {v[1]:>6} calls  {label(*k)}" for k, v in ours[:top]]
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])
    rows += [f"{v[2]:7.3f} s own        {v[1]:>6} calls  {label(*k)}" for k, v in own[:top - 2]]
    return total, rows


def run(args) -> str:
    import dagster as dg

    from orbit_dagster.assets.partitions import JOBS
    from orbit_dagster.control.migration import consider_migrations
    from orbit_dagster.control.prices import ingest_prices
    from orbit_dagster.control.reconcile import reconcile
    from orbit_dagster.deploy.instance import ensure_dagster_home
    from orbit_dagster.providers.sim.provider import SimProvider
    from orbit_dagster.sensors.evaluations import checkpoint_evaluation_sensor
    from orbit_dagster.sensors.followups import best_checkpoint_sensor, cost_summary_sensor
    from orbit_dagster.sensors.interruptions import _followed, spot_interruption_sensor
    from orbit_dagster.sensors.prices import price_feed_sensor
    from orbit_dagster.sensors.queue import job_queue_sensor
    from orbit_dagster.settings import Settings

    logging.disable(logging.INFO)  # the sensors log one line per job per tick
    tmp = tempfile.mkdtemp(prefix="sensor-tick-")
    home = Path(tmp) / "home"
    os.environ.update(ORBIT_HOME=str(home), ORBIT_SIM_RECLAIMS="none")
    os.environ.pop("ORBIT_SIM_TRACES", None)
    t = time.time()
    real, job_ids = build_fleet(home, args.jobs, args.hosts)
    print(f"{len(job_ids)} running jobs on {len(real)} real sim hosts in {time.time() - t:.0f} s", flush=True)
    settings = Settings.from_env(home)
    sensors = [spot_interruption_sensor, price_feed_sensor, job_queue_sensor, checkpoint_evaluation_sensor,
               best_checkpoint_sensor, cost_summary_sensor]
    results: dict[str, dict[str, list[float]]] = {}
    profiles: dict[str, tuple[float, list[str]]] = {}
    requests: dict[str, dict[str, int]] = {}
    try:
        with dg.DagsterInstance.from_config(str(ensure_dagster_home(settings))) as instance:
            instance.add_dynamic_partitions(JOBS, job_ids)
            for scenario in ("unfollowed", "handed off", "followed"):
                if scenario == "handed off":
                    with settings.ledger().write() as tx:
                        tx.execute("UPDATE runs SET handed_off_at = ?, follow_offset = 0 WHERE state = 'RUNNING'",
                                   [time.time()])
                if scenario == "followed":
                    dagster_runs(instance, job_ids)
                results[scenario], requests[scenario] = {}, {}
                for sensor in sensors:
                    times = []
                    cursor = None
                    for _ in range(args.ticks):
                        seconds, data = tick(sensor, instance, home, cursor)
                        times.append(seconds)
                        cursor = data.cursor if data.cursor is not None else cursor
                    results[scenario][sensor.name] = times
                    requests[scenario][sensor.name] = len(data.run_requests or [])
                    print(scenario, sensor.name, [round(x, 3) for x in times], len(data.run_requests or []), flush=True)
                followed = _followed(instance, settings)
                profiles[f"reconcile ({scenario})"] = profile(lambda: reconcile(settings, followed=followed))
                since = datetime.fromtimestamp(time.time() - 10, timezone.utc)
                profiles[f"price feed ({scenario})"] = profile(
                    lambda: (ingest_prices(settings, since), consider_migrations(settings)))
    finally:
        provider = SimProvider(settings.sim_dir)
        for host in real:
            provider.kill(host)
    return report(results, requests, profiles, args)


def report(results, requests, profiles, args) -> str:
    lines = [
        f"Measured {date.today().isoformat()} on {platform.machine()} ({os.cpu_count()} cores, shared with other work), "
        f"command: `{args.command}`. {args.jobs:,} RUNNING jobs on the sim provider, stood in for by {args.hosts} real "
        "sim hosts (each instance's state file is a link to a real host's; notices are real HTTP requests to its "
        "metadata endpoint). One tick = `evaluate_tick` through Dagster on a real SQLite instance; seconds, median "
        f"(max) of {args.ticks} ticks. Goal: <= 2 s per tick.",
        "",
        "| sensor | followed: s per tick | run requests (re-attach) | unfollowed: s per tick | run requests (re-attach) "
        "| handed off: s per tick | run requests | goal <= 2 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in results["followed"]:
        f, u, h = results["followed"][name], results["unfollowed"][name], results["handed off"][name]
        worst = max(statistics.median(f), statistics.median(u), statistics.median(h))
        lines.append(f"| {name} | {statistics.median(f):.2f} ({max(f):.2f}) | {requests['followed'][name]} | "
                     f"{statistics.median(u):.2f} ({max(u):.2f}) | {requests['unfollowed'][name]} | "
                     f"{statistics.median(h):.2f} ({max(h):.2f}) | {requests['handed off'][name]} | "
                     f"{'met' if worst <= GOAL_S else f'**missed** ({worst / GOAL_S:.1f}x)'} |")
    for label, (total, rows) in profiles.items():
        lines += ["", f"cProfile, {label}: {total:.2f} s in all (profiled, so slower than the tick); orbit's functions by "
                      "cumulative time, then the functions with the most time of their own:", "", "```", *rows, "```"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="50 jobs on 4 hosts, 2 ticks")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--ticks", type=int, default=2)
    p.add_argument("--record", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.jobs, args.hosts, args.ticks = 50, 4, 2
    sys.path.insert(0, str(REPO / "bench"))
    from recording import recorded_command

    args.command = recorded_command("sensor_tick", sys.argv[1:])
    text = run(args)
    print(text)
    if args.record:
        from ledger_scale import record

        record(args.record, text, "sensor-tick", "Sensor ticks with 1,000 active jobs (bench/sensor_tick.py)")


if __name__ == "__main__":
    main()
