"""The control-plane kill soak (tests/reliability/soak.py): jobs train on the embedded market
while the daemon, its code server, run workers, the supervisor, hosts and (in the long
version) PostgreSQL are SIGKILLed at random points, singly and together, and restarted after
random pauses. Afterwards: 0 jobs stuck, 0 checkpoints lost or duplicated, 0 instances left
running, attributed = billed to the cent, final weights bit-identical to an uninterrupted run.

`make test` runs the short version (2 jobs, 4 kills, seed 7). `make test-all` adds the long
one: ORBIT_SOAK_MINUTES (60 by default) of rounds on the team profile, PostgreSQL restarts
included. ORBIT_SOAK_SEED, ORBIT_SOAK_JOBS and ORBIT_SOAK_KILLS change the draw."""
from __future__ import annotations

import os
import time

import pytest

from orbit_dagster.settings import Settings
from orbit_dagster.deploy.services import say
from tests.postgres import postgres, team_profile  # noqa: F401 - fixtures
from tests.reliability.soak import Soak


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def _row(result: dict) -> str:
    return " | ".join(f"{k}={v}" for k, v in result.items())


@pytest.mark.fault("control-plane kill soak, short: 2 jobs; 4 SIGKILLs drawn from run worker, code server, daemon, "
                   "supervisor group, whole control plane, the machine, a host process, a host group; restarts after "
                   "random pauses",
                   expect="0 jobs stuck, 0 checkpoints lost or duplicated, 0 instances running, attributed = billed, "
                          "bit-identical final weights")
def test_control_plane_kill_soak_loses_duplicates_and_leaves_nothing(orbit_home):
    soak = Soak(Settings.from_env(orbit_home), seed=_int("ORBIT_SOAK_SEED", 7), jobs=_int("ORBIT_SOAK_JOBS", 2),
                kills=_int("ORBIT_SOAK_KILLS", 4), say=say)
    try:
        soak.run(timeout_s=1500)
        say("soak: " + _row(soak.check()))
    finally:
        soak.stop()


@pytest.mark.slow
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
