"""The S3 store's parts against moto's server: uploaded concurrently with their sha256 as
ChecksumSHA256, fetched by ranged GETs and verified part by part, never complete when the
writer is killed mid-upload; version-1 checkpoints of older homes still read and resume."""
from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from orbit_dagster.runtime.checkpointing import STATE_FILE
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.runtime.notices import NoticeWatcher
from orbit_dagster.runtime.sdk import RunContext
from orbit_dagster.storage.base import CheckpointManifest, StoreError
from orbit_dagster.storage.s3 import MIB, S3Store
from tests.helpers import wait_for
from tests.integration.moto_fixtures import aws_env, client, moto_server, s3_bucket  # noqa: F401
from tests.unit.storage.v1_format import write_v1_s3

REPO = Path(__file__).resolve().parents[2]


def _manifest(job: str, step: int) -> CheckpointManifest:
    return CheckpointManifest(job_id=job, step=step, tier="durable", attempt=1, files={})


def _keys(url: str, bucket: str, prefix: str = "") -> list[str]:
    pages = client("s3", url).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for p in pages for o in p.get("Contents", ()))


class Watch:
    """What an S3 operation was called with, and how many of its calls were in flight at once."""

    def __init__(self, store: S3Store, operation: str):
        self.store, self.operation = store, operation
        self.params: list[dict] = []
        self.running = self.most = 0
        self.lock = threading.Lock()

    def before(self, params, **_):
        with self.lock:
            self.params.append({k: v for k, v in params.items() if k != "Body"} | {"body": params.get("Body")})
            self.running += 1
            self.most = max(self.most, self.running)

    def after(self, **_):
        time.sleep(0.05)  # hold the slot a moment: overlapping calls are then seen overlapping
        with self.lock:
            self.running -= 1

    def __enter__(self):
        ev = self.store.client.meta.events
        ev.register(f"before-parameter-build.s3.{self.operation}", self.before)
        ev.register(f"after-call.s3.{self.operation}", self.after)
        return self

    def __exit__(self, *exc):
        ev = self.store.client.meta.events
        ev.unregister(f"before-parameter-build.s3.{self.operation}", self.before)
        ev.unregister(f"after-call.s3.{self.operation}", self.after)


def test_parts_go_up_concurrently_each_with_its_sha256_and_come_back_by_ranged_gets(aws_env, s3_bucket, tmp_path):
    store = S3Store(f"s3://{s3_bucket}/c", part_size=5 * MIB, concurrency=4)
    data = os.urandom(26 * MIB)  # 6 parts, the last short
    with Watch(store, "UploadPart") as up, Watch(store, "CreateMultipartUpload") as create:
        with store.writer("job-c", "step-000000001-a1") as w:
            with w.open("state.pt") as fh:
                for i in range(0, len(data), 3 * MIB):  # torch.save-like writes of any size
                    fh.write(data[i:i + 3 * MIB])
            m = w.commit(_manifest("job-c", 1))
    assert up.most > 1, "parts were uploaded one at a time"
    assert create.params[0]["ChecksumAlgorithm"] == "SHA256"
    by_number = {p["PartNumber"]: p for p in up.params}
    assert sorted(by_number) == [1, 2, 3, 4, 5, 6]
    for n, p in by_number.items():
        part = data[(n - 1) * 5 * MIB:n * 5 * MIB]
        assert p["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(part).digest()).decode()
        assert m.files["state.pt"]["parts"][n - 1] == hashlib.sha256(part).hexdigest()  # the manifest's, the same
    with Watch(store, "GetObject") as get:
        store.fetch(w.uri, tmp_path / "out")
    assert (tmp_path / "out" / "state.pt").read_bytes() == data
    ranges = sorted(p["Range"] for p in get.params if p.get("Range"))
    assert len(ranges) == 6 and get.most > 1


def test_a_flipped_byte_in_any_part_is_refused_naming_the_part_and_its_key(aws_env, s3_bucket, tmp_path):
    store = S3Store(f"s3://{s3_bucket}/flip", part_size=5 * MIB)
    data = os.urandom(12 * MIB)
    uri = store.put("job-x", "step-000000001-a1", {"state.pt": data}, _manifest("job-x", 1))
    s3, key = client("s3", aws_env), "flip/job-x/step-000000001-a1/state.pt"
    for index in range(3):
        flipped = bytearray(data)
        flipped[index * 5 * MIB + 11] ^= 0x80
        s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(flipped))
        named = rf"state\.pt \(s3://{s3_bucket}/{key}\) part {index + 1} of 3 \(bytes {index * 5 * MIB}-"
        with pytest.raises(StoreError, match=named):
            store.verify(uri)
        with pytest.raises(StoreError, match=named):
            store.checkout(uri, tmp_path / f"c{index}")
        assert not list((tmp_path / f"c{index}").rglob("state.pt*"))  # nothing left that failed its check


