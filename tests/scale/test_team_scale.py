"""The `team` profile at scale: 12 concurrent jobs (`make test`; 20 in `make test-all`, set by
ORBIT_SCALE_JOBS) on the sim market through a PostgreSQL-backed Dagster instance with its daemon running (tests/postgres.py starts the server), trainings
handed off to the daemon (the team default, control/handoff.py).

Checked from both records, Dagster's runs and the ledger: every job finishes and every
checkpoint is evaluated; the sim pool's limits (6 instances, 5 of them trainings) are never
exceeded, in the ledger's instances nor in Dagster's run records, and were reached; no
attempt is launched twice; the jobs reclaimed mid-training (the market operator's override,
`inject_reclaim`, on running hosts) resume from their emergency checkpoint and finish; the
ledger and Dagster agree on every attempt; and trainings held a run for only part of their
time. Figures (wall time, sensor tick durations, the most at once, run time held per
training) are printed for docs/deploy.md.
"""
import os
import statistics
import time
from collections import Counter, defaultdict

import dagster as dg
import pytest
from dagster._core.scheduler.instigation import InstigatorType

from orbit_dagster.control.providers import provider_for
from orbit_dagster.control.submit import submit
from orbit_dagster.deploy.instance import Daemon, dagster_instance, ensure_dagster_home, wait_for_daemon
from orbit_dagster.deploy.profiles import POOL_TAG, TRAIN_POOL_TAG
from orbit_dagster.ledger import records as R
from orbit_dagster.providers.base import RunHandle
from orbit_dagster.resources import OrbitResource
from orbit_dagster.settings import Settings
from tests.helpers import wait_for
from tests.postgres import postgres, team_profile  # noqa: F401 - fixtures

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]
# Twice the pool and more: the limits are reached and jobs wait for them. 20 jobs double the
# suite's longest lane on a 2-core machine, so `make test` runs 12 and `make test-all` 20.
JOBS = int(os.environ.get("ORBIT_SCALE_JOBS") or 12)
RECLAIMS = 3
POOL_LIMIT, TRAIN_LIMIT = 6, 5  # ORBIT_POOLS sim=6: trainings leave one instance to evaluations
# Short jobs: one durable checkpoint at the end (plus an emergency one when reclaimed), so
# one evaluation each; long enough (~5 s of steps) to be reclaimed mid-training.
STEPS = 120
RECLAIM_STEP = 30
OVERRIDES = {"config.steps": STEPS, "config.micro_batch": 4, "config.grad_accum": 1,
             "checkpoint.every_steps": STEPS, "checkpoint.interval_policy": "fixed"}
# How run monitoring words a run it failed for not starting in start_timeout_seconds.
START_TIMEOUT = "Run timed out due to taking longer than"
ENDED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


