"""Files cut into fixed-size parts, each hashed (and written, or uploaded) on a pool of threads.

One sequential sha256 stream (0.5-1.1 GB/s on one core) used to finish before a checkpoint's
write could start. Here a file is written through a `PartStream`: every `part_size` bytes
become a part whose sha256 and write (a `pwrite` at its offset, or an S3 part upload) run on
a thread of the pool while the caller goes on producing the next one; hashlib and the I/O
release the GIL, so parts are hashed on all cores and overlap the I/O. Reading is the
mirror image (storage/reading.py): parts read and verified on several threads.

To a local file written past the page cache (`AlignedStream`, O_DIRECT: storage/fs.py) every
part is copied into a page-aligned buffer of its own, then hashed and written on the pool.
To a local file through the page cache (`InPlaceStream`: where O_DIRECT is refused or turned
off) nothing is copied: each write is cut at part boundaries and every piece hashed into its
part's sha256 and written at its offset straight from the caller's memory, on the pool. To S3
a part must be whole before it goes: its bytes are
copied into one of the stream's reused part buffers (or, for a whole part inside one large
write, taken straight from the caller's memory). torch passes a view of memory it owns only
during the call, so a `write` waits for what reads its memory before it returns. At most
`in_flight` parts are queued or running per stream (memory stays bounded).

Stdlib only: this package travels in every bundle.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Protocol, TypeVar

from .base import StoreError, check_rel

MIB = 1 << 20
PART_SIZE = 16 * MIB  # the S3 store's part too: one part scheme, one digest per S3 part
T = TypeVar("T")
R = TypeVar("R")

_pools: dict[tuple[int, str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_spare_maps: dict[tuple[int, int], list[mmap.mmap]] = {}  # (pid, part size): AlignedStream's buffers between files
_spare_lock = threading.Lock()


def threads() -> int:
    """Hashing threads: one per core, at least 2 (one hashes while one writes), at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


def io_threads() -> int:
    """The reads a verify keeps going at once (`read_pool`): two per hashing thread. A task
    reads its part, then hashes it; with one task per core the disk sat idle whenever every
    task hashed. Side by side, from a cold cache on 2 cores, reading one part per core made a
    1 GB load 1.68x as long (a slow disk; 1.14x in an earlier run on a fast one), a 4 GB load
    1.11x, and a 100 MB one (7 parts) 1.02x (docs/benchmarks.md, checkpoint-io and
    checkpoint-io-large: the row "the same, one part read per core"). Each read
    in flight holds a part-sized buffer until the verify ends.

    Saves keep one thread per core (`shared_pool`): they run beside a training, whose threads
    would take turns with more of ours, and a wider pool gained them little (side by side, in
    a one-off script: 100 MB 0.171 s against 0.174 s, 1 GB 1.04 s against 1.16 s), not
    measured against what it would cost the training."""
    return 2 * threads()


def process_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """This process's pool called `name` with `workers` threads, made on first use. Keyed by
    the process id: a forked child (a DataLoader worker, a run worker forked from a code server)
    inherits the parent's pool object but none of its threads, so a task submitted to it there
    would never run; the child gets a pool of its own instead."""
    key = (os.getpid(), name, workers)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return pool


def spare_buffers() -> int:
    """AlignedStream's buffers kept between files: as many as one fs store's stream holds at
    most (its parts in flight, `threads() + 2`, one held and one being filled)."""
    return threads() + 4


def shared_pool() -> ThreadPoolExecutor:
    """The process's pool for hashing and local disk I/O (tasks on it never wait for each other)."""
    return process_pool("orbit-parts", threads())


def read_pool() -> ThreadPoolExecutor:
    """The process's pool for verifying parts read from a local disk (`io_threads` of them)."""
    return process_pool("orbit-read", io_threads())


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
        view = _bytes_to_write(self, data)
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
        return self._entry()

    def _entry(self) -> dict:
        """The file's manifest entry, once every part is stored; handed to the writer's callback."""
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


