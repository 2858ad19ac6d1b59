"""Checkpoint store on a local (or mounted) filesystem. A checkpoint appears by rename.

A writer streams each file into a temp directory (`<job>/.tmp-<name>-...`), its parts hashed
and written at their offsets on the pool's threads (storage/parts.py): whole parts with O_DIRECT
from page-aligned buffers, past the page cache (`_DirectFileSink`; ORBIT_FS_DIRECT=0 turns it
off), the rest through the page cache without a copy, the disk's write-back started every
SYNC_EVERY bytes so the final fsync finds little left; then the manifest is written and
fsynced, and the directory renamed into place: the commit point. Reads verify
every part on several threads; `checkout` reads the checkpoint where it is, without a copy.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Mapping
from urllib.parse import unquote, urlparse

from . import parts as P
from . import reading as V
from .base import (
    MANIFEST,
    MANIFEST_VERSION,
    PART_DIR,
    CheckpointManifest,
    StoreError,
    check_name,
    check_rel,
    deletable,
    parse_checkpoint_dir,
)

DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere files go through the page cache
DIRECT_ALIGN = 4096  # O_DIRECT's offsets, lengths and memory: whole pages (the buffers are page-aligned maps)
SYNC_EVERY = 64 * P.MIB  # bytes written between two early write-backs (fdatasync on a pool thread)
TEMP_MAX_AGE_S = 3600.0


def _path_of(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))
    return Path(uri)


class _FileSink:
    """One file of the temp directory, written at offsets from several threads."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._written = self._synced = 0
        self._lock = threading.Lock()
        self._syncing = threading.Lock()

    def part(self, index: int, offset: int, data: memoryview, digest: bytes) -> None:
        self.write_at(offset, data)

    def write_at(self, offset: int, data: memoryview) -> None:
        """Bytes at their place in the file (any thread, any order)."""
        P.pwrite_full(self.fd, data, offset)
        with self._lock:
            self._written += len(data)
            due = self._written - self._synced >= SYNC_EVERY
        # Start the disk on what is written so far while later parts are produced; one thread
        # at a time (another one syncing covers these bytes too).
        if due and self._syncing.acquire(blocking=False):
            try:
                with self._lock:
                    self._synced = self._written
                os.fdatasync(self.fd)
            finally:
                self._syncing.release()

    def single(self, data: memoryview, digest: bytes) -> None:
        P.pwrite_full(self.fd, data, 0)
        self.finish(len(data), 1)

    def finish(self, nbytes: int, count: int) -> None:
        try:
            os.fsync(self.fd)
        finally:
            self._close()

    def abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _DirectFileSink(_FileSink):
    """A file whose whole parts are written with O_DIRECT, from the page-aligned buffers of an
    `AlignedStream`: past the page cache, whose page allocation made a buffered write's time
    and CPU swing on a virtual machine (bench/direct_write.py, docs/benchmarks.md). The last, shorter part and a file of one
    part go through the page cache (O_DIRECT writes whole blocks); `finish` fsyncs the file,
    which makes both durable. Where the file system refuses O_DIRECT (at the open, or a
    write: EINVAL), the file is written through the page cache as `_FileSink` writes it."""

    def __init__(self, path: Path):
        super().__init__(path)
        try:
            self.direct_fd = os.open(path, os.O_WRONLY | DIRECT)
        except OSError:
            self.direct_fd = -1
        self.direct = self.direct_fd >= 0
        self.stream = P.AlignedStream if self.direct else None  # None: the usual stream

    def part(self, index: int, offset: int, data: memoryview, digest: bytes) -> None:
        if self.direct and len(data) % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0:
            try:
                P.pwrite_full(self.direct_fd, data, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Not for this file system after all: the page cache from here. The fd stays
                # open until `_close` (after every part): another thread may be writing on it.
                self.direct = False
        self.write_at(offset, data)

    def _close(self) -> None:
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        super()._close()


def direct_setting(env: Mapping[str, str] | None) -> bool:
    """ORBIT_FS_DIRECT in `env` (the settings' snapshot, or the host's environment, as the S3
    store's tuning): 1 (the default) writes past the page cache where the OS can, 0 through it
    (a file system where O_DIRECT is slow, or emulated)."""
    raw = (env or {}).get("ORBIT_FS_DIRECT", "1").strip()
    if raw not in ("0", "1"):
        raise StoreError(f"ORBIT_FS_DIRECT={raw!r} is neither 0 nor 1; fix: ORBIT_FS_DIRECT=1 (past the page "
                         "cache, the default) or 0 (through it)")
    return raw == "1"


class FsWriter(P.WriterBase):
    def __init__(self, store: "FsStore", job_id: str, name: str):
        uri = store.uri_for(job_id, name)
        super().__init__(uri, part_size=store.part_size, executor=P.shared_pool(), in_flight=P.threads() + 2)
        self.store, self.final = store, _path_of(uri)
        sweep_temp_dirs(store.root / job_id)
        self.tmp = store.root / job_id / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)

    def _sink(self, rel: str) -> _FileSink:
        # O_DIRECT writes whole pages: parts of another size (a store made with one) go through the page cache.
        direct = self.store.direct and bool(DIRECT) and self.part_size % DIRECT_ALIGN == 0
        return _DirectFileSink(self.tmp / rel) if direct else _FileSink(self.tmp / rel)

    def commit(self, manifest: CheckpointManifest) -> CheckpointManifest:
        self.ready()
        m = replace(manifest, files=dict(self.files), version=MANIFEST_VERSION, part_size=self.part_size,
                    format=manifest.format or "files")
        try:
            with open(self.tmp / MANIFEST, "w") as fh:  # the commit point: last, durable, then renamed
                fh.write(m.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            for d in {(self.tmp / rel).parent for rel in m.files} | {self.tmp}:
                _fsync_dir(d)  # the files' directory entries, before the rename publishes them
            try:
                self.tmp.rename(self.final)
            except OSError:
                if not (self.final / MANIFEST).exists():
                    raise
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.done = True
                return self.store.existing(self.final, m)  # a re-sent checkpoint: the same, or an error
            _fsync_dir(self.final.parent)
        except BaseException:
            self.abort()
            raise
        self.done = True
        return m

    def abort(self) -> None:
        self.abort_streams()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.done = True


class FsStore:
    def __init__(self, root_uri: str, *, part_size: int = P.PART_SIZE, direct: bool = True):
        self.root = _path_of(root_uri).expanduser().resolve()
        self.root_uri = self.root.as_uri()
        if isinstance(part_size, bool) or not isinstance(part_size, int) or part_size < 4096:
            raise StoreError(f"part_size {part_size!r} is not a size in bytes; fix: at least 4096, e.g. {P.PART_SIZE}")
        self.part_size = part_size
        self.direct = direct  # whole parts past the page cache where the OS can (`_DirectFileSink`)

    def uri_for(self, job_id: str, name: str) -> str:
        return (self.root / check_name("job id", job_id) / check_name("checkpoint name", name)).as_uri()

    def existing(self, final: Path, manifest: CheckpointManifest) -> CheckpointManifest:
        """A checkpoint already at `final`: the same one again is fine, another one is an error."""
        have = self.read_manifest(final.as_uri())
        if have.digest == manifest.digest or (have.version != manifest.version and self._same_files(final, have, manifest)):
            return have
        raise StoreError(f"checkpoint {final.as_uri()} already exists with other content (sha256 "
                         f"{have.digest[:12]}, not {manifest.digest[:12]}); fix: a checkpoint is immutable, "
                         "write it under a new name (a new attempt)")

    def _same_files(self, final: Path, have: CheckpointManifest, want: CheckpointManifest) -> bool:
        """An older-format checkpoint re-sent in the new format: the same bytes, part by part?"""
        if set(have.files) != set(want.files) or want.version != 2:
            return False
        for rel, info in want.files.items():
            f = self._file(final.as_uri(), final, rel)
            if f.stat().st_size != info["bytes"]:
                return False
            with open(f, "rb") as fh:
                got = [hashlib.sha256(fh.read(want.part_size)).hexdigest() for _ in info["parts"]]
            if got != info["parts"]:
                return False
        return True

    def writer(self, job_id: str, name: str) -> FsWriter:
        return FsWriter(self, job_id, name)

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

    def read_manifest(self, uri: str) -> CheckpointManifest:
        path = _path_of(uri) / MANIFEST
        try:
            return CheckpointManifest.from_json(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"checkpoint {uri} is incomplete: no manifest; it cannot be used") from None
        except StoreError as exc:
            raise StoreError(f"checkpoint {uri}: {exc}") from exc

    def _file(self, uri: str, base: Path, rel: str) -> Path:
        """A manifest's file, refused when its name or a symlink leads out of the checkpoint."""
        check_rel(rel, uri)
        f = base / rel
        if f.is_symlink() or not f.resolve().is_relative_to(base.resolve()):
            raise StoreError(f"checkpoint {uri}: file {rel} is a link out of the checkpoint; it cannot be used")
        if not f.is_file():
            raise StoreError(f"checkpoint {uri}: file {rel} is missing")
        return f

    def _check(self, uri: str, dest: Path | None = None) -> CheckpointManifest:
        """Verify every file (v2: every part), on several threads, copying into `dest` as it reads."""
        manifest = self.read_manifest(uri)
        base = _path_of(uri)
        sources = {rel: self._file(uri, base, rel) for rel in manifest.files}
        for rel, info in manifest.files.items():
            size = sources[rel].stat().st_size
            if size != int(info["bytes"]):
                raise StoreError(f"checkpoint {uri}: file {rel} has {size} bytes, its manifest says {info['bytes']}: "
                                 "truncated or replaced, it does not match its manifest; fix: do not use it, resume "
                                 "from an older checkpoint")
        if dest is not None:
            for rel in manifest.files:  # every target exists before parts land in it at their offsets
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(b"")
        try:
            if manifest.version == 1:
                V.for_each(P.read_pool(), manifest.files.items(),
                           lambda item: _check_whole(uri, item[0], item[1], sources[item[0]], dest), P.io_threads())
            else:
                _check_parts(uri, manifest, sources, dest)
        except BaseException:
            for rel in manifest.files if dest is not None else ():
                (dest / rel).unlink(missing_ok=True)  # never leave a file that failed its check
            raise
        return manifest

    def verify(self, uri: str) -> CheckpointManifest:
        return self._check(uri)

    def fetch(self, uri: str, dest: Path) -> CheckpointManifest:
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        manifest = self._check(uri, dest)
        (dest / MANIFEST).write_text(manifest.to_json())
        return manifest

    def checkout(self, uri: str, scratch: Path) -> tuple[CheckpointManifest, Path]:
        # Verified where it lies, no copy: its files are read next (from the page cache), and a
        # committed checkpoint is never rewritten (the store refuses other bytes under its name).
        return self._check(uri), _path_of(uri)

    def list(self, job_id: str) -> Iterator[str]:
        job_dir = self.root / check_name("job id", job_id)
        if not job_dir.is_dir():
            return
        for d in sorted(job_dir.iterdir()):
            if parse_checkpoint_dir(d.name) and not d.is_symlink() and (d / MANIFEST).exists():
                yield d.as_uri()

    def parts(self, job_id: str) -> Iterator[str]:
        job_dir = self.root / check_name("job id", job_id)
        if not job_dir.is_dir():
            return
        for d in sorted(job_dir.iterdir()):
            if PART_DIR.match(d.name) and not d.is_symlink():
                yield d.as_uri()

    def delete(self, uri: str) -> bool:
        path = _path_of(uri)
        if not deletable(path.name):
            raise StoreError(f"{uri} is not a checkpoint directory; fix: delete checkpoints by the uri the ledger holds")
        if not path.exists():
            return False
        # Drop the manifest first: a half-deleted checkpoint then reads as incomplete.
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        return True


def _check_whole(uri: str, rel: str, info: dict, src: Path, dest: Path | None) -> None:
    """A version-1 file: one sha256 of the whole file (copied into `dest` as it is read)."""
    h = hashlib.sha256()
    with open(src, "rb") as fh, (open(dest / rel, "wb") if dest is not None else V.Discard()) as out:
        while chunk := fh.read(P.MIB):
            h.update(chunk)
            out.write(chunk)
    if h.hexdigest() != info["sha256"]:
        raise StoreError(f"checkpoint {uri}: file {rel} does not match its manifest sha256; fix: do not use it, "
                         "resume from an older checkpoint")



def _check_parts(uri: str, manifest: CheckpointManifest, sources: dict[str, Path], dest: Path | None) -> None:
    """Version 2: every part of every file read, hashed and compared on the pool (and written
    into `dest` at its offset), with one reused buffer per task in flight."""
    size = manifest.part_size
    tasks = [(rel, *r, len(ranges)) for rel, info in manifest.files.items()
             for ranges in [V.part_ranges(int(info["bytes"]), size)] for r in ranges]
    free: list[bytearray] = []
    lock = threading.Lock()

    def one(task: tuple[str, int, int, int, int]) -> None:
        rel, index, offset, length, count = task
        with lock:
            buf = free.pop() if free else bytearray(size)
        try:
            view = memoryview(buf)[:length]
            fd = os.open(sources[rel], os.O_RDONLY)
            try:
                got = V.pread_full(fd, view, offset)
            finally:
                os.close(fd)
            if got != length or hashlib.sha256(view).hexdigest() != manifest.files[rel]["parts"][index]:
                raise V.part_mismatch(uri, rel, "", index, count, offset, length)
            if dest is not None:
                out = os.open(dest / rel, os.O_WRONLY)
                try:
                    P.pwrite_full(out, view, offset)
                finally:
                    os.close(out)
        finally:
            with lock:
                free.append(buf)

    V.for_each(P.read_pool(), tasks, one, P.io_threads())


def sweep_temp_dirs(job_dir: Path, max_age_s: float = TEMP_MAX_AGE_S) -> int:
    """Remove the temp dirs of writers that died mid-write (killed, host lost). A live writer
    finishes within seconds; one older than an hour is gone. Returns how many were removed."""
    removed = 0
    if not job_dir.is_dir():
        return 0
    for d in job_dir.glob(".tmp-*"):
        try:
            if time.time() - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry itself is flushed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
