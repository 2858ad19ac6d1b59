"""One policy, two drivers: a segment of a real spot trace, replayed end to end on the embedded
market (real host processes, the real agent, `run_attempt` for each attempt, 240 times faster
than real time) and through the simulator, gives the same decisions.

Two jobs run at once, each on its own market and ledger: one without a deadline, one with
`deadline_hours`. For each, the replay of the control plane's protocol
(`tests/launch_replay.py`) is given the platform timings the real run measured (when each
instance came up, when its first step began, when its agent saw the notice, when it was
released, at what age its agent re-decided the interval, whether its emergency save was durable
before the reclaim) and the control plane's own measured step and save times, and must reach the
same decisions: the checkpoint interval at every
dispatch and at every durable save (the agent re-decides it as the instance ages), every
durable checkpoint on the trace's clock, which reclaims an emergency checkpoint caught, the spot/on-demand switches and the
moves they make. The age-aware replay behind `orbit simulate` is run on the same segment too;
how it differs is asserted and documented (docs/policies.md, "One policy, two drivers").

The segment is a real AWS preemption trace's when the shared data set is present; its
licence does not let the repository ship a copy, so elsewhere (a clean checkout, CI) the
same test runs on a made-up segment of the same format and character (up about 1.5 h
between reclaims, down minutes), written by `synthetic_trace`.
"""
from __future__ import annotations

import json
import math
import statistics
import threading

import pytest

from orbit_dagster.catalog.traces import load_trace
from orbit_dagster.core.interval import emergency_covered
from orbit_dagster.policy.checkpointing import OrbitInterval
from orbit_dagster.policy.simulate import JobParams, replay
from orbit_dagster.settings import Settings
from tests.conftest import kill_processes_under, shared_data_dir
from tests.integration.replay_driver import (
    SegmentRun,
    measured_launches,
    paced_template,
    serialise_metric_flushes,
    timeline,
    trace_offer,
)
from tests.launch_replay import ControlJob, replay_control

# The market runs 240 times faster than the wall clock, so a loaded machine's hiccup of half a
# second is two market minutes, a whole AWS notice: a CI machine under the suite's three lanes
# once saved an emergency checkpoint too late for its notice. How fast a host saves is the
# machine's, not a decision, so the replay is told what the ledger saw (each reclaimed
# attempt's emergency checkpoint durable or not, its notice event recorded or not:
# `Launch.emergency_durable`, `Launch.notice_recorded`) and both drivers then count the same
# notices and resume from the same step. Likewise the times compared on the trace clock allow
# for how far behind its pace the real workload ran (measured in the run, `lateness_s`), and the
# checks of the segment's shape (saves, reclaims) hold at any save time the ledger measures.
pytestmark = [pytest.mark.integration]

TRACE = "traces/preemption/aws-2023-04-22_us-west-2b_v100_1.json"
# An up edge at 94.15 h: the zone then stays up 95, 68, 94 and 86 minutes, down 17, 3 and 4
# minutes between (three reclaims before a job of this length can finish).
AT_S = 338_944.0
SCALE = 240.0  # market seconds per wall second: the 120 s notice lasts 0.5 s
PACE_S = 0.02  # wall seconds per step (4.8 market seconds)
STEPS = 2000  # 2.7 market hours of work: 2 to 4 reclaims here, as quick or slow as restores are
# Feasible on demand from the submission (2.7 h of work), but tighter than this stretch of the
# spot market can meet even when every restore is quick: the job must move to on-demand.
DEADLINE_H = 3.2
TICK_WALL_S = 180.0 / SCALE  # the price sensor asks every 180 market seconds (the policy's tick)
MARGIN_WALL_S = 2.0  # the driver never dispatches into the last 8 market minutes of an up-run
# What the real processes add to a time on the trace clock beyond a step's measured lateness
# (`tol`): a save thread started late, the metadata endpoint polled every 50 ms, the work start
# read from metric timestamps. A quarter of a wall second, 60 market seconds, 12.5 steps.
TOL_S = 0.25 * SCALE


