"""Offer discovery's bookkeeping: per-source diffs, a failed source keeps its offers, what jobs rely on, the
ledger migration that holds the change sets, and which sources are asked."""
import sqlite3

import pytest

from orbit_dagster.control import discovery as D
from orbit_dagster.core.errors import OrbitError, ProviderError
from orbit_dagster.ledger import Ledger
from orbit_dagster.ledger.migrations import LATEST, current_version, upgrade_schema
from orbit_dagster.settings import Settings
from tests.cost_ledger import offer


def fake_sources(monkeypatch, answers: dict):
    def shapes(settings, source, at=None):  # noqa: ARG001
        got = answers[source]
        if isinstance(got, Exception):
            raise got
        return got
    monkeypatch.setattr(D, "shapes", shapes)


def test_each_source_is_diffed_against_its_own_offers_and_a_failed_one_keeps_them(orbit_home, monkeypatch):
    settings = Settings.from_env(orbit_home)
    a, b = offer("aws:g5.xlarge:use1-az1", usd_per_gpu_hour=0.4), offer("aws:g5.xlarge:use1-az2", usd_per_gpu_hour=0.4)
    s = offer("sim:g2-standard-4:us-central1", usd_per_gpu_hour=0.2)
    fake_sources(monkeypatch, {"aws": [a, b], "sim": [s]})
    first = D.refresh_catalog(settings, sources=("aws", "sim"))
    assert first["first_refresh"] and first["changes"] == {} and first["offers"] == 3
    # EC2 unreachable: its offers are kept and the outage recorded, not reported as removals.
    fake_sources(monkeypatch, {"aws": ProviderError("EC2 is down", provider="aws"), "sim": [s]})
    second = D.refresh_catalog(settings, sources=("aws", "sim"))
    assert second["changes"] == {} and second["offers"] == 3
    assert second["sources"]["aws"]["status"] == "failed" and "EC2 is down" in second["sources"]["aws"]["error"]
    ledger = settings.ledger()
    assert ledger.one("SELECT status, offers FROM catalog_refreshes WHERE refresh_id = ? AND source = 'aws'",
                      [second["refresh_id"]]) == {"status": "failed", "offers": 2}
    # Back, one zone fewer: exactly that, from that source.
    fake_sources(monkeypatch, {"aws": [a], "sim": [s]})
    third = D.refresh_catalog(settings, sources=("aws", "sim"))
    assert third["changes"] == {"offer_removed": 1}
    assert [(c["kind"], c["offer_id"], c["source"]) for c in third["change_set"]] == [
        ("offer_removed", b.offer_id, "aws")]
    # A source asked for the first time is a baseline; one no longer asked keeps its offers.
    fake_sources(monkeypatch, {"sim": [s], "catalog": [offer("gce:g2-standard-4:us-east1", usd_per_gpu_hour=0.2)]})
    fourth = D.refresh_catalog(settings, sources=("sim", "catalog"))
    assert fourth["changes"] == {} and fourth["offers"] == 3 and fourth["sources"]["aws"]["status"] == "not asked"


def test_what_unfinished_work_relies_on_and_which_of_it_is_gone(orbit_home):
    ledger = Settings.from_env(orbit_home).ledger()
    ledger.commit({
        "jobs": [{"job_id": j, "state": st, "attempt": 1} for j, st in (("run", "RUNNING"), ("lost", "LOST"),
                                                                        ("done", "SUCCEEDED"))],
        "runs": [{"run_id": f"{j}:a1", "job_id": j, "attempt": 1, "offer_id": o} for j, o in (
            ("run", "aws:g5.xlarge:use1-az1:on-demand"), ("lost", "aws:g5.xlarge:use1-az2"),
            ("done", "aws:g5.xlarge:use1-az3"))],
        "instances": [{"instance_id": "i-e", "job_id": "done", "offer_id": "ssh:box1", "started_at": 1.0}],
    })
    in_use = D.offers_in_use(ledger)
    assert in_use == [{"job_id": "run", "offer_id": "aws:g5.xlarge:use1-az1:on-demand"},
                      {"job_id": "lost", "offer_id": "aws:g5.xlarge:use1-az2"},
                      {"job_id": "done", "offer_id": "ssh:box1"}]
    rows = [{"offer_id": "aws:g5.xlarge:use1-az1", "provider": "aws"}]
    # The on-demand rental of a listed shape is fine; az2 is gone; nothing was asked about ssh.
    assert D.missing_offers(in_use, rows) == [{"job_id": "lost", "offer_id": "aws:g5.xlarge:use1-az2"}]


def test_migration_8_gives_an_older_ledger_the_discovery_tables(tmp_path):
    path = tmp_path / "l" / "ledger.sqlite"
    ledger = Ledger(f"sqlite:///{path}")
    upgrade_schema(ledger)
    ledger.dispose()
    con = sqlite3.connect(path)  # as version 7 left it
    con.execute("DROP TABLE catalog_changes")
    con.execute("DROP TABLE catalog_refreshes")
    con.execute("DELETE FROM schema_migrations WHERE version >= 8")
    con.commit()
    con.close()
    reopened = Ledger(f"sqlite:///{path}")
    assert upgrade_schema(reopened) == 7 and current_version(reopened) == LATEST
    assert reopened.scalar("SELECT count(*) FROM catalog_changes") == 0
    assert reopened.scalar("SELECT count(*) FROM catalog_refreshes") == 0


def test_which_sources_discovery_asks(orbit_home, monkeypatch):
    assert Settings.from_env(orbit_home).discovery == ("catalog", "sim")
    monkeypatch.setenv("ORBIT_AWS_ENDPOINT_URL", "http://127.0.0.1:5000")
    (orbit_home / "ssh_hosts.yaml").parent.mkdir(parents=True, exist_ok=True)
    (orbit_home / "ssh_hosts.yaml").write_text("hosts: []\n")
    assert Settings.from_env(orbit_home).discovery == ("catalog", "sim", "ssh", "aws")
    monkeypatch.setenv("ORBIT_DISCOVERY_PROVIDERS", "aws, sim aws")
    assert Settings.from_env(orbit_home).discovery == ("aws", "sim")
    monkeypatch.setenv("ORBIT_DISCOVERY_PROVIDERS", "aws gcp")
    with pytest.raises(OrbitError, match="ORBIT_DISCOVERY_PROVIDERS='aws gcp' names gcp"):
        Settings.from_env(orbit_home)
