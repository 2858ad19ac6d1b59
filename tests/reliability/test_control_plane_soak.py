"""The control-plane kill soak (tests/reliability/soak.py): jobs train on the embedded market
while the daemon, its code server, run workers, the supervisor, hosts and (in the long
version) PostgreSQL are SIGKILLed at random points, singly and together, and restarted after
random pauses. Afterwards: 0 jobs stuck, 0 checkpoints lost or duplicated, 0 instances left
running, attributed = billed to the cent, final weights bit-identical to an uninterrupted run.

The first kill is always the whole control plane while the jobs train (the daemon's process
group, its code server, and the run workers following the jobs), then `orbit daemon` again:
each job then ends SUCCEEDED within the reconcile interval of its workload's exit.

`make test` runs the short version (2 jobs, the control plane then 3 drawn kills, seed 7). `make test-all` adds the long
one: ORBIT_SOAK_MINUTES (60 by default) of rounds on the team profile, PostgreSQL restarts
included. ORBIT_SOAK_SEED, ORBIT_SOAK_JOBS and ORBIT_SOAK_KILLS change the draw."""
from __future__ import annotations

import os
import time

import pytest

from orbit_dagster.deploy.services import say
from orbit_dagster.settings import Settings
from tests.postgres import postgres, team_profile  # noqa: F401 - fixtures
from tests.reliability.soak import Soak


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def _row(result: dict) -> str:
    return " | ".join(f"{k}={v}" for k, v in result.items())


@pytest.mark.timeout(1800)
@pytest.mark.fault("control-plane kill soak, short: 2 jobs; first every control-plane process SIGKILLed at once "
                   "(daemon's process group, code server, the run workers following the jobs) mid-training, then 3 "
                   "SIGKILLs drawn from run worker, code server, daemon, supervisor group, whole control plane, the "
                   "machine, a host process, a host group; `orbit daemon` again after each, after a drawn pause",
                   expect="dead runs failed in Dagster, their attempts taken up (never relaunched); each job SUCCEEDED "
                          "within the reconcile interval of its workload's exit; 0 checkpoints lost or duplicated; 0 "
                          "instances running; attributed = billed; bit-identical final weights")
def test_sigkill_of_the_control_plane_then_random_kills_lose_duplicate_and_leave_nothing(orbit_home):
    soak = Soak(Settings.from_env(orbit_home), seed=_int("ORBIT_SOAK_SEED", 7), jobs=_int("ORBIT_SOAK_JOBS", 2),
                kills=_int("ORBIT_SOAK_KILLS", 3), say=say)
    try:
        soak.run(timeout_s=1500)
        say("soak: " + _row(soak.check()))
    finally:
        soak.stop()


@pytest.mark.slow
@pytest.mark.timeout(0)  # ORBIT_SOAK_MINUTES bounds it
@pytest.mark.fault("control-plane kill soak, long: rounds of 3 jobs for ORBIT_SOAK_MINUTES on the team profile "
                   "(PostgreSQL), PostgreSQL crash-restarts among the kills",
                   expect="every round: 0 stuck, 0 lost or duplicated, 0 running, attributed = billed, bit-identical")
def test_control_plane_kill_soak_for_an_hour_on_postgres(team_profile, orbit_home):
    cluster, _ = team_profile
    minutes = float(os.environ.get("ORBIT_SOAK_MINUTES") or 60)
    end = time.time() + minutes * 60
    seed = _int("ORBIT_SOAK_SEED", 1000)
    rounds = []
    while not rounds or time.time() < end:
        soak = Soak(Settings.from_env(orbit_home), seed=seed + len(rounds), jobs=_int("ORBIT_SOAK_JOBS", 3),
                    kills=_int("ORBIT_SOAK_KILLS", 8), steps=240, restart_postgres=cluster.crash_restart, say=say)
        try:
            soak.run(timeout_s=2400)
            rounds.append(soak.check())
            say(f"soak round {len(rounds)}: " + _row(rounds[-1]))
        finally:
            soak.stop()
    assert rounds