def tol(real: dict) -> float:
    """The tolerance of a time on the trace clock in one attempt: the base, plus how far behind
    its pace the attempt's workload ran on this machine (measured from its metric timestamps)."""
    return TOL_S + real["lateness_s"]


# The made-up segment: (available, ticks of 32 s) runs, an up edge after the first. Up 94, 69,
# 93 and 85 minutes, down 16, 3, 5 and 53 between: reclaims before a job of this length can
# finish, one of them short enough to come back at once, and a long gap for the deadline job.
SYNTHETIC_RUNS = ((0, 5), (1, 176), (0, 30), (1, 130), (0, 6), (1, 175), (0, 9), (1, 160), (0, 100), (1, 160),
                  (0, 250))
SYNTHETIC_USD_PER_HOUR = 0.918


def synthetic_trace(directory) -> tuple[str, float]:
    """A trace file in the real traces' format (metadata naming its market), and its up edge."""
    data = [v for v, n in SYNTHETIC_RUNS for _ in range(n)]
    path = directory / "synthetic_us-west-2b_v100_1.json"
    path.write_text(json.dumps({
        "metadata": {"gap_seconds": 32, "cloud": "aws", "instance_type": "p3.2xlarge", "zone": "us-west-2b",
                     "note": "made up for tests/integration/test_policy_replay.py, not measured"},
        "data": data, "prices": [SYNTHETIC_USD_PER_HOUR] * len(data)}))
    return str(path), SYNTHETIC_RUNS[0][1] * 32.0


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy-replay")
    data = shared_data_dir()
    if data is not None and (data / TRACE).is_file():
        trace_path, at_s = str(data / TRACE), AT_S
    else:
        trace_path, at_s = synthetic_trace(root)
    print(f"\nreplaying {trace_path} from trace second {at_s:.0f}")
    trace = load_trace(trace_path)
    offer = trace_offer(trace, at_s=at_s)
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        serialise_metric_flushes(mp)
        for var in ("ORBIT_CHECKPOINT_STORE", "ORBIT_TEMPLATES", "ORBIT_LEDGER_URL"):
            mp.delenv(var, raising=False)
        for name, deadline in (("plain", None), ("deadline", DEADLINE_H)):
            settings = Settings.from_env(root / name)
            run = SegmentRun(settings, trace_path, offer, at_s=at_s, scale=SCALE, tick_wall_s=TICK_WALL_S,
                             margin_wall_s=MARGIN_WALL_S)
            template = paced_template(root, steps=STEPS, step_seconds=PACE_S)
            run.start(template, {"deadline_hours": deadline} if deadline else {})
            runs[name] = run
        outcome: dict = {}

        def drive(name: str) -> None:
            try:
                outcome[name] = runs[name].drive(timeout_s=420)
            except BaseException as exc:  # surfaced below
                outcome[name] = exc

        threads = [threading.Thread(target=drive, args=(name,), daemon=True) for name in runs]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(450)
        finally:
            for run in runs.values():
                kill_processes_under(run.settings.home)
    out = {}
    for name, run in runs.items():
        if isinstance(outcome.get(name), BaseException):
            raise outcome[name]
        real = timeline(run, PACE_S)
        deadline_s = DEADLINE_H * 3600.0 if name == "deadline" else None
        launches, move = measured_launches(real, deadline_s)
        job = ControlJob(steps=STEPS, step_s=PACE_S * SCALE, notice_s=120.0, submitted_at=real["submitted"],
                         deadline_s=deadline_s)
        sim = replay_control(trace, offer, job, launches, ticks=tuple(real["tick_calls"]), move=move)
        out[name] = {"real": real, "sim": sim, "trace": trace, "offer": offer, "launches": launches}
    return out


def pairs(r: dict):
    real, sim = r["real"]["attempts"], r["sim"]["attempts"]
    assert len(real) == len(sim), (f"{len(real)} attempts on the market, {len(sim)} in the replay: "
                                   f"{[(a['state'], a['failure_class']) for a in real]} vs {[a['end'] for a in sim]}")
    return list(zip(real, sim))