KILLED_UPLOADER = textwrap.dedent("""
    import os, sys, time
    from orbit_dagster.storage.base import CheckpointManifest
    from orbit_dagster.storage.s3 import MIB, S3Store

    uri, marker = sys.argv[1], sys.argv[2]
    store = S3Store(uri, part_size=5 * MIB, concurrency=2)

    def part_two_hangs(params, **_):
        if params["PartNumber"] == 2:  # part 1 is up or going up: tell the test, then be killed
            open(marker, "w").close()
            time.sleep(120)

    store.client.meta.events.register("before-parameter-build.s3.UploadPart", part_two_hangs)
    store.put("job-k", "step-000000001-a1", {"notes.txt": b"small, first", "state.pt": os.urandom(20 * MIB)},
              CheckpointManifest(job_id="job-k", step=1, tier="durable", files={}))
""")


def test_a_writer_killed_mid_upload_is_never_registered_and_leaves_no_part_visible(aws_env, s3_bucket, tmp_path):
    marker = tmp_path / "uploading"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_UPLOADER, f"s3://{s3_bucket}/k", str(marker)],
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, "the writer ended before it was killed"
        time.sleep(0.5)  # part 1 lands meanwhile (or not): either way it must not be visible
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    store = S3Store(f"s3://{s3_bucket}/k")
    uri = store.uri_for("job-k", "step-000000001-a1")
    assert list(store.list("job-k")) == []
    with pytest.raises(StoreError, match="incomplete: no manifest"):
        store.verify(uri)
    # Only the small file that went up whole before it; the large one's parts sit in an
    # unfinished multipart upload, which no listing shows as an object.
    assert _keys(aws_env, s3_bucket, "k/") == ["k/job-k/step-000000001-a1/notes.txt"]
    uploads = client("s3", aws_env).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["k/job-k/step-000000001-a1/state.pt"]
    # moto reports every upload as started in 2010: the age limit cannot be seen here, only the abort.
    assert store.sweep_uploads("job-k", max_age_s=0) == 1
    assert client("s3", aws_env).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert store.put("job-k", "step-000000001-a1", {"state.pt": b"whole"}, _manifest("job-k", 1)) == uri


def test_a_v1_checkpoint_on_s3_verifies_and_resumes(aws_env, s3_bucket, tmp_path):
    state = {"model": {"w": torch.arange(6.0)}, "step": 2}
    torch.save(state, tmp_path / "blob.pt")
    blob = (tmp_path / "blob.pt").read_bytes()
    s3 = client("s3", aws_env)
    uri = write_v1_s3(s3, s3_bucket, "old", "step-000000002-a1", {STATE_FILE: blob}, job_id="job-o", step=2,
                      tier="durable", attempt=1)
    store = S3Store(f"s3://{s3_bucket}/old")
    assert list(store.list("job-o")) == [uri] and store.verify(uri).version == 1
    ctx = RunContext(job={"job_id": "job-o", "template_snapshot": {}}, bundle_dir=tmp_path, workdir=tmp_path / "w",
                     attempt=2, events=EventWriter(tmp_path / "events.jsonl"), store=store,
                     watcher=NoticeWatcher(None), checkpoint_every=1, memory_every=1, resume_from=uri)
    got = ctx.resume_state()
    ctx.close()
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert not list((tmp_path / "w").glob("resume-*"))  # the fetched copy is gone once loaded
    s3.put_object(Bucket=s3_bucket, Key=f"old/job-o/step-000000002-a1/{STATE_FILE}", Body=b"x" + blob[1:])
    with pytest.raises(StoreError, match="does not match its manifest sha256"):
        store.verify(uri)
