"""Files cut into fixed-size parts, each hashed (and written, or uploaded) on a pool of threads.

One sequential sha256 stream (0.5-1.1 GB/s on one core) used to finish before a checkpoint's
write could start. Here a file is written through a `PartStream`: every `part_size` bytes
become a part whose sha256 and write (a `pwrite` at its offset, or an S3 part upload) run on
a thread of the pool while the caller goes on producing the next one; hashlib and the I/O
release the GIL, so parts are hashed on all cores and overlap the I/O. Reading is the
mirror image (`for_each`): parts read and verified on several threads.

A part's bytes are either copied into one of the stream's reused part buffers (small writes:
torch.save's headers, a tensor's tail) or, for every whole part inside one large `write` (a
tensor's storage), hashed and written straight from the caller's buffer: torch passes a
view of memory it owns only during the call, so `write` waits for those parts before it
returns. At most `in_flight` parts are queued or running per stream (memory stays bounded).

Stdlib only: this package travels in every bundle.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Protocol, TypeVar

from .base import StoreError, check_rel

MIB = 1 << 20
PART_SIZE = 16 * MIB  # the S3 store's part too: one part scheme, one digest per S3 part
T = TypeVar("T")
R = TypeVar("R")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """Hashing and disk threads: one per core, at least 2 (one hashes while one writes), at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


def shared_pool() -> ThreadPoolExecutor:
    """The process's pool for hashing and local disk I/O (tasks on it never wait for each other)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="orbit-parts")
        return _pool


class PartSink(Protocol):
    """Where a stream's parts go: a file at offsets, or an S3 multipart upload."""

    def part(self, index: int, offset: int, data: memoryview, digest: bytes) -> None:
        """Store part `index` (0-based) at byte `offset`; runs on a pool thread, parts in any order."""

    def single(self, data: memoryview, digest: bytes) -> None:
        """The whole file, of at most one part, on the caller's thread (an S3 store: one PUT)."""

    def finish(self, nbytes: int, count: int) -> None:
        """Every part stored: make the file whole and durable (fsync; complete the upload)."""

    def abort(self) -> None:
        """Discard what was stored (called after every part task has ended)."""