def end_of(a: dict) -> str:
    return {"SUCCEEDED": "finished"}.get(a["state"], a["failure_class"])


@pytest.mark.parametrize("name", ["plain", "deadline"])
def test_both_drivers_replay_the_same_segment(replays, name):
    r = replays[name]
    assert r["real"]["state"] == "SUCCEEDED" and r["sim"]["finished"]
    for real, sim in pairs(r):
        assert (real["spot"], end_of(real)) == (sim["spot"], sim["end"]), f"attempt {real['attempt']}"
        if real["spot"]:  # the host's reclaim time is the trace's 1->0 edge, on both clocks
            assert sim["reclaim_at"] is not None and abs(real["reclaim_at"] - sim["reclaim_at"]) < 1.0
    if name == "plain":
        reclaims = [a for a in r["real"]["attempts"] if a["failure_class"] == "reclaim"]
        assert len(reclaims) >= 2, "the segment must reclaim the job"


@pytest.mark.parametrize("name", ["plain", "deadline"])
def test_same_checkpoint_interval_at_every_dispatch(replays, name):
    for real, sim in pairs(replays[name]):
        iv = real["interval"]
        assert abs(real["resumed_step"] - sim["resumed_step"]) <= tol(real) / (PACE_S * SCALE), f"attempt {real['attempt']}"
        inputs = iv["policy_inputs"]
        # what the policy was told: the same reclaims and notices, the same exposure (the
        # release times are the real ones), the same work left (to the resume step's tolerance)
        assert inputs["rate"]["reclaims"] == sim["rate"]["reclaims"]
        assert inputs["rate"]["exposure_s"] == pytest.approx(sim["rate"]["exposure_s"], abs=1.0)
        assert inputs["notices"] == sim["notices"]
        assert iv["work_left_s"] == pytest.approx(sim["work_left_s"], abs=tol(real) * iv["step_s"] / (PACE_S * SCALE) + 1e-6)
        if real["resumed_step"] == sim["resumed_step"]:
            assert iv["interval_s"] == pytest.approx(sim["interval_s"], rel=1e-6)
            assert int(real["interval"]["steps"]) == sim["interval_steps"]
        else:  # a resume step one notice-poll apart changes only a run-to-the-end interval
            assert abs(int(real["interval"]["steps"]) - sim["interval_steps"]) <= abs(real["resumed_step"]
                                                                                     - sim["resumed_step"])


@pytest.mark.parametrize("name", ["plain", "deadline"])
def test_the_agent_re_decides_the_interval_at_every_durable_save_as_the_replay_does(replays, name):
    """Not a launch-only interval: after each durable save the agent asks the policy again,
    for the instance's age then, and both drivers reach the same decision from it."""
    compared, aged = 0, 0
    for real, sim in pairs(replays[name]):
        assert real["dispatch_intervals"] == 1, f"attempt {real['attempt']}: one decision at dispatch"
        host = {d["step"]: d for d in real["host_intervals"]}
        durable = [c["step"] for c in real["checkpoints"] if c["tier"] == "durable" and c["step"] != STEPS]
        # a decision for every durable checkpoint, made at its step, with the instance's age
        assert set(durable) <= set(host), f"attempt {real['attempt']}: saves {durable}, decisions {sorted(host)}"
        for d in sim["decisions"]:
            mine = host.get(d["step"])
            if mine is None:
                continue
            compared += 1
            assert mine["age_s"] == pytest.approx(d["age_s"])  # (the replay is given the agent's ages)
            assert abs(mine["age_s"] - d["model_age_s"]) <= tol(real)  # and its own model of them agrees
            # (the agent records seconds to the millisecond)
            assert mine["work_left_s"] == pytest.approx(d["work_left_s"], abs=1e-3)
            assert mine["interval_s"] == pytest.approx(d["interval_s"], abs=2e-3)
            assert mine["steps"] == d["steps"], f"attempt {real['attempt']}, step {d['step']}"
            if mine["interval_s"] is not None and mine["interval_s"] < mine["work_left_s"]:  # (not: run to the end)
                # the age counted: at launch (age 0) the same rule asks for a shorter interval
                aged += mine["interval_s"] > sim["rule"].interval(0.0, d["work_left_s"]) + 1.0
    # The deadline job soon runs on demand, where the interval is the work left, and how many
    # saves its spot attempt holds before the move follows this machine's timings; the plain job
    # must show the re-decision (how many saves an attempt holds follows the save time the ledger
    # measured on this machine, so at least two, not a count for a quiet machine).
    if name == "plain":
        assert compared >= 2 and aged >= 1, "the interval must lengthen as an instance ages"