def most_at_once(intervals) -> int:
    """The largest number of [start, end) intervals that overlap."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def say(line: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {line}", flush=True)


def test_queue_sensor_puts_each_run_in_its_providers_pool(team_profile, orbit_home):
    from orbit_dagster.sensors.queue import job_queue_sensor

    settings = Settings.from_env(orbit_home)
    job = submit(settings, "charlm-finetune", {"config.steps": 8}, experiment="pools")
    with dagster_instance(settings) as instance:
        with dg.build_sensor_context(instance=instance, resources={"orbit": OrbitResource()}) as ctx:
            result = job_queue_sensor(ctx)
    (request,) = result.run_requests
    assert request.partition_key == job
    assert request.tags[POOL_TAG] == "sim" and request.tags[TRAIN_POOL_TAG] == "sim"


def test_twenty_jobs_on_postgres_with_the_daemon(team_profile, orbit_home, monkeypatch):
    monkeypatch.setenv("ORBIT_POOLS", f"sim={POOL_LIMIT}")
    # Every training is handed off as soon as it runs (the default follows a minute first,
    # which these ~10 s jobs would spend inside their launching run).
    monkeypatch.setenv("ORBIT_HANDOFF_AFTER_S", "0")
    settings = Settings.from_env(orbit_home)
    ensure_dagster_home(settings)
    ledger = settings.ledger()
    provider = provider_for(settings, "sim_host_process")
    started = time.time()
    daemon = Daemon(settings, say=say).start()
    try:
        wait_for_daemon(settings, timeout_s=180, say=say)
        jobs = [submit(settings, "charlm-finetune", OVERRIDES, experiment=f"scale-{i % 4}") for i in range(JOBS)]
        submitted = time.time()
        say(f"{JOBS} jobs submitted")
        reclaimed: set[str] = set()
        last_said = [0.0]

        def finished() -> bool:
            inject_reclaims(ledger, provider, reclaimed)
            rows = ledger.rows("SELECT state, count(*) AS n FROM jobs GROUP BY state")
            pending = ledger.scalar("SELECT count(*) FROM evaluations WHERE state IN ('PENDING', 'RUNNING')")
            if time.time() - last_said[0] > 15:
                say(f"jobs {dict((r['state'], r['n']) for r in rows)}; evaluations pending {pending}; "
                    f"reclaimed {len(reclaimed)}")
                last_said[0] = time.time()
            done = sum(r["n"] for r in rows if r["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"))
            return done == JOBS and pending == 0

        # Minutes on an idle 2-core machine; much longer on one shared with other work.
        wait_for(finished, timeout=3000, every=1, what=f"{JOBS} jobs and their evaluations")
        wall = time.time() - submitted
        with dagster_instance(settings) as instance:
            # A run still queued or starting when the ledger is done (its evaluation was taken by
            # another run's instance) still starts and ends; one that cannot start is failed by run
            # monitoring after start_timeout_seconds (300 s).
            last = wait_for_runs_to_end(instance, timeout=420)
            runs = [r.dagster_run for r in instance.get_run_records(dg.RunsFilter(job_name="train_job"))] + \
                [r.dagster_run for r in instance.get_run_records(dg.RunsFilter(job_name="eval_job"))]
            records = {r.dagster_run.run_id: r for r in instance.get_run_records(
                dg.RunsFilter(run_ids=[run.run_id for run in runs]))}
            ticks = sensor_tick_seconds(instance)
            why_failed = {r.run_id: failure_message(instance, r.run_id) for r in runs
                          if r.status == dg.DagsterRunStatus.FAILURE}
    finally:
        daemon.stop()

    # Every job finished; every live checkpoint has its evaluation.
    states = {r["job_id"]: r["state"] for r in ledger.rows("SELECT job_id, state FROM jobs")}
    assert states == {j: "SUCCEEDED" for j in jobs}
    assert ledger.scalar("""SELECT count(*) FROM checkpoints c WHERE c.deleted_at IS NULL AND NOT EXISTS (
        SELECT 1 FROM evaluations e WHERE e.checkpoint_key = c.checkpoint_key AND e.state = 'SUCCEEDED')""") == 0

    # The pool's limits, from the ledger: sim instances alive at once (training and evaluation
    # hosts; a handed-off training holds its host without a run), and trainings among them.
    hosts = [(r["started_at"], r["stopped_at"], r["purpose"]) for r in ledger.rows(
        "SELECT started_at, stopped_at, purpose FROM instances WHERE provider = 'sim'")]
    assert all(stop is not None for _, stop, _ in hosts)  # nothing left running, nothing billed on
    hosts_peak = most_at_once([(a, b) for a, b, _ in hosts])
    train_hosts_peak = most_at_once([(a, b) for a, b, purpose in hosts if purpose == "train"])
    assert hosts_peak <= POOL_LIMIT and train_hosts_peak <= TRAIN_LIMIT
    # Trainings held at once, as the queue sensor counts them (an attempt from the request of
    # its launching run until it ended) reached the train limit, so the jobs did wait for it,
    # and never went past it.
    requested = {}
    for r in runs:
        if r.job_name == "train_job" and "orbit/reattach" not in r.tags and "dagster/parent_run_id" not in r.tags:
            key = (r.tags["orbit/job"], int(r.tags["orbit/attempt"]))
            requested[key] = min(requested.get(key, float("inf")), records[r.run_id].create_timestamp.timestamp())
    ended = attempt_ends(ledger)
    holding = [(requested[key], ended[key]) for key in requested]
    assert most_at_once(holding) == TRAIN_LIMIT, most_at_once(holding)
    # ... and from Dagster's run records: every run in the pool, never more at once than its limits.
    spans = {rid: (rec.start_time, rec.end_time) for rid, rec in records.items() if rec.start_time}
    pooled = [spans[r.run_id] for r in runs if r.tags.get(POOL_TAG) == "sim" and r.run_id in spans]
    trains = [spans[r.run_id] for r in runs if r.tags.get(TRAIN_POOL_TAG) == "sim" and r.run_id in spans]
    # A run that never started and that run monitoring failed for it held no host; its work was
    # requested again (every evaluation succeeded, above). Any other run outside the pool fails.
    never_started = [r.run_id[:8] for r in runs if r.run_id not in spans and r.tags.get(POOL_TAG) == "sim"
                     and (why_failed.get(r.run_id) or "").startswith(START_TIMEOUT)]
    outside = [(r.run_id[:8], r.job_name, r.status.value, r.run_id in spans, why_failed.get(r.run_id), dict(r.tags))
               for r in runs if (r.tags.get(POOL_TAG) != "sim" or r.run_id not in spans)
               and r.run_id[:8] not in never_started]
    assert not outside, outside  # every run was in the pool
    assert all(end is not None for _, end in pooled)
    runs_peak, trains_peak = most_at_once(pooled), most_at_once(trains)
    assert runs_peak <= POOL_LIMIT and trains_peak <= TRAIN_LIMIT

    # No attempt launched twice: one ledger run and one training host per attempt, and one
    # Dagster run per attempt (a re-attach or a crashed worker's retry launches nothing).
    per_attempt = Counter((r["job_id"], r["attempt"]) for r in ledger.rows("SELECT job_id, attempt FROM runs"))
    assert set(per_attempt.values()) == {1}
    hosts_per_run = ledger.rows("SELECT run_id, count(*) AS n FROM instances WHERE purpose = 'train' GROUP BY run_id")
    assert {r["n"] for r in hosts_per_run} == {1} and len(hosts_per_run) == len(per_attempt)
    launches = Counter((r.tags["orbit/job"], r.tags.get("orbit/attempt")) for r in runs
                       if r.job_name == "train_job" and "orbit/reattach" not in r.tags
                       and "dagster/parent_run_id" not in r.tags)
    assert set(launches.values()) == {1}

    # The reclaims recovered: each reclaimed job lost attempt 1 to the reclaim, with an
    # emergency checkpoint at or after the step of the notice (the agent polls for it every
    # second at most, so a few steps pass), and attempt 2 resumed from it.
    assert len(reclaimed) == RECLAIMS
    for job in reclaimed:
        attempts = ledger.rows("SELECT attempt, state, failure_class, resume_from FROM runs WHERE job_id = ? "
                               "ORDER BY attempt", [job])
        assert attempts[0]["state"] == "LOST" and attempts[0]["failure_class"] == "reclaim", attempts
        emergency = ledger.one("SELECT checkpoint_key, step FROM checkpoints WHERE job_id = ? AND attempt = 1 "
                               "AND tier = 'emergency'", [job])
        assert emergency and RECLAIM_STEP <= emergency["step"] < STEPS, (emergency, attempts)
        assert attempts[1]["resume_from"] == emergency["checkpoint_key"], attempts
        assert attempts[-1]["state"] == "SUCCEEDED"
    assert sum(R.interruptions(ledger, j) for j in jobs) == len(reclaimed)

    # The ledger and Dagster agree on every attempt: its run names the Dagster run of that job
    # that launched it and handed it off; one run of the attempt closed it and ended as it did;
    # every other run of it (collecting checkpoints) handed it back, still RUNNING.
    by_id = {r.run_id: r for r in runs}
    per_attempt_runs = defaultdict(list)
    for r in runs:
        if r.job_name == "train_job":
            per_attempt_runs[(r.tags.get("dagster/partition"), r.tags.get("orbit/attempt"))].append(r)
    held = []
    for row in ledger.rows("SELECT job_id, attempt, state, dagster_run_id, started_at, state_at FROM runs"):
        launcher = by_id[row["dagster_run_id"]]
        assert launcher.tags["orbit/job"] == row["job_id"] and launcher.tags["dagster/partition"] == row["job_id"]
        assert launcher.tags.get("orbit/handed_off") == "1", launcher.tags
        its = per_attempt_runs[(row["job_id"], str(row["attempt"]))]
        closing = [r for r in its if r.tags.get("orbit/outcome") == row["state"]]
        assert len(closing) == 1, (row, [dict(r.tags) for r in its])
        expected = dg.DagsterRunStatus.SUCCESS if row["state"] == "SUCCEEDED" else dg.DagsterRunStatus.FAILURE
        assert closing[0].status == expected, (row, closing[0].status)
        for r in its:
            if r is not closing[0]:
                assert r.tags.get("orbit/outcome") == "RUNNING" and r.status == dg.DagsterRunStatus.SUCCESS
        held.append((sum(spans[r.run_id][1] - spans[r.run_id][0] for r in its if r.run_id in spans),
                     float(row["state_at"]) - float(row["started_at"])))
    # Trainings did not hold a run for their whole attempt (hand-off).
    held_s, trained_s = sum(h for h, _ in held), sum(t for _, t in held)
    assert held_s < trained_s, (held_s, trained_s)
    # An evaluation ran in a run of its own job: the run launched for it, or one launched for
    # another checkpoint of that job that shared its instance (control/evaluate.py `share`).
    for row in ledger.rows("SELECT job_id, checkpoint_key, dagster_run_id FROM evaluations"):
        tags = by_id[row["dagster_run_id"]].tags
        launched_for = tags.get("orbit/checkpoint") or tags["dagster/partition"]
        assert launched_for.split("/", 1)[0] == row["job_id"], (row, dict(tags))

    say(f"wall {wall:.0f} s after submission ({time.time() - started:.0f} s with daemon start-up); "
        f"runs {len(runs)} ({sum('orbit/reattach' in r.tags for r in runs)} re-attaches, "
        f"{sum('dagster/parent_run_id' in r.tags for r in runs)} retries, "
        f"{len(never_started)} failed by run monitoring before they started; the last ended {last:.0f} s after "
        f"the ledger was done); most at once: {runs_peak} runs, "
        f"{trains_peak} training runs, {hosts_peak} hosts, {train_hosts_peak} training hosts; training runs held "
        f"{held_s:.0f} s of {trained_s:.0f} s trained ({held_s / trained_s:.0%})")
    for name, secs in sorted(ticks.items()):
        say(f"sensor {name}: {len(secs)} ticks, median {statistics.median(secs):.2f} s, max {max(secs):.2f} s")


def attempt_ends(ledger) -> dict[tuple[str, int], float]:
    """When each attempt ended: its first state after RUNNING, from job_states."""
    ends, running = {}, set()
    for row in ledger.rows("SELECT job_id, attempt, state, ts FROM job_states ORDER BY ts, id"):
        key = (row["job_id"], int(row["attempt"]))
        if row["state"] == "RUNNING":
            running.add(key)
        elif key in running and key not in ends:
            ends[key] = float(row["ts"])
    return ends


def inject_reclaims(ledger, provider, reclaimed: set[str]) -> None:
    """Reclaim (2 s notice, the market operator's override) the host of each job seen running
    its first attempt, until RECLAIMS jobs have been: the notice when the workload reports
    RECLAIM_STEP, read by the host itself, so it comes mid-training however late this loop
    sees the run (a reclaim set in seconds once the test had read step 40 came after the last
    step on a loaded machine)."""
    if len(reclaimed) >= RECLAIMS:
        return
    for row in ledger.rows("SELECT r.job_id, r.handle FROM runs r WHERE r.state = 'RUNNING' AND r.attempt = 1"):
        if row["job_id"] in reclaimed or len(reclaimed) >= RECLAIMS or not row["handle"]:
            continue
        handle = RunHandle.model_validate_json(row["handle"])
        provider.inject_reclaim(handle.instance, at_step=RECLAIM_STEP, notice_seconds=2)
        reclaimed.add(row["job_id"])
        say(f"reclaim at step {RECLAIM_STEP} injected into {row['job_id']}")


def in_progress(instance) -> list:
    """The runs not ended yet: (id, job, status, tags) each."""
    records = instance.get_run_records(dg.RunsFilter(statuses=[s for s in dg.DagsterRunStatus if s not in ENDED]))
    return [(r.dagster_run.run_id[:8], r.dagster_run.job_name, r.dagster_run.status.value, dict(r.dagster_run.tags))
            for r in records]


def wait_for_runs_to_end(instance, timeout: float) -> float:
    """Seconds until no run is in progress; fails naming the runs still in progress."""
    began = time.time()
    while True:
        left = in_progress(instance)
        if not left:
            return time.time() - began
        if time.time() - began > timeout:
            raise AssertionError(f"runs still in progress {timeout:.0f} s after the ledger was done: {left}")
        time.sleep(2)


def failure_message(instance, run_id: str) -> str | None:
    """Why Dagster failed a run: its RUN_FAILURE event's message (a CI log shows only the assertion)."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.RUN_FAILURE, limit=1).records
    return records[0].event_log_entry.message if records else None


def sensor_tick_seconds(instance) -> dict[str, list[float]]:
    """Durations of the sensors' ticks, from Dagster's tick records."""
    out: dict[str, list[float]] = defaultdict(list)
    for state in instance.all_instigator_state():
        if state.instigator_type != InstigatorType.SENSOR:
            continue
        for tick in instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=5000):
            if tick.end_timestamp:
                out[state.instigator_name].append(tick.end_timestamp - tick.timestamp)
    return out
