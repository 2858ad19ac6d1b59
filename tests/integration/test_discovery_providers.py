"""Offer discovery asks the providers themselves: a shape EC2 (moto) stops offering is reported by one run of
the discovery job, recorded in the ledger, and fails the check of the job that relies on it."""
import dagster as dg

from orbit_dagster.control.discovery import read_catalog, refresh_catalog
from orbit_dagster.settings import Settings
from tests.integration.moto_fixtures import aws_env, moto_server  # noqa: F401

GONE = "g4dn.xlarge"


def rely_on(ledger, offer_id: str) -> None:
    """A job whose current attempt runs on `offer_id` (its instance still metered)."""
    ledger.commit({
        "jobs": [{"job_id": "j1", "template": "charlm-finetune", "experiment": "e", "state": "RUNNING", "attempt": 1,
                  "created_at": 1.0}],
        "runs": [{"run_id": "j1:a1", "job_id": "j1", "attempt": 1, "offer_id": offer_id, "provider": "aws",
                  "instance_id": "i-1", "state": "RUNNING", "started_at": 1.0}],
        "instances": [{"instance_id": "i-1", "provider": "aws", "offer_id": offer_id, "job_id": "j1", "spot": 1,
                       "purpose": "train", "started_at": 1.0}],
    })


def run_discovery():
    from orbit_dagster.definitions import defs

    with dg.DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("discovery_job").execute_in_process(instance=instance)
        [mat] = result.asset_materializations_for_node("offer_catalog")
        [check] = result.get_asset_check_evaluations()
        return result, mat.metadata, check


def test_a_shape_removed_under_moto_is_reported_within_one_run_and_fails_the_dependent_check(
        aws_env, orbit_home, monkeypatch):
    from moto.ec2.models.instance_types import InstanceTypeBackend

    monkeypatch.setenv("ORBIT_DISCOVERY_PROVIDERS", "aws")
    settings = Settings.from_env(orbit_home)
    first = refresh_catalog(settings)
    assert first["sources"]["aws"] == {"status": "ok", "offers": first["offers"], "error": None} and first["offers"]
    target = next(r["offer_id"] for r in read_catalog(settings)["offers"] if r["instance_type"] == GONE)
    ledger = settings.ledger()
    rely_on(ledger, target)
    result, meta, check = run_discovery()  # nothing changed yet: the check passes
    assert check.passed and meta["changes"].value == {}

    # EC2 stops offering the shape in the region (moto's server runs in this process).
    offered = InstanceTypeBackend.instance_types
    monkeypatch.setattr(InstanceTypeBackend, "instance_types", [t for t in offered if t["InstanceType"] != GONE])
    result, meta, check = run_discovery()
    assert meta["changes"].value.get("type_removed") == 1 and meta["changes"].value.get("offer_removed", 0) >= 1
    rows = ledger.rows("SELECT kind, source, offer_id, instance_type FROM catalog_changes WHERE refresh_id = ?",
                       [meta["refresh_id"].value])
    assert {"kind": "type_removed", "source": "aws", "offer_id": None, "instance_type": GONE} in rows
    assert {"kind": "offer_removed", "source": "aws", "offer_id": target, "instance_type": GONE} in rows
    assert any(r.data["offer_id"] == target for r in meta["change_set"].records)
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert check.metadata["missing"].value == [{"job_id": "j1", "offer_id": target}]
    assert f"job j1 relies on {target}, no longer listed" in check.metadata["detail"].value
    assert all(r["instance_type"] != GONE for r in read_catalog(settings)["offers"])  # updated, no restart

    # The shape comes back: the next run says so, and the check passes again.
    monkeypatch.setattr(InstanceTypeBackend, "instance_types", offered)
    result, meta, check = run_discovery()
    assert meta["changes"].value.get("type_added") == 1 and check.passed