@pytest.mark.parametrize("name", ["plain", "deadline"])
def test_same_durable_checkpoints_on_the_trace_clock(replays, name):
    periodic = 0
    for real, sim in pairs(replays[name]):
        want = [(c["step"], c["tier"]) for c in sim["checkpoints"] if c["tier"] == "durable"]
        got = [(c["step"], c["tier"]) for c in real["checkpoints"] if c["tier"] == "durable"]
        if int(real["interval"]["steps"]) == sim["interval_steps"] and real["resumed_step"] == sim["resumed_step"]:
            # every checkpoint of the attempt, not only the first: each one the decision before it placed
            assert got == want, f"attempt {real['attempt']}"
            for c, s in zip(real["checkpoints"], [c for c in sim["checkpoints"] if c["tier"] == "durable"]):
                assert abs(c["at"] - s["at"]) <= tol(real), f"checkpoint at step {c['step']}: {c['at'] - s['at']:+.1f} s"
        else:
            assert abs(len(got) - len(want)) <= 1
        periodic += sum(1 for step, _ in got if step != STEPS)
    if name == "plain":
        assert periodic >= 2, "the segment must exercise the periodic interval"


@pytest.mark.parametrize("name", ["plain", "deadline"])
def test_same_reclaims_caught_by_the_notice(replays, name):
    """Each reclaim: an emergency checkpoint inside the notice that loses nothing, or (a save
    this machine finished too late) none, the work since the newest durable checkpoint lost and
    the notice counted as missed unless its event reached the ledger: the same in both drivers
    (what the next dispatch's policy was told of notices: test_same_checkpoint_interval_at_every_dispatch)."""
    reclaims = 0
    for real, sim in pairs(replays[name]):
        if end_of(real) != "reclaim":
            continue
        reclaims += 1
        emergency = [c for c in real["checkpoints"] if c["tier"] == "emergency"]
        assert bool(emergency) == sim["caught"], f"attempt {real['attempt']}"
        if emergency:
            assert sim["lost_steps"] == 0  # a notice on time loses nothing
            mine = [c for c in sim["checkpoints"] if c["tier"] == "emergency"][0]
            assert abs(emergency[0]["at"] - mine["at"]) <= tol(real)
            # the replay chains on the step the agent really stopped at; its own estimate (the first
            # step after the notice was seen) is within the tolerance of it
            assert abs(emergency[0]["step"] - sim["stop_step_model"]) <= tol(real) / (PACE_S * SCALE)
            assert real["reclaim_at"] - 120.0 <= emergency[0]["at"] < real["reclaim_at"]  # inside the notice
        elif real["work_start"] is not None and sim["stop_step_model"] is not None:  # a save cut short
            newest = max([c["step"] for c in real["checkpoints"]], default=real["resumed_step"])
            assert sim["lost_steps"] == sim["stop_step_model"] - newest > 0
        print(f"\n{name} attempt {real['attempt']}: reclaim {'caught' if emergency else 'not caught'}, "
              f"notice event {'recorded' if real['notice_recorded'] else 'lost'}, lateness {real['lateness_s']:.0f} s")
    if name == "plain":
        assert reclaims >= 2


