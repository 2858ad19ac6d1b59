"""Checkpoint store on S3 (or anything that speaks its API: moto, MinIO).

Layout: `s3://bucket/prefix/<job>/<name>/<file>` plus `<name>/manifest.json`, the same
as the filesystem store. S3 has no rename, so completeness comes from order: every file
is uploaded first (its parts concurrently, each with its sha256 as `ChecksumSHA256`, each
retried alone: storage/s3_parts.py; a file of one part under the threshold as one PUT),
then the manifest, as one PUT. `list()` shows only directories with a manifest, so a
checkpoint cut off half-way is never seen; `verify()` and `fetch()` re-hash every part
(ranged GETs, concurrently) against the manifest, so one truncated or changed afterwards is
rejected with the key and the part named.

This module travels inside every bundle: stdlib only at import, boto3 imported when the
first client is made. Endpoint, region and credentials come from boto3's standard chain
(`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, `AWS_PROFILE`, env, instance role); nothing
here reads a secret. Tuning: `ORBIT_S3_PART_SIZE` (bytes per part, the manifest's too),
`ORBIT_S3_MULTIPART_THRESHOLD` (a one-part file smaller than this goes as one PUT) and
`ORBIT_S3_CONCURRENCY` (parts in flight), in the `env` a store is opened with: the control
plane's settings snapshot (`Settings.open_store`), or the host's environment (the agent),
so a launch can set them. The same `env` keys the shared boto3 client (without one, the
process's first client serves).
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Mapping

from . import parts as P
from . import reading as V
from . import s3_parts as S
from .base import MANIFEST, PART_DIR, CheckpointManifest, StoreError, check_name, check_rel, parse_checkpoint_dir

MIB = 1 << 20
MIN_PART_SIZE = 5 * MIB  # S3's rule for every part but the last
DEFAULT_THRESHOLD = 64 * MIB
DEFAULT_PART_SIZE = 16 * MIB
DEFAULT_CONCURRENCY = 8
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Client settings that change which client we need; credentials are left to boto3's chain.
_CLIENT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION")
_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


class S3StoreError(StoreError):
    """A StoreError caused by S3 itself; `code` is AWS's error code, `__cause__` the botocore error."""

    def __init__(self, message: str, *, code: str = "", operation: str = ""):
        self.code = code
        self.operation = operation
        super().__init__(message)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b"); a clear StoreError for anything else."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise StoreError(f"{uri!r} is not an s3:// uri; fix: write it as s3://BUCKET/PREFIX")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not _BUCKET_RE.match(bucket):
        raise StoreError(f"bucket {bucket!r} in {uri!r} is not a valid S3 bucket name; "
                         "fix: 3-63 characters of a-z, 0-9, '.' and '-'")
    return bucket, key.strip("/")


class BadTuning(StoreError):
    """A multipart setting that is not a size: `field`, `value` and `fix` say which and how."""

    def __init__(self, message: str, *, field: str, value: object, fix: str):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"{message}; fix: {fix}")


def _env_bytes(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadTuning(f"{name}={raw!r} is not a number{'' if name.endswith('CONCURRENCY') else ' of bytes'}",
                        field=name, value=raw,
                        fix=f"e.g. {name}={default}") from None
    if value <= 0:
        raise BadTuning(f"{name}={raw!r} must be positive", field=name, value=raw, fix=f"e.g. {name}={default}")
    return value


def tuning(env: Mapping[str, str]) -> dict[str, int]:
    """The part size, threshold and concurrency `env` sets (or the defaults), checked: S3Store's keyword arguments."""
    sizes = {"multipart_threshold": _env_bytes(env, "ORBIT_S3_MULTIPART_THRESHOLD", DEFAULT_THRESHOLD),
             "part_size": _env_bytes(env, "ORBIT_S3_PART_SIZE", DEFAULT_PART_SIZE),
             "concurrency": _env_bytes(env, "ORBIT_S3_CONCURRENCY", DEFAULT_CONCURRENCY)}
    if sizes["part_size"] < MIN_PART_SIZE:
        raise BadTuning(f"S3 part size {sizes['part_size']} is below S3's minimum of {MIN_PART_SIZE} bytes",
                        field="ORBIT_S3_PART_SIZE", value=env.get("ORBIT_S3_PART_SIZE"),
                        fix=f"set part_size / ORBIT_S3_PART_SIZE to at least {MIN_PART_SIZE}")
    return sizes


def _new_client() -> Any:
    # lazy: a host may have nothing but Python and torch, and this module is imported with the package
    # (storage/factory.py): the fs store must work without boto3
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10, read_timeout=60,
                    user_agent_extra="orbit-dagster")
    return boto3.session.Session().client("s3", config=config)