class PartStream:
    """A write-only binary file whose parts are hashed and stored on the pool as it fills."""

    def __init__(self, sink: PartSink, *, part_size: int, executor: Executor, in_flight: int,
                 on_close: Callable[[dict], None] | None = None):
        self._sink, self._part, self._executor = sink, int(part_size), executor
        self._slots = threading.BoundedSemaphore(max(1, in_flight))
        self._on_close = on_close
        self._free: list[bytearray] = []
        self._free_lock = threading.Lock()
        self._buf: bytearray | None = None
        self._fill = 0
        self._held: bytearray | None = None  # a full buffered part, submitted once more bytes come
        self._count = 0  # parts given an index so far
        self._size = 0
        self._digests: dict[int, bytes] = {}
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self.closed = False
        self.entry: dict | None = None

    # ---- file-like ------------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._raise()

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed checkpoint file")
        self._raise()
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n, pos, part = len(view), 0, self._part
        if self._buf is not None:  # top up the part being filled
            pos = min(n, part - self._fill)
            self._buf[self._fill:self._fill + pos] = view[:pos]
            self._fill += pos
            if self._fill == part:
                self._held, self._buf, self._fill = self._buf, None, 0
        direct = []
        while n - pos >= part:  # whole parts straight from the caller's memory, no copy
            self._release_held()
            direct.append(self._submit(view[pos:pos + part], None))
            pos += part
        if pos < n:
            self._release_held()
            self._buf = self._take_buffer()
            self._fill = n - pos
            self._buf[:self._fill] = view[pos:]
        self._size += n
        if direct:  # `data` is only ours during this call
            wait(direct)
            self._raise()
        return n

    def close(self) -> dict:
        """Store the last part, wait for every part, finish the file; its manifest entry."""
        if self.closed:
            return self.entry or {}
        self.closed = True
        try:
            self._raise()
            if self._count == 0:  # nothing submitted: at most one part, held or being filled
                if self._held is not None:
                    data = memoryview(self._held)
                else:
                    data = memoryview(self._buf if self._buf is not None else b"")[:self._fill]
                digest = hashlib.sha256(data).digest()
                self._sink.single(data, digest)  # the whole file in one go (an empty one has no parts)
                if len(data):
                    self._digests[0], self._count = digest, 1
            else:
                self._release_held()
                if self._fill:
                    self._submit(memoryview(self._buf)[:self._fill], self._buf)
                    self._buf, self._fill = None, 0
                wait(self._futures)
                self._raise()
                self._sink.finish(self._size, self._count)
        except BaseException:
            self.abort()
            raise
        self.entry = {"bytes": self._size, "parts": [self._digests[i].hex() for i in range(self._count)]}
        if self._on_close:
            self._on_close(self.entry)
        return self.entry

    def abort(self) -> None:
        """Stop: wait for the parts in flight, then discard the file (nothing of it is visible)."""
        self.closed = True
        self._error = self._error or StoreError("checkpoint file aborted")
        wait(self._futures)
        self._sink.abort()

    def __enter__(self) -> "PartStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif not self.entry:
            self.abort()

    # ---- parts ----------------------------------------------------------------------
    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _take_buffer(self) -> bytearray:
        with self._free_lock:
            return self._free.pop() if self._free else bytearray(self._part)

    def _release_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._submit(memoryview(held), held)

    def _submit(self, view: memoryview, buf: bytearray | None) -> Future:
        self._slots.acquire()  # backpressure: at most in_flight parts queued or running
        index, self._count = self._count, self._count + 1
        try:
            fut = self._executor.submit(self._run, index, index * self._part, view, buf)
        except BaseException:
            self._slots.release()
            raise
        self._futures.append(fut)
        return fut

    def _run(self, index: int, offset: int, view: memoryview, buf: bytearray | None) -> None:
        try:
            if self._error is None:  # after a failure the rest is not worth storing
                digest = hashlib.sha256(view).digest()  # releases the GIL: parts hash in parallel
                self._sink.part(index, offset, view, digest)
                self._digests[index] = digest
        except BaseException as exc:  # raised on the caller's thread (write, close)
            if self._error is None:
                self._error = exc
        finally:
            view.release()
            if buf is not None:
                with self._free_lock:
                    self._free.append(buf)
            self._slots.release()


def for_each(executor: Executor, items: Iterable[T], fn: Callable[[T], R], in_flight: int) -> list[R]:
    """fn(item) for every item on the pool, at most `in_flight` at a time; the results in order.
    The first failure (in item order) is raised once every started task has ended; after a
    failure no new task starts."""
    slots = threading.BoundedSemaphore(max(1, in_flight))
    futures: list[Future] = []
    failed = threading.Event()

    def run(item: T) -> R:
        try:
            if failed.is_set():
                raise _Skipped()
            return fn(item)
        except BaseException:
            failed.set()
            raise
        finally:
            slots.release()

    for item in items:
        slots.acquire()
        if failed.is_set():
            slots.release()
            break
        futures.append(executor.submit(run, item))
    wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    real = [e for e in errors if not isinstance(e, _Skipped)]
    if real:
        raise real[0]
    return [f.result() for f in futures]


class _Skipped(Exception):
    """A task not run because an earlier one failed."""


def part_ranges(nbytes: int, part_size: int) -> list[tuple[int, int, int]]:
    """(index, offset, length) of every part of a file."""
    return [(i, off, min(part_size, nbytes - off)) for i, off in enumerate(range(0, nbytes, part_size))]