def test_same_spot_on_demand_decisions_and_moves(replays):
    r = replays["deadline"]
    for real, sim in pairs(r):  # at every dispatch, from the same inputs
        mine = sim["dispatch_market"]
        assert real["market"]["work_left_s"] == pytest.approx(mine["work_left_s"], rel=1e-9)
        assert real["market"]["mtbf_s"] == pytest.approx(mine["mtbf_s"], rel=1e-6)
        assert real["market"]["chosen"] == mine["action"], f"attempt {real['attempt']}: {real['market']['reason']}"
    switches = [d for d in r["real"]["deadline_decisions"] if d["holding"] == "spot"]
    mine = [s for s in r["sim"]["switches"] if s["by"] == "tick"]
    assert len(switches) == len(mine) <= 1
    for d, s in zip(switches, mine):  # the price sensor's tick that moved the job
        assert d["attempt"] == s["attempt"] and d["done_steps"] == s["done_steps"]
        assert d["time_left_s"] == pytest.approx(s["time_left_s"], abs=1e-3)
    assert len(r["real"]["migrations"]) == r["sim"]["migrations"] == len(switches)
    kinds = [a["spot"] for a in r["real"]["attempts"]]
    assert kinds[0] and not kinds[-1], "the deadline must move the job from spot to on-demand"
    plain = replays["plain"]
    assert plain["real"]["deadline_decisions"] == [] and plain["real"]["migrations"] == []
    assert plain["sim"]["switches"] == [] and plain["sim"]["migrations"] == 0


def test_the_age_aware_replay_differs_as_documented(replays):
    """`orbit simulate`'s replay of the same stretch of trace, from the first instance, with the
    run's median save and restore: no dispatch latency, the interval re-decided after every save
    from the instance's age, saves that stop the work, the emergency checkpoint at the last
    moment of the notice. It loses no work either (where the measured save fits the notice), and
    its intervals grow with the age."""
    r = replays["plain"]
    real = r["real"]["attempts"]
    save = statistics.median(c["save_s"] * SCALE for a in real for c in a["checkpoints"] if c["save_s"])
    restore = statistics.median(a["work_start"] - a["instance_start"] for a in real if a["work_start"])
    job = JobParams(work_s=STEPS * PACE_S * SCALE, save_s=save, restore_s=restore, notice_s=120.0,
                    start_s=real[0]["instance_start"])
    policy = OrbitInterval.for_offer(r["offer"], save_s=save, notice_s=120.0)
    asked: list[tuple[float, float, bool]] = []  # (age, interval, ran to the end)
    interval = policy.interval

    def recorded(age_s, work_left_s=math.inf):
        tau = interval(age_s, work_left_s)
        asked.append((age_s, tau, tau >= work_left_s))
        return tau

    policy.interval = recorded
    res = replay(r["trace"], policy, job)
    assert res.finished and res.reclaims >= 1
    # (the median save this machine measured decides whether an emergency save fits a notice)
    if emergency_covered(120.0, save):
        assert res.wasted_s == 0 and res.emergency_checkpoints == res.reclaims  # every reclaim caught
    sessions: list[list[float]] = []  # the intervals asked within each instance's life, in order
    for i, (age, tau, to_end) in enumerate(asked):
        if i == 0 or age < asked[i - 1][0]:
            sessions.append([])
        if not to_end:
            sessions[-1].append(tau)
    assert all(b >= a - 1.0 for sess in sessions for a, b in zip(sess, sess[1:]))  # (bisection to 0.5 s)
    assert any(sess[-1] > sess[0] for sess in sessions if sess), "the interval lengthens as the instance ages"
    taus = [t for sess in sessions for t in sess]
    sim = r["sim"]["attempts"]
    print(f"\nmedian save {save:.1f} market s; age-aware replay: {res.checkpoints} saves ({res.emergency_checkpoints} emergency), intervals "
          f"{min(taus):.0f}-{max(taus):.0f} s, {res.reclaims} reclaims, done after {res.wall_s / 3600:.2f} h; "
          f"launch protocol: {sum(len(a['checkpoints']) for a in sim)} saves "
          f"({sum(1 for a in sim for c in a['checkpoints'] if c['tier'] == 'emergency')} emergency), intervals "
          f"{[round(a['interval_s']) for a in sim]} s, {sum(1 for a in sim if a['end'] == 'reclaim')} reclaims, done "
          f"after {(sim[-1]['checkpoints'][-1]['at'] - real[0]['instance_start']) / 3600:.2f} h")
