"""The S3 checkpoint store against moto's HTTP server: complete or invisible, verified on read."""
from __future__ import annotations

import os
import time

import pytest

from orbit_dagster.core.errors import OrbitError
from orbit_dagster.settings import Settings
from orbit_dagster.storage import open_store
from orbit_dagster.storage.base import MANIFEST, CheckpointManifest, StoreError, checkpoint_dir_name, sha256_bytes
from orbit_dagster.storage.s3 import MIB, S3Store
from orbit_dagster.storage.s3_parts import PART_TRIES
from tests.integration.moto_fixtures import aws_env, client, moto_server, s3_bucket  # noqa: F401


def _manifest(job: str, step: int, files: dict[str, bytes]) -> CheckpointManifest:
    return CheckpointManifest(job_id=job, step=step, tier="durable", attempt=1, created_at="2026-01-01T00:00:00+00:00",
                              files={k: {"sha256": sha256_bytes(v), "bytes": len(v)} for k, v in files.items()})


def _checkpoint(store: S3Store, job: str, step: int, files: dict[str, bytes] | None = None) -> str:
    files = files or {"state.pt": os.urandom(200_000), "extra/notes.txt": b"step %d" % step}
    return store.put(job, checkpoint_dir_name(step, 1), files, _manifest(job, step, files))


def _keys(url: str, bucket: str, prefix: str = "") -> list[str]:
    pages = client("s3", url).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", ()))


def test_a_checkpoint_round_trips_with_its_manifest_verified(aws_env, s3_bucket, tmp_path):
    store = open_store(f"s3://{s3_bucket}/ckpt")
    assert isinstance(store, S3Store)
    files = {"state.pt": os.urandom(300_000), "extra/notes.txt": b"hello"}
    manifest = _manifest("job-a", 8, files)
    uri = store.put("job-a", "step-000000008-a1", files, manifest)
    assert uri == store.uri_for("job-a", "step-000000008-a1") == f"s3://{s3_bucket}/ckpt/job-a/step-000000008-a1"
    assert list(store.list("job-a")) == [uri]
    assert store.read_manifest(uri).digest == manifest.digest
    assert store.verify(uri).digest == manifest.digest
    got = store.fetch(uri, tmp_path / "out")
    assert got.digest == manifest.digest
    assert (tmp_path / "out" / "state.pt").read_bytes() == files["state.pt"]
    assert (tmp_path / "out" / "extra" / "notes.txt").read_bytes() == b"hello"
    assert (tmp_path / "out" / MANIFEST).is_file()
    assert not list((tmp_path / "out").rglob("*.part"))
    # The same checkpoint sent again is kept once; other bytes under its name are an error.
    assert store.put("job-a", "step-000000008-a1", files, manifest) == uri
    other = {"state.pt": b"different"}
    with pytest.raises(StoreError, match="already exists with other content"):
        store.put("job-a", "step-000000008-a1", other, _manifest("job-a", 8, other))
    assert store.verify(uri).digest == manifest.digest


def test_large_files_go_up_by_multipart_upload(aws_env, s3_bucket, tmp_path):
    store = S3Store(f"s3://{s3_bucket}/mp", multipart_threshold=1 * MIB, part_size=5 * MIB)
    data = os.urandom(11 * MIB + 12345)
    t0 = time.perf_counter()
    uri = store.put("job-mp", "step-000000001-a1", {"state.pt": data}, _manifest("job-mp", 1, {"state.pt": data}))
    put_s = time.perf_counter() - t0
    assert store.stats["multipart_uploads"] == 1 and store.stats["parts"] == 3
    head = client("s3", aws_env).head_object(Bucket=s3_bucket, Key="mp/job-mp/step-000000001-a1/state.pt", PartNumber=1)
    assert head["PartsCount"] == 3  # the server holds it as a 3-part object
    t0 = time.perf_counter()
    store.fetch(uri, tmp_path / "mp")
    fetch_s = time.perf_counter() - t0
    assert (tmp_path / "mp" / "state.pt").read_bytes() == data
    print(f"\n11 MiB on moto: put {len(data) / MIB / put_s:.1f} MiB/s (3 parts), fetch+verify "
          f"{len(data) / MIB / fetch_s:.1f} MiB/s")


def test_a_truncated_or_changed_object_is_rejected_naming_its_key(aws_env, s3_bucket, tmp_path):
    store = open_store(f"s3://{s3_bucket}/t")
    data = os.urandom(100_000)
    uri = _checkpoint(store, "job-t", 4, {"state.pt": data})
    key = "t/job-t/step-000000004-a1/state.pt"
    s3 = client("s3", aws_env)
    s3.put_object(Bucket=s3_bucket, Key=key, Body=data[:-100])
    with pytest.raises(StoreError, match=rf"state\.pt \(s3://{s3_bucket}/{key}\) has 99900 bytes"):
        store.verify(uri)
    with pytest.raises(StoreError, match="truncated"):
        store.fetch(uri, tmp_path / "t")
    assert not (tmp_path / "t" / "state.pt").exists() and not list((tmp_path / "t").rglob("*.part"))
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes([data[0] ^ 1]) + data[1:])  # same size, one bit
    with pytest.raises(StoreError, match=rf"{key}\) part 1 of 1 \(bytes 0-99999\) does not match its manifest sha256"):
        store.verify(uri)
    s3.delete_object(Bucket=s3_bucket, Key=key)
    with pytest.raises(StoreError, match=rf"{key}\) is missing"):
        store.verify(uri)