class InPlaceStream(PartStream):
    """A PartStream for a sink that can write at any offset (a local file): no part buffers,
    no copy. Each write is cut at part boundaries; each piece updates its part's sha256 and is
    written at its offset straight from the caller's memory, the pieces of one write on the
    pool at once (a write spans several parts: a large tensor), the write returning when
    they are done (the caller's memory is ours only during the call). A part's pieces arrive
    in order, so its hash is fed in order; it is final when its last byte is in. Small
    writes are done on the caller's thread (a pool round trip would cost more)."""

    INLINE = 256 * 1024

    def __init__(self, sink: Any, **kw: Any):
        super().__init__(sink, **kw)
        self._hashers: dict[int, Any] = {}

    def write(self, data: Any) -> int:
        view = _bytes_to_write(self, data)
        n, pos, off, part = len(view), 0, self._size, self._part
        pieces = []
        while pos < n:
            index = off // part
            take = min(n - pos, (index + 1) * part - off)
            pieces.append((index, off, view[pos:pos + take], off + take == (index + 1) * part))
            pos, off = pos + take, off + take
        if n < self.INLINE:
            for piece in pieces:
                self._piece(*piece)
        else:
            futures = [self._executor.submit(self._piece, *piece) for piece in pieces]
            wait(futures)
            for f in futures:
                if f.exception() is not None:
                    self._error = self._error or f.exception()
        self._raise()
        self._size += n
        return n

    def _piece(self, index: int, offset: int, view: memoryview, completes: bool) -> None:
        h = self._hashers.get(index)  # one write's pieces are of distinct parts: no two threads share one
        if h is None:
            h = self._hashers[index] = hashlib.sha256()
        h.update(view)  # releases the GIL: the pieces hash in parallel
        self._sink.write_at(offset, view)
        if completes:
            self._digests[index] = self._hashers.pop(index).digest()

    def close(self) -> dict:
        if self.closed:
            return self.entry or {}
        self.closed = True
        try:
            self._raise()
            for index in list(self._hashers):  # the last, shorter part
                self._digests[index] = self._hashers.pop(index).digest()
            self._count = -(-self._size // self._part)
            self._sink.finish(self._size, self._count)
        except BaseException:
            self.abort()
            raise
        return self._entry()


class AlignedStream(PartStream):
    """A PartStream whose every part is copied into a page-aligned buffer of its own (anonymous
    memory maps), whole parts too, so that the sink can write each with O_DIRECT, past the
    page cache (storage/fs.py `_DirectFileSink`). The copy is cheap next to what it saves: a
    buffered write must allocate a page-cache page for every 4 KiB it writes, whose cost on a
    virtual machine swings from one write to the next (bench/direct_write.py,
    docs/benchmarks.md). The caller's memory is never kept: a write returns once its bytes
    are copied, the parts hashed and written on the pool meanwhile.

    The buffers outlive the file: a closed stream hands them to the process's next one, as
    many as one stream holds at most (in flight + 2: 6 parts, 96 MB, on 2 cores; 12 parts,
    192 MB, from 8 cores up), kept for the process's life. A new map
    is faulted in page by page as the copy first touches it, at 0.55-0.75 GB/s on the benchmark
    machine (docs/benchmarks.md, "A host copy by the idle time before it"); maps made for each
    file made a 100 MB save spend about a fifth of its time there (docs/benchmarks.md,
    checkpoint-io)."""

    def _take_buffer(self) -> Any:
        with self._free_lock:
            if self._free:
                return self._free.pop()
        with _spare_lock:
            spare = _spare_maps.get((os.getpid(), self._part))  # a forked child's are its parent's pages: not shared
            if spare:
                return spare.pop()
        return mmap.mmap(-1, self._part)

    def _keep_buffers(self) -> None:
        """Every part task has ended: this stream's buffers go to the process's next one (the
        rest are dropped, and unmapped once nothing refers to them)."""
        with self._free_lock:
            free, self._free = self._free, []
        free += [b for b in (self._held, self._buf) if b is not None]  # a one-part file's, never submitted
        self._held = self._buf = None
        with _spare_lock:
            spare = _spare_maps.setdefault((os.getpid(), self._part), [])
            spare.extend(free[:max(0, spare_buffers() - len(spare))])

    def close(self) -> dict:
        try:
            return super().close()
        finally:
            self._keep_buffers()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._keep_buffers()

    def write(self, data: Any) -> int:
        view = _bytes_to_write(self, data)
        n, pos, part = len(view), 0, self._part
        while pos < n:
            if self._buf is None:
                self._release_held()  # a full part goes once more bytes come (see PartStream.close)
                self._buf, self._fill = self._take_buffer(), 0
            take = min(n - pos, part - self._fill)
            self._buf[self._fill:self._fill + take] = view[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == part:
                self._held, self._buf, self._fill = self._buf, None, 0
        self._size += n
        return n


def _bytes_to_write(stream: Any, data: Any) -> memoryview:
    """`data` as a flat byte view for a stream's write; refused once the stream is closed or a
    part of it failed (the part's error, raised on the writer's thread)."""
    if stream.closed:
        raise ValueError("write to a closed checkpoint file")
    stream._raise()
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def pwrite_full(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


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
        sink = self._sink(rel)
        # A file: no part buffers (or aligned ones, where the sink writes past the page cache).
        kind = getattr(sink, "stream", None) or (InPlaceStream if hasattr(sink, "write_at") else PartStream)
        stream = kind(sink, part_size=self.part_size, executor=self._executor, in_flight=self._in_flight,
                      on_close=lambda entry: self._closed(rel, entry))
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