def part_mismatch(uri: str, rel: str, where: str, index: int, count: int, offset: int, length: int) -> StoreError:
    return StoreError(f"checkpoint {uri}: file {rel}{where} part {index + 1} of {count} (bytes {offset}-"
                      f"{offset + length - 1}) does not match its manifest sha256; fix: do not use it, resume from "
                      "an older checkpoint")


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Fill `buf` from `offset` (fewer bytes only at the end of the file)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def pwrite_full(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


class Digester:
    """One file checked against its manifest entry (either version) as it is read in order,
    in chunks of any size, on one thread (an SFTP copy, an import): `update`, then `problem`."""

    def __init__(self, info: dict, version: int, part_size: int):
        self.info, self.version, self.part_size = info, version, int(part_size)
        self._h = hashlib.sha256()
        self._in_part = 0
        self.parts: list[str] = []
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self.version == 1:
            self._h.update(view)
            return
        while view:
            take = min(len(view), self.part_size - self._in_part)
            self._h.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == self.part_size:
                self.parts.append(self._h.hexdigest())
                self._h, self._in_part = hashlib.sha256(), 0

    def problem(self) -> str | None:
        """None when the bytes read are the manifest's; else what differs, in words."""
        if self.size != int(self.info["bytes"]):
            return f"{self.size} bytes, its manifest says {self.info['bytes']}"
        if self.version == 1:
            return None if self._h.hexdigest() == self.info["sha256"] else "does not match its manifest sha256"
        parts = self.parts + ([self._h.hexdigest()] if self._in_part else [])
        for i, (got, want) in enumerate(zip(parts, self.info["parts"])):
            if got != want:
                return f"part {i + 1} of {len(self.info['parts'])} does not match its manifest sha256"
        return None if len(parts) == len(self.info["parts"]) else "does not match its manifest's part count"


class Discard:
    """A binary sink that keeps nothing (a verify that reads without writing), as a context manager."""

    def write(self, data: bytes) -> None:
        pass

    def __enter__(self) -> "Discard":
        return self

    def __exit__(self, *exc) -> None:
        pass


class WriterBase:
    """The bookkeeping every store's CheckpointWriter shares: names checked, one stream per
    file, the entries the manifest is made of, abort on an exception or a missing commit."""

    def __init__(self, uri: str, *, part_size: int, executor: Executor, in_flight: int):
        self.uri, self.part_size = uri, int(part_size)
        self._executor, self._in_flight = executor, in_flight
        self.files: dict[str, dict] = {}
        self._streams: dict[str, PartStream] = {}
        self.done = False

    def _sink(self, rel: str) -> PartSink:
        raise NotImplementedError

    def open(self, rel: str) -> PartStream:
        check_rel(rel, self.uri)
        if self.done:
            raise StoreError(f"checkpoint {self.uri}: already committed or aborted; fix: open a new writer")
        if rel in self.files or rel in self._streams:
            raise StoreError(f"checkpoint {self.uri}: file {rel} written twice; fix: one stream per file")
        stream = PartStream(self._sink(rel), part_size=self.part_size, executor=self._executor,
                            in_flight=self._in_flight, on_close=lambda entry: self._closed(rel, entry))
        self._streams[rel] = stream
        return stream

    def _closed(self, rel: str, entry: dict) -> None:
        self._streams.pop(rel, None)
        self.files[rel] = entry

    def add(self, rel: str, data: bytes) -> None:
        with self.open(rel) as fh:
            fh.write(data)

    def ready(self) -> None:
        """Before the manifest: every file closed."""
        if self._streams:
            raise StoreError(f"checkpoint {self.uri}: files {sorted(self._streams)} are still open; fix: close "
                             "every file before commit")

    def abort_streams(self) -> None:
        for stream in list(self._streams.values()):
            stream.abort()
        self._streams.clear()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.done:
            self.abort()

    def abort(self) -> None:  # overridden by the stores (after abort_streams)
        self.abort_streams()
        self.done = True
