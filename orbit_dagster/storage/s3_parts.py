"""The S3 store's parts: uploaded and downloaded concurrently, each checked, each retried alone.

A checkpoint file goes up as a multipart upload whose parts are the manifest's parts
(storage/parts.py): each part's sha256 is sent as its `ChecksumSHA256`, so S3 itself refuses
a part that arrives other than it was hashed. Parts upload on the store's pool of
`ORBIT_S3_CONCURRENCY` threads while the file is still being produced; a part that fails is
retried alone (PART_TRIES, with back-off), never the whole file. An upload is made visible
only by CompleteMultipartUpload and the checkpoint only by its manifest, written last;
anything unfinished is aborted (and a writer killed mid-upload leaves an invisible upload
that a later process writing the job's checkpoints aborts once it is an hour old, `sweep_uploads`).

Reading a version-2 checkpoint fetches its parts by ranged GETs on the same pool, each
verified against its digest before it is written at its offset.

Stdlib only at import (boto3 comes with the store's client).
"""
from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from . import parts as P
from . import reading as V
from .base import MANIFEST, MANIFEST_VERSION, CheckpointManifest, StoreError

MAX_PARTS = 10_000
PART_TRIES = 4
BACKOFF_S = 0.2
UPLOAD_MAX_AGE_S = 3600.0
# Codes no retry changes: the request itself is wrong, or what it names is gone.
FATAL_CODES = frozenset({"AccessDenied", "NoSuchBucket", "NoSuchUpload", "NoSuchKey", "404", "InvalidAccessKeyId",
                         "SignatureDoesNotMatch", "InvalidRange", "InvalidPart", "InvalidPartOrder", "EntityTooSmall"})


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def retrying(store: Any, fn: Callable[[], Any]) -> Any:
    """fn() up to PART_TRIES times: one part's request, retried alone (botocore's own retries
    come first; these cover a connection dropped mid-part and what botocore gave up on)."""
    for attempt in range(1, PART_TRIES + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified here: fatal codes leave at once
            if attempt == PART_TRIES or getattr(exc, "code", None) in FATAL_CODES:
                raise
            store.count("part_retries")
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


class UploadSink:
    """One file of a checkpoint: a single PUT (one small part) or a multipart upload."""

    def __init__(self, store: Any, key: str, written: list[str]):
        self.store, self.key, self._written = store, key, written
        self.upload_id: str | None = None
        self._parts: dict[int, dict] = {}
        self._lock = threading.Lock()

    def _call(self, operation: str, **kw: Any) -> Any:
        return self.store.call(operation, self.key, Bucket=self.store.bucket, Key=self.key, **kw)

    def _upload(self) -> str:
        with self._lock:
            if self.upload_id is None:
                self.upload_id = retrying(self.store, lambda: self._call(
                    "create_multipart_upload", ChecksumAlgorithm="SHA256")["UploadId"])
            return self.upload_id

    def part(self, index: int, offset: int, data: memoryview, digest: bytes) -> None:
        if index >= MAX_PARTS:
            raise StoreError(f"s3://{self.store.bucket}/{self.key}: more than {MAX_PARTS} parts of "
                             f"{self.store.part_size} bytes; fix: raise ORBIT_S3_PART_SIZE")
        upload, body, checksum = self._upload(), bytes(data), b64(digest)
        resp = retrying(self.store, lambda: self._call("upload_part", UploadId=upload, PartNumber=index + 1,
                                                        Body=body, ChecksumSHA256=checksum))
        with self._lock:
            self._parts[index] = {"PartNumber": index + 1, "ETag": resp["ETag"], "ChecksumSHA256": checksum}
        self.store.count("parts")

    def single(self, data: memoryview, digest: bytes) -> None:
        if len(data) >= self.store.multipart_threshold:  # one part, but large: a multipart upload of one
            self.part(0, 0, data, digest)
            self.finish(len(data), 1)
            return
        body = bytes(data)
        retrying(self.store, lambda: self._call("put_object", Body=body, ChecksumSHA256=b64(digest)))
        self._written.append(self.key)
        self.store.count("single_puts")

    def finish(self, nbytes: int, count: int) -> None:
        parts = [self._parts[i] for i in range(count)]
        upload = self._upload()
        retrying(self.store, lambda: self._call("complete_multipart_upload", UploadId=upload,
                                                MultipartUpload={"Parts": parts}))
        self._written.append(self.key)
        self.store.count("multipart_uploads")

    def abort(self) -> None:
        # An unfinished upload is invisible but billed: abort it.
        if self.upload_id is not None and self.key not in self._written:
            try:
                self._call("abort_multipart_upload", UploadId=self.upload_id)
                self.store.count("aborted_uploads")
            except StoreError:
                pass


class S3Writer(P.WriterBase):
    """Files straight to their keys, the manifest last. If the checkpoint already exists, the
    files go under a temp prefix instead (never over a committed checkpoint's objects), and
    the commit compares the two."""

    def __init__(self, store: Any, job_id: str, name: str):
        super().__init__(store.uri_for(job_id, name), part_size=store.part_size, executor=store.pool(),
                         in_flight=store.concurrency + 2)
        self.store = store
        self.final = store.key(job_id, name)
        store.sweep_once(job_id)
        self.exists = store.exists(f"{self.final}/{MANIFEST}")
        self.base = store.key(job_id, f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}") if self.exists else self.final
        self.written: list[str] = []

    def _sink(self, rel: str) -> UploadSink:
        return UploadSink(self.store, f"{self.base}/{rel}", self.written)

    def commit(self, manifest: CheckpointManifest) -> CheckpointManifest:
        self.ready()
        m = replace(manifest, files=dict(self.files), version=MANIFEST_VERSION, part_size=self.part_size,
                    format=manifest.format or "files")
        if self.exists:  # a re-sent checkpoint: the same one, or an error; ours is discarded either way
            self.abort()
            return self.store.existing(self.uri, m)
        try:
            key = f"{self.final}/{MANIFEST}"
            body = m.to_json().encode()
            # Last, and one PUT: the checkpoint exists from this moment, complete.
            retrying(self.store, lambda: self.store.call("put_object", key, Bucket=self.store.bucket, Key=key,
                                                         Body=body, ContentType="application/json",
                                                         ChecksumSHA256=b64(hashlib.sha256(body).digest())))
        except BaseException:
            self.abort()
            raise
        self.done = True
        return m

    def abort(self) -> None:
        self.abort_streams()
        self.store.delete_keys(self.written, quiet=True)  # invisible anyway without a manifest; tidy up
        self.written.clear()
        self.done = True


def sweep_uploads(store: Any, prefix: str, max_age_s: float = UPLOAD_MAX_AGE_S) -> int:
    """Abort the multipart uploads under `prefix` older than `max_age_s`: what writers killed
    mid-upload left (invisible, but billed). A live writer finishes long before. Returns how many."""
    now, aborted = datetime.now(timezone.utc), 0
    resp = store.call("list_multipart_uploads", prefix, Bucket=store.bucket, Prefix=prefix)
    for up in resp.get("Uploads", ()):
        started = up.get("Initiated")
        if isinstance(started, datetime) and (now - started).total_seconds() > max_age_s:
            try:
                store.call("abort_multipart_upload", up["Key"], Bucket=store.bucket, Key=up["Key"],
                           UploadId=up["UploadId"])
                aborted += 1
            except StoreError:
                continue
    return aborted


def read_parts(store: Any, uri: str, bucket: str, base: str, manifest: CheckpointManifest, dest: Path | None,
               suffix: str = "") -> None:
    """Every part of every file by ranged GETs on the pool, each verified (and written into
    `dest`, to `<file><suffix>`, which must exist)."""
    tasks = [(rel, *r, len(ranges)) for rel, info in manifest.files.items()
             for ranges in [V.part_ranges(int(info["bytes"]), manifest.part_size)] for r in ranges]

    def one(task: tuple[str, int, int, int, int]) -> None:
        rel, index, offset, length, count = task
        key = f"{base}/{rel}"
        rng = f"bytes={offset}-{offset + length - 1}"
        data = retrying(store, lambda: store.call("get_object", key, Bucket=bucket, Key=key, Range=rng)["Body"].read())
        if len(data) != length or hashlib.sha256(data).hexdigest() != manifest.files[rel]["parts"][index]:
            raise V.part_mismatch(uri, rel, f" (s3://{bucket}/{key})", index, count, offset, length)
        if dest is not None:
            fd = os.open(dest / f"{rel}{suffix}", os.O_WRONLY)
            try:
                P.pwrite_full(fd, memoryview(data), offset)
            finally:
                os.close(fd)

    V.for_each(store.pool(), tasks, one, store.concurrency)
