"""The nodes' parts an ended attempt of a group left in the store (a checkpoint some node never
saved its part of, or one node 0 was stopped while gathering) are deleted when the attempt
ends: only that attempt's parts, complete or half-written, never a checkpoint; on the
filesystem store and on S3 (moto's server)."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from orbit_dagster.control.checkpoints import drop_group_parts
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import CheckpointManifest, checkpoint_dir_name, checkpoint_part_name
from tests.integration.moto_fixtures import aws_env, client, moto_server, s3_bucket  # noqa: F401 (fixtures)

JOB = "fsdp-multinode-0123abcd"


def manifest(step: int, attempt: int, tier: str = "durable") -> CheckpointManifest:
    return CheckpointManifest(job_id=JOB, step=step, tier=tier, files={}, attempt=attempt,
                              created_at=datetime.now(timezone.utc).isoformat())


def fill(store) -> None:
    """Attempt 1: a checkpoint put together (step 100) and the parts of one never put together
    (step 200: node 2's complete, node 1's without its manifest); attempt 2: a part in flight."""
    store.put(JOB, checkpoint_dir_name(100, 1), {"__0_0.distcp": b"w" * 64}, manifest(100, 1))
    store.put(JOB, checkpoint_part_name(200, 1, 2), {"__2_0.distcp": b"x" * 64}, manifest(200, 1, "emergency"))
    store.put(JOB, checkpoint_part_name(300, 2, 1), {"__1_0.distcp": b"y" * 64}, manifest(300, 2))


def names(uris) -> list[str]:
    return [u.rstrip("/").rsplit("/", 1)[-1] for u in uris]


def check(orbit_home, store_uri: str) -> None:
    ledger = Settings.from_env(orbit_home).ledger()
    store = open_store(store_uri)
    assert names(store.parts(JOB)) == ["step-000000200-a1.node1", "step-000000200-a1.node2",
                                       "step-000000300-a2.node1"]

    dropped = drop_group_parts(ledger, store_uri, JOB, 1)
    assert names(dropped) == ["step-000000200-a1.node1", "step-000000200-a1.node2"]
    assert names(store.parts(JOB)) == ["step-000000300-a2.node1"]  # attempt 2's is not this attempt's garbage
    assert names(store.list(JOB)) == ["step-000000100-a1"]  # the checkpoint stays, verified
    store.verify(store.uri_for(JOB, checkpoint_dir_name(100, 1)))
    (event,) = ledger.rows("SELECT detail FROM events WHERE kind = 'group_parts_dropped'")
    detail = json.loads(event["detail"])
    assert names(detail["uris"]) == names(dropped)
    assert detail["steps"] == [{"step": 200, "nodes": [1, 2], "emergency": True}]  # node 2's part came after a notice
    assert detail["reason"] == ("the emergency save of step 200 never came together (parts of node(s) 1, 2 were in "
                                "the store; node 0 never stored the whole): the parts are dropped; no checkpoint stands")
    assert drop_group_parts(ledger, store_uri, JOB, 1) == []  # twice: nothing more, no second event
    assert ledger.scalar("SELECT count(*) FROM events WHERE kind = 'group_parts_dropped'") == 1


def test_filesystem_store(orbit_home, tmp_path):
    store_uri = (tmp_path / "store").as_uri()
    fill(open_store(store_uri))
    half = tmp_path / "store" / JOB / checkpoint_part_name(200, 1, 1)  # its node died mid-write
    half.mkdir()
    (half / "__1_0.distcp").write_bytes(b"z" * 10)
    check(orbit_home, store_uri)


@pytest.mark.timeout(120)
def test_s3_store(orbit_home, s3_bucket, aws_env):  # noqa: F811 (fixtures)
    store_uri = f"s3://{s3_bucket}/checkpoints"
    fill(open_store(store_uri))
    client("s3", aws_env).put_object(Bucket=s3_bucket, Key=f"checkpoints/{JOB}/{checkpoint_part_name(200, 1, 1)}/"
                                     "__1_0.distcp", Body=b"z" * 10)
    check(orbit_home, store_uri)