def test_a_checkpoint_without_manifest_is_invisible_and_unusable(aws_env, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/inc")
    done = _checkpoint(store, "job-i", 4)
    s3 = client("s3", aws_env)
    s3.put_object(Bucket=s3_bucket, Key="inc/job-i/step-000000008-a1/state.pt", Body=b"half a checkpoint")
    assert list(store.list("job-i")) == [done]
    with pytest.raises(StoreError, match="incomplete: no manifest"):
        store.verify(store.uri_for("job-i", "step-000000008-a1"))


def test_a_part_that_fails_once_is_retried_alone(aws_env, s3_bucket):
    store = S3Store(f"s3://{s3_bucket}/retry", multipart_threshold=1 * MIB, part_size=5 * MIB)
    sent: list[int] = []

    def second_part_fails_once(params, **_):
        sent.append(params["PartNumber"])
        if params["PartNumber"] == 2 and sent.count(2) == 1:
            raise ConnectionResetError("link dropped during part 2")

    # Fault injection on the real client: the parameters are built, the request never leaves.
    store.client.meta.events.register("before-parameter-build.s3.UploadPart", second_part_fails_once)
    try:
        data = os.urandom(16 * MIB)
        uri = store.put("job-r", "step-000000001-a1", {"state.pt": data}, _manifest("job-r", 1, {}))
    finally:
        store.client.meta.events.unregister("before-parameter-build.s3.UploadPart", second_part_fails_once)
    assert sorted(sent) == [1, 2, 2, 3, 4] and store.stats["part_retries"] == 1  # part 2 again, nothing else
    assert store.verify(uri).total_bytes == len(data)


def test_a_put_whose_part_keeps_failing_registers_nothing_and_aborts_its_upload(aws_env, s3_bucket):
    store = S3Store(f"s3://{s3_bucket}/fail", multipart_threshold=1 * MIB, part_size=5 * MIB)

    def second_part_fails(params, **_):
        if params["PartNumber"] == 2:
            raise ConnectionResetError("link dropped during part 2")

    store.client.meta.events.register("before-parameter-build.s3.UploadPart", second_part_fails)
    try:
        files = {"small.txt": b"written first", "state.pt": os.urandom(11 * MIB)}
        with pytest.raises(ConnectionResetError):
            store.put("job-f", "step-000000001-a1", files, _manifest("job-f", 1, files))
    finally:
        store.client.meta.events.unregister("before-parameter-build.s3.UploadPart", second_part_fails)
    assert store.stats["aborted_uploads"] == 1 and store.stats["part_retries"] == PART_TRIES - 1
    assert list(store.list("job-f")) == []
    assert _keys(aws_env, s3_bucket, "fail/") == []  # the first file was tidied away too
    assert client("s3", aws_env).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_list_pages_through_many_checkpoints(aws_env, s3_bucket):
    store = S3Store(f"s3://{s3_bucket}/many", list_page_size=3)
    uris = [_checkpoint(store, "job-l", step, {"state.pt": b"x%d" % step}) for step in (12, 4, 8, 16, 20)]
    _checkpoint(store, "job-l0", 1, {"state.pt": b"sibling job with a common prefix"})
    assert list(store.list("job-l")) == sorted(uris)


def test_delete_is_idempotent_and_drops_the_manifest_first(aws_env, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/d")
    uri = _checkpoint(store, "job-d", 4)
    keep = _checkpoint(store, "job-d", 40)  # a sibling whose name starts the same way
    assert store.delete(uri) is True
    assert list(store.list("job-d")) == [keep]
    assert _keys(aws_env, s3_bucket, "d/job-d/step-000000004-a1/") == []
    assert store.delete(uri) is False
    assert store.delete(store.uri_for("job-d", "step-000000099-a1")) is False
    assert store.verify(keep).step == 40


def test_a_missing_bucket_and_bad_settings_are_clear_errors(aws_env, monkeypatch, tmp_path):
    store = open_store("s3://orbit-no-such-bucket/x")
    with pytest.raises(StoreError, match="bucket 'orbit-no-such-bucket' does not exist; create it"):
        list(store.list("job"))
    with pytest.raises(StoreError, match="not a valid S3 bucket name"):
        open_store("s3://No_Such/x")
    with pytest.raises(StoreError, match="below S3's minimum"):
        S3Store("s3://orbit-x/y", part_size=1024)
    with pytest.raises(StoreError, match="ORBIT_S3_MULTIPART_THRESHOLD='lots' is not a number of bytes"):
        S3Store("s3://orbit-x/y", env={"ORBIT_S3_MULTIPART_THRESHOLD": "lots"})  # the settings' snapshot
    monkeypatch.setenv("ORBIT_S3_MULTIPART_THRESHOLD", "lots")
    with pytest.raises(OrbitError, match="ORBIT_S3_MULTIPART_THRESHOLD"):
        Settings.from_env(tmp_path)  # refused where the settings are read
    with pytest.raises(StoreError, match=r"'\.\./escape' is not allowed"):
        S3Store("s3://orbit-x/y", multipart_threshold=MIB).put("j", "n", {"../escape": b""}, _manifest("j", 1, {}))
