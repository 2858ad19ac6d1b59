"""Fixtures for the tests of the `team` profile: a throwaway PostgreSQL cluster
(`bench/pg_cluster.py`) for the session, stopped and removed at its end. `make test` installs
PostgreSQL where it is missing (scripts/system-deps.sh); without it the tests that need it
skip and say why.

Import the fixtures into a test module: `from tests.postgres import postgres, team_profile`.
"""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

from bench.pg_cluster import PostgresCluster, pg_bin

__all__ = ["PostgresCluster", "pg_bin", "postgres", "team_profile"]


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for this test session (one per module that imports this fixture)."""
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("needs PostgreSQL's initdb (make test installs it with apt-get when it may: "
                    "scripts/system-deps.sh); absent on this machine")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root needs runuser to start PostgreSQL as the postgres user")
    cluster = PostgresCluster(bindir).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def team_profile(postgres, monkeypatch):
    """ORBIT_PROFILE=team against a fresh database name (orbit creates both databases itself)."""
    name = f"orbit_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("ORBIT_PROFILE", "team")
    monkeypatch.setenv("ORBIT_POSTGRES_URL", postgres.url(name))
    monkeypatch.delenv("ORBIT_LEDGER_URL", raising=False)
    return postgres, name