def default_client(env: Mapping[str, str] | None = None) -> Any:
    """One boto3 S3 client per process and endpoint/profile/region setting of `env` (clients
    are thread-safe, and making one takes a second on a busy machine). boto3 reads those
    settings from the process environment itself; `env` says what it holds (the settings'
    snapshot, the host's environment), and without one the process shares one client."""
    key = (os.getpid(), *((env.get(k) for k in _CLIENT_ENV) if env is not None else ("process",)))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _new_client()
        return client


class S3Store:
    def __init__(self, root_uri: str, *, client: Any = None, multipart_threshold: int | None = None,
                 part_size: int | None = None, list_page_size: int | None = None, concurrency: int | None = None,
                 env: Mapping[str, str] | None = None):
        self.bucket, self.prefix = parse_s3_uri(root_uri)
        self.root_uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self._client, self._env = client, env
        sizes = tuning(env or {})
        self.multipart_threshold = multipart_threshold or sizes["multipart_threshold"]
        self.part_size = part_size or sizes["part_size"]
        self.concurrency = concurrency or sizes["concurrency"]
        if self.part_size < MIN_PART_SIZE:
            raise StoreError(f"S3 part size {self.part_size} is below S3's minimum of {MIN_PART_SIZE} bytes; "
                             f"fix: set part_size / ORBIT_S3_PART_SIZE to at least {MIN_PART_SIZE}")
        self.list_page_size = list_page_size
        # What this store object did, for tests and benchmarks (not persisted anywhere).
        self.stats = {"single_puts": 0, "multipart_uploads": 0, "parts": 0, "aborted_uploads": 0, "part_retries": 0}
        self._stats_lock = threading.Lock()
        self._swept: set[str] = set()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = default_client(self._env)
        return self._client

    def count(self, name: str) -> None:
        with self._stats_lock:  # parts finish on several threads
            self.stats[name] += 1

    def pool(self) -> ThreadPoolExecutor:
        """One pool per concurrency, shared by the process's stores."""
        return P.process_pool("orbit-s3", self.concurrency)

    # ---- names --------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p and p.strip("/"))

    def uri_for(self, job_id: str, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(check_name('job id', job_id), check_name('checkpoint name', name))}"

    def call(self, operation: str, key: str, **kw: Any) -> Any:
        """One S3 call; a botocore error leaves as S3StoreError naming the key (cause kept)."""
        from botocore.exceptions import BotoCoreError, ClientError  # lazy: see _new_client

        try:
            return getattr(self.client, operation)(**kw)
        except ClientError as exc:
            code = str((exc.response.get("Error") or {}).get("Code") or "")
            raise S3StoreError(_explain(operation, code, self.bucket if "Bucket" not in kw else kw["Bucket"], key),
                               code=code, operation=operation) from exc
        except BotoCoreError as exc:
            raise S3StoreError(f"S3 {operation} of s3://{kw.get('Bucket', self.bucket)}/{key} failed: "
                               f"{type(exc).__name__}: {exc}; fix: check the endpoint and the network, then retry",
                               code=type(exc).__name__, operation=operation) from exc

    # ---- write --------------------------------------------------------------------
    def writer(self, job_id: str, name: str) -> S.S3Writer:
        return S.S3Writer(self, job_id, name)

    def put(self, job_id: str, name: str, files: dict[str, bytes], manifest: CheckpointManifest) -> str:
        uri = self.uri_for(job_id, name)
        for rel in files:  # every name checked before anything is written
            check_rel(rel, uri)
        with self.writer(job_id, name) as w:
            for rel, data in files.items():
                w.add(rel, data)
            done = w.commit(manifest)
        manifest.files, manifest.version, manifest.part_size, manifest.format = (
            done.files, done.version, done.part_size, done.format)
        return w.uri

    def existing(self, uri: str, manifest: CheckpointManifest) -> CheckpointManifest:
        """The checkpoint already at `uri`: the same one again is fine, another one is an error."""
        have = self.read_manifest(uri)
        if have.digest == manifest.digest or (have.version != manifest.version and self._same_files(uri, have, manifest)):
            return have
        raise StoreError(f"checkpoint {uri} already exists with other content (sha256 {have.digest[:12]}, "
                         f"not {manifest.digest[:12]}); fix: a checkpoint is immutable, write it under a new "
                         "name (a new attempt)")

    def _same_files(self, uri: str, have: CheckpointManifest, want: CheckpointManifest) -> bool:
        """An older-format checkpoint re-sent in the new format: the same bytes, part by part?"""
        if set(have.files) != set(want.files) or want.version != 2:
            return False
        bucket, base = parse_s3_uri(uri)
        try:
            S.read_parts(self, uri, bucket, base, want, None)
        except StoreError:
            return False
        return True

    def sweep_uploads(self, job_id: str, max_age_s: float = S.UPLOAD_MAX_AGE_S) -> int:
        """Abort the job's multipart uploads older than `max_age_s` (killed writers'); how many."""
        return S.sweep_uploads(self, self.key(job_id) + "/", max_age_s)

    def sweep_once(self, job_id: str) -> None:
        """Sweep before this store's first write of a job: once, so this process's own writers
        (a durable save and an emergency one at once) never race a sweep of each other."""
        with self._stats_lock:
            first = job_id not in self._swept
            self._swept.add(job_id)
        if first:
            self.sweep_uploads(job_id)

    # ---- read ---------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        try:
            self.call("head_object", key, Bucket=self.bucket, Key=key)
            return True
        except S3StoreError as exc:
            if exc.code in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def read_manifest(self, uri: str) -> CheckpointManifest:
        bucket, base = parse_s3_uri(uri)
        key = f"{base}/{MANIFEST}"
        try:
            body = self.call("get_object", key, Bucket=bucket, Key=key)["Body"].read()
        except S3StoreError as exc:
            if exc.code in ("NoSuchKey", "404"):
                raise StoreError(f"checkpoint {uri} is incomplete: no manifest; it cannot be used") from exc
            raise
        try:
            return CheckpointManifest.from_json(body.decode())
        except (ValueError, TypeError) as exc:
            raise StoreError(f"checkpoint {uri}: manifest s3://{bucket}/{key} is not a valid manifest: {exc}") from exc

    def _sizes(self, uri: str, bucket: str, base: str, manifest: CheckpointManifest) -> None:
        """Every object there with its manifest's size (HEAD, concurrently): missing or truncated named."""
        def one(item: tuple[str, dict]) -> None:
            rel, info = item
            key = f"{base}/{check_rel(rel, uri)}"
            try:
                size = int(self.call("head_object", key, Bucket=bucket, Key=key)["ContentLength"])
            except S3StoreError as exc:
                if exc.code in ("NoSuchKey", "404", "NotFound"):
                    raise StoreError(f"checkpoint {uri}: file {rel} (s3://{bucket}/{key}) is missing") from exc
                raise
            if size != int(info["bytes"]):
                raise StoreError(f"checkpoint {uri}: file {rel} (s3://{bucket}/{key}) has {size} bytes, its manifest "
                                 f"says {info['bytes']}: truncated or replaced, it does not match its manifest; fix: do "
                                 "not use it, resume from an older checkpoint")

        V.for_each(self.pool(), manifest.files.items(), one, self.concurrency)

    def _stream(self, uri: str, bucket: str, key: str, rel: str, info: dict, sink: Any = None) -> None:
        """A version-1 object, hashed as it streams; StoreError naming the key on any mismatch."""
        body = self.call("get_object", key, Bucket=bucket, Key=key)["Body"]
        h = hashlib.sha256()
        for chunk in body.iter_chunks(MIB):
            h.update(chunk)
            if sink is not None:
                sink.write(chunk)
        if h.hexdigest() != info["sha256"]:
            raise StoreError(f"checkpoint {uri}: file {rel} (s3://{bucket}/{key}) does not match its manifest "
                             "sha256; fix: do not use it, resume from an older checkpoint")

    def _check(self, uri: str, dest: Path | None) -> CheckpointManifest:
        manifest = self.read_manifest(uri)
        bucket, base = parse_s3_uri(uri)
        self._sizes(uri, bucket, base, manifest)
        if dest is not None:
            for rel in manifest.files:  # every target exists before parts land in it at their offsets
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).with_name((dest / rel).name + ".part").write_bytes(b"")
        try:
            if manifest.version == 1:
                def whole(item: tuple[str, dict]) -> None:
                    rel, info = item
                    with open(dest / f"{rel}.part", "wb") if dest is not None else V.Discard() as fh:
                        self._stream(uri, bucket, f"{base}/{rel}", rel, info, sink=fh)

                V.for_each(self.pool(), manifest.files.items(), whole, self.concurrency)
            else:
                S.read_parts(self, uri, bucket, base, manifest, dest, suffix=".part")
        except BaseException:
            for rel in manifest.files if dest is not None else ():
                (dest / f"{rel}.part").unlink(missing_ok=True)  # never leave a file that failed its check
            raise
        for rel in manifest.files if dest is not None else ():
            (dest / f"{rel}.part").replace(dest / rel)
        return manifest

    def verify(self, uri: str) -> CheckpointManifest:
        return self._check(uri, None)

    def fetch(self, uri: str, dest: Path) -> CheckpointManifest:
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        manifest = self._check(uri, dest)
        (dest / MANIFEST).write_text(manifest.to_json())
        return manifest

    def checkout(self, uri: str, scratch: Path) -> tuple[CheckpointManifest, Path]:
        return self.fetch(uri, scratch), Path(scratch)

    def _keys(self, bucket: str, prefix: str) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError  # lazy: see _new_client

        paging = {"PageSize": self.list_page_size} if self.list_page_size else {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, PaginationConfig=paging)
            for page in pages:
                for obj in page.get("Contents", ()):
                    yield obj["Key"]
        except (ClientError, BotoCoreError) as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) or type(exc).__name__
            raise S3StoreError(_explain("list_objects_v2", code, bucket, prefix), code=code,
                               operation="list_objects_v2") from exc

    def list(self, job_id: str) -> Iterator[str]:
        job_prefix = self.key(job_id) + "/"
        names = set()
        for key in self._keys(self.bucket, job_prefix):
            name, _, rest = key[len(job_prefix):].partition("/")
            if rest == MANIFEST and parse_checkpoint_dir(name):  # a checkpoint, not a node's part of one
                names.add(name)
        for name in sorted(names):
            yield f"s3://{self.bucket}/{job_prefix}{name}"

    def parts(self, job_id: str) -> Iterator[str]:
        job_prefix = self.key(job_id) + "/"
        names = {key[len(job_prefix):].partition("/")[0] for key in self._keys(self.bucket, job_prefix)}
        for name in sorted(n for n in names if PART_DIR.match(n)):
            yield f"s3://{self.bucket}/{job_prefix}{name}"

    # ---- delete -------------------------------------------------------------------
    def delete_keys(self, keys: list[str], *, quiet: bool = False) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            try:
                self.call("delete_objects", batch[0]["Key"], Bucket=self.bucket,
                          Delete={"Objects": batch, "Quiet": True})
            except StoreError:
                if not quiet:
                    raise

    def delete(self, uri: str) -> bool:
        bucket, base = parse_s3_uri(uri)
        if bucket != self.bucket:
            return S3Store(uri, client=self.client).delete(uri)
        keys = list(self._keys(bucket, base + "/"))
        manifest = f"{base}/{MANIFEST}"
        # Manifest first: a half-deleted checkpoint then reads as incomplete, never as corrupt.
        if manifest in keys:
            self.call("delete_object", manifest, Bucket=bucket, Key=manifest)
        self.delete_keys([k for k in keys if k != manifest])
        return bool(keys)

    _call, _key, _exists, _delete_keys = call, key, exists, delete_keys  # the names tests and older callers use



def _explain(operation: str, code: str, bucket: str, key: str) -> str:
    where = f"S3 {operation} of s3://{bucket}/{key} failed: {code or 'error'}"
    fixes = {
        "NoSuchBucket": f"bucket {bucket!r} does not exist; create it or correct the store uri",
        "AccessDenied": "the credentials in the standard AWS chain may not access this bucket; check their policy",
        "InvalidAccessKeyId": "the access key in the standard AWS chain is unknown to this endpoint",
        "SignatureDoesNotMatch": "the secret key in the standard AWS chain does not match its access key",
        "SlowDown": "S3 is throttling; retry with backoff",
    }
    return f"{where}; fix: {fixes.get(code, 'check the endpoint, the bucket and the credentials, then retry')}"
