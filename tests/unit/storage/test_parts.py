"""Streaming, parallel checkpoint files (storage/parts.py, storage/fs.py): parts hashed as they
are written, the manifest last, every part verified on read and named when it is wrong, and a
writer killed mid-write leaves nothing that looks complete."""
import errno
import fcntl
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
from hypothesis import given
from hypothesis import strategies as st

from orbit_dagster.storage import open_store
from orbit_dagster.storage import parts as P
from orbit_dagster.storage.base import MANIFEST, CheckpointManifest, StoreError
from orbit_dagster.storage.fs import FsStore, sweep_temp_dirs
from tests.helpers import wait_for

PART = 4096
REPO = Path(__file__).resolve().parents[3]


def manifest(step=1) -> CheckpointManifest:
    return CheckpointManifest(job_id="j", step=step, tier="durable", files={})


def reference(data: bytes, part: int = PART) -> dict:
    return {"bytes": len(data), "parts": [hashlib.sha256(data[i:i + part]).hexdigest() for i in range(0, len(data), part)]}


class Recorder:
    """A sink that keeps every part (and how many ran at once)."""

    def __init__(self, delay=0.0):
        self.parts, self.single_calls, self.finished, self.aborted = {}, [], None, False
        self.running = self.most = 0
        self.lock = threading.Lock()
        self.delay = delay

    def part(self, index, offset, data, digest):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.delay)
        assert hashlib.sha256(data).digest() == digest
        with self.lock:
            self.parts[index] = (offset, bytes(data))
            self.running -= 1

    def single(self, data, digest):
        self.single_calls.append(bytes(data))

    def finish(self, nbytes, count):
        self.finished = (nbytes, count)

    def abort(self):
        self.aborted = True

    def joined(self) -> bytes:
        return b"".join(self.parts[i][1] for i in sorted(self.parts))


def stream(sink, in_flight=3):
    return P.PartStream(sink, part_size=PART, executor=P.shared_pool(), in_flight=in_flight)


@given(chunks=st.lists(st.integers(min_value=0, max_value=3 * PART + 7), max_size=12))
def test_any_pattern_of_writes_gives_the_parts_of_the_whole_file(chunks):
    data = os.urandom(sum(chunks))
    sink, pos = Recorder(), 0
    s = stream(sink)
    for n in chunks:
        assert s.write(memoryview(data)[pos:pos + n]) == n
        pos += n
        assert s.tell() == pos
    entry = s.close()
    assert entry == reference(data)
    if len(entry["parts"]) <= 1:  # a file of at most one part goes in one call, never a part upload
        assert sink.parts == {} and sink.single_calls == [data]
    else:
        assert sink.joined() == data and sink.finished == (len(data), len(entry["parts"]))
        assert all(offset == i * PART for i, (offset, _) in sink.parts.items())


class FileRecorder:
    """A sink that writes at offsets (a local file's): the in-place stream, no part buffers."""

    def __init__(self):
        self.data, self.lock, self.finished = bytearray(), threading.Lock(), None

    def write_at(self, offset, data):
        with self.lock:
            if len(self.data) < offset + len(data):
                self.data.extend(b"\0" * (offset + len(data) - len(self.data)))
            self.data[offset:offset + len(data)] = data

    def finish(self, nbytes, count):
        self.finished = (nbytes, count)

    def abort(self):
        pass


@given(chunks=st.lists(st.integers(min_value=0, max_value=3 * PART + 7), max_size=12), big=st.booleans())
def test_in_place_any_pattern_of_writes_gives_the_parts_of_the_whole_file(chunks, big):
    data = os.urandom(sum(chunks))
    sink, pos = FileRecorder(), 0
    s = P.InPlaceStream(sink, part_size=PART, executor=P.shared_pool(), in_flight=3)
    s.INLINE = 0 if big else 1 << 30  # every write on the pool, or every write on the caller's thread
    for n in chunks:
        assert s.write(memoryview(data)[pos:pos + n]) == n
        pos += n
    assert s.close() == reference(data)
    assert bytes(sink.data) == data and sink.finished == (len(data), len(reference(data)["parts"]))


def test_parts_in_flight_are_bounded_and_run_on_several_threads():
    sink = Recorder(delay=0.02)
    s = stream(sink, in_flight=2)
    s.write(os.urandom(20 * PART))  # whole parts straight from the caller's buffer
    for _ in range(40):
        s.write(os.urandom(PART // 2))  # small writes through the reused part buffers
    s.close()
    assert sink.most == 2 and len(sink.parts) == 40


def test_a_failing_part_aborts_the_file_and_the_error_reaches_the_writer(tmp_path):
    class Failing(Recorder):
        def part(self, index, offset, data, digest):
            if index == 3:
                raise OSError("disk full at part 4")
            super().part(index, offset, data, digest)

    sink = Failing()
    s = stream(sink)
    with pytest.raises(OSError, match="disk full"):
        with s:
            for _ in range(10):
                s.write(os.urandom(PART))
    assert sink.aborted and sink.finished is None


@pytest.mark.parametrize("direct", [True, False])  # past the page cache (O_DIRECT), and through it
def test_a_failed_write_leaves_no_trace_in_the_store(tmp_path, monkeypatch, direct):
    import orbit_dagster.storage.fs as F

    store = FsStore((tmp_path / "s").as_uri(), part_size=PART, direct=direct)

    def fail(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(F.P, "pwrite_full", fail)
    with pytest.raises(OSError, match="No space"):
        store.put("j", "step-000000001-a1", {"state.pt": os.urandom(5 * PART)}, manifest())
    assert list(store.list("j")) == [] and list((tmp_path / "s" / "j").iterdir()) == []


def test_a_checkpoint_is_written_streamed_and_read_back_part_by_part(tmp_path):
    store = FsStore((tmp_path / "s").as_uri(), part_size=PART)
    data = os.urandom(7 * PART + 123)
    with store.writer("j", "step-000000001-a1") as w:
        with w.open("state.pt") as fh:
            for i in range(0, len(data), 1000):
                fh.write(data[i:i + 1000])
        w.add("extra/empty.txt", b"")
        m = w.commit(CheckpointManifest(job_id="j", step=1, tier="durable", files={}, format="torch"))
    assert m.files == {"state.pt": reference(data), "extra/empty.txt": {"bytes": 0, "parts": []}}
    assert store.read_manifest(w.uri).digest == m.digest and store.verify(w.uri).format == "torch"
    store.fetch(w.uri, tmp_path / "out")
    assert (tmp_path / "out" / "state.pt").read_bytes() == data and (tmp_path / "out" / "extra" / "empty.txt").exists()
    got, directory = store.checkout(w.uri, tmp_path / "scratch")
    assert (directory / "state.pt").read_bytes() == data and not (tmp_path / "scratch").exists()  # no copy


def test_a_flipped_byte_in_any_part_is_refused_on_load_naming_the_part(tmp_path):
    store = FsStore((tmp_path / "s").as_uri(), part_size=PART)
    data = os.urandom(5 * PART + 100)  # 6 parts, the last short
    uri = store.put("j", "step-000000001-a1", {"state.pt": data}, manifest())
    path = tmp_path / "s" / "j" / "step-000000001-a1" / "state.pt"
    for index in range(6):
        at = index * PART + (37 if index < 5 else 99)
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        named = rf"file state.pt part {index + 1} of 6 \(bytes {index * PART}-"
        for read in (store.verify, lambda u: store.checkout(u, tmp_path / "c"),
                     lambda u: store.fetch(u, tmp_path / f"out{index}")):
            with pytest.raises(StoreError, match=named):
                read(uri)
        assert not (tmp_path / f"out{index}" / "state.pt").exists()  # a file that failed its check is not left
    path.write_bytes(data[:-1])
    with pytest.raises(StoreError, match="has 20579 bytes, its manifest says 20580: truncated"):
        store.verify(uri)
    path.write_bytes(data)
    assert store.verify(uri).step == 1


def test_a_verify_reads_two_parts_per_hashing_thread_at_once(tmp_path, monkeypatch):
    """While one task hashes its part another waits on the disk: the verify keeps `io_threads`
    reads going. Every read waits at a barrier of that many, so a verify that read fewer parts
    at once would break it (and the test) rather than pass slowly."""
    import orbit_dagster.storage.reading as V

    store = FsStore((tmp_path / "s").as_uri(), part_size=PART)
    width = P.io_threads()
    assert width == 2 * P.threads()
    data = os.urandom(2 * width * PART)
    uri = store.put("j", "step-000000001-a1", {"state.pt": data}, manifest())
    barrier, real = threading.Barrier(width, timeout=60), V.pread_full

    def pread_full(fd, buf, offset):
        barrier.wait()
        return real(fd, buf, offset)

    monkeypatch.setattr(V, "pread_full", pread_full)
    assert store.verify(uri).step == 1
    got, directory = store.checkout(uri, tmp_path / "scratch")
    assert (directory / "state.pt").read_bytes() == data


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    import orbit_dagster.storage.fs as F
    from orbit_dagster.storage.base import CheckpointManifest

    root, marker = sys.argv[1], sys.argv[2]
    real = F.P.pwrite_full  # the write of every part, past the page cache or through it

    def pwrite_full(fd, data, offset):
        real(fd, data, offset)
        if offset >= 3 << 16:  # parts 1-3 written: tell the test, then wait to be killed mid-file
            open(marker, "w").close()
            time.sleep(120)

    F.P.pwrite_full = pwrite_full
    store = F.FsStore(root, part_size=1 << 16)
    store.put("j", "step-000000001-a1", {"state.pt": os.urandom(40 << 16)},
              CheckpointManifest(job_id="j", step=1, tier="durable", files={}))
""")


def test_a_writer_killed_mid_write_is_never_registered_and_leaves_no_complete_part(tmp_path):
    root, marker = tmp_path / "s", tmp_path / "writing"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root), str(marker)], env=env)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, "the writer ended before it was killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    store = open_store(root.as_uri())
    uri = store.uri_for("j", "step-000000001-a1")
    assert list(store.list("j")) == []
    with pytest.raises(StoreError, match="incomplete: no manifest"):
        store.read_manifest(uri)
    assert not Path(uri[len("file://"):]).exists()
    (tmp, ) = (root / "j").iterdir()  # what it left: a temp dir, named as one, without a manifest
    assert tmp.name.startswith(".tmp-step-000000001-a1-") and not list(tmp.rglob(MANIFEST))
    # The next writer of the job sweeps it once it is old (a live writer's is left alone) and
    # writes the checkpoint whole.
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    assert store.put("j", "step-000000001-a1", {"state.pt": b"whole"}, manifest()) == uri
    assert not tmp.exists() and sweep_temp_dirs(root / "j") == 0
    assert store.verify(uri).total_bytes == 5


def test_part_size_is_checked():
    with pytest.raises(StoreError, match="part_size 12 is not a size in bytes; fix: at least 4096"):
        FsStore("/tmp/x", part_size=12)


def _written(store: FsStore, data: bytes, chunk: int) -> tuple[dict, bytes]:
    """`data` written in `chunk`-byte writes (as torch.save writes records and tensors); the
    manifest entry and the bytes the store holds."""
    with store.writer("j", "step-000000001-a1") as w:
        with w.open("state.pt") as fh:
            for i in range(0, len(data), chunk):
                fh.write(memoryview(data)[i:i + chunk])
        m = w.commit(manifest())
    return m.files["state.pt"], (Path(w.final) / "state.pt").read_bytes()


@pytest.mark.parametrize("chunk", [1000, 3 * PART + 7, 10 * PART])  # small writes, parts cut mid-write, whole parts
def test_past_the_page_cache_a_file_is_the_same_bytes_with_the_same_part_digests(tmp_path, monkeypatch, chunk):
    import orbit_dagster.storage.fs as F

    sinks, real_sink = [], F.FsWriter._sink
    monkeypatch.setattr(F.FsWriter, "_sink", lambda self, rel: sinks.append(real_sink(self, rel)) or sinks[-1])
    data = os.urandom(9 * PART + 123)  # the last part shorter: through the page cache
    entry, held = _written(FsStore((tmp_path / "s").as_uri(), part_size=PART), data, chunk)
    assert held == data and entry == reference(data)
    assert [(type(s), s.stream, s.direct) for s in sinks] == [(F._DirectFileSink, P.AlignedStream, True)]
    # Parts that are not whole pages (a store made with such a part size) go through the page cache.
    odd = PART + 1
    entry, held = _written(FsStore((tmp_path / "odd").as_uri(), part_size=odd), data, chunk)
    assert held == data and entry == reference(data, odd) and type(sinks[-1]) is F._FileSink


def test_where_the_file_system_refuses_o_direct_the_file_goes_through_the_page_cache(tmp_path, monkeypatch):
    import orbit_dagster.storage.fs as F

    real_open, real_pwrite = os.open, F.P.pwrite_full
    data = os.urandom(6 * PART + 5)

    def refuse_direct(path, flags, *mode):
        if flags & F.DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *mode)

    # Refused at the open: the usual stream, no part buffers.
    monkeypatch.setattr(F.os, "open", refuse_direct)
    assert _written(FsStore((tmp_path / "a").as_uri(), part_size=PART), data, 5000) == (reference(data), data)
    monkeypatch.setattr(F.os, "open", real_open)
    # Refused at a write (the open took the flag): that part and the rest through the page cache.
    refused = []

    def pwrite_full(fd, view, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & F.DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(F.P, "pwrite_full", pwrite_full)
    assert _written(FsStore((tmp_path / "b").as_uri(), part_size=PART), data, 5000) == (reference(data), data)
    assert refused  # it was tried, and then not held against the file



def test_orbit_fs_direct_opens_the_store_past_or_through_the_page_cache_and_refuses_anything_else():
    from orbit_dagster.storage.factory import open_store

    assert open_store("/tmp/x").direct and open_store("/tmp/x", env={"ORBIT_FS_DIRECT": "1"}).direct
    assert not open_store("/tmp/x", env={"ORBIT_FS_DIRECT": "0"}).direct
    with pytest.raises(StoreError, match="ORBIT_FS_DIRECT='yes' is neither 0 nor 1; fix: ORBIT_FS_DIRECT=1"):
        open_store("/tmp/x", env={"ORBIT_FS_DIRECT": "yes"})


FORKED = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch
    from orbit_dagster.runtime import encoding as E
    from orbit_dagster.storage import parts as P
    from orbit_dagster.storage.base import CheckpointManifest
    from orbit_dagster.storage.fs import FsStore
    from orbit_dagster.storage.s3 import S3Store

    root = Path(sys.argv[1])
    store = FsStore(root.as_uri(), part_size=4096)
    files = {"state.pt": os.urandom(64 * 4096)}

    def use_every_pool(step):
        uri = store.put("j", f"step-{step}", files, CheckpointManifest(job_id="j", step=step, tier="durable", files={}))
        store.fetch(uri, root / f"fetched-{step}")
        assert (root / f"fetched-{step}" / "state.pt").read_bytes() == files["state.pt"]
        src = torch.arange(1 << 16, dtype=torch.float32)
        dst = torch.empty_like(src)
        assert E._copy_pool().submit(dst.copy_, src).result(timeout=20) is dst
        s3 = S3Store("s3://bucket/prefix", client=object(), concurrency=3)
        assert s3.pool().submit(int, "7").result(timeout=20) == 7

    use_every_pool(1)  # the parent's pools now hold threads that a forked child will not have
    pid = os.fork()
    if pid == 0:
        torch.set_num_threads(1)  # as a DataLoader worker does: torch's OpenMP threads do not survive a fork either
        try:
            use_every_pool(2)
        except BaseException as exc:
            print("child:", type(exc).__name__, exc, flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_a_forked_child_gets_pools_of_its_own_whose_tasks_run(tmp_path):
    """A child forked after its parent used the parts, read, S3 and copy pools (a DataLoader worker,
    a run worker forked from a code server) inherits pool objects without their threads: a task
    submitted to one would wait forever. Each pool is per process, so the child's save, load and
    copy run."""
    done = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path / "s")], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_aligned_buffers_serve_the_next_file_and_no_stale_byte_reaches_it(tmp_path, monkeypatch):
    """Past the page cache, each part is copied into a page-aligned map. A closed (or aborted)
    file hands its maps to the next one instead of the next faulting new ones in; the reuse
    never lets a byte of an earlier file into a later one (a short last part, a one-part file)."""
    import mmap as M

    import orbit_dagster.storage.fs as F

    monkeypatch.setattr(P, "_spare_maps", {})
    store = FsStore((tmp_path / "s").as_uri(), part_size=PART, direct=True)
    made = []
    real_mmap = M.mmap
    monkeypatch.setattr(P.mmap, "mmap", lambda *a, **k: made.append(1) or real_mmap(*a, **k))
    big = os.urandom(9 * PART + 100)
    small = os.urandom(PART // 3)  # one part: the stream's one buffer, written by `single`
    first = store.put("j", "step-000000001-a1", {"state.pt": big}, manifest(1))
    first_made = len(made)
    if not first_made:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: the store writes through the page cache there, with no maps")
    assert first_made <= P.spare_buffers() + 2
    second = store.put("j", "step-000000002-a1", {"state.pt": small, "more.pt": big[:2 * PART + 7]}, manifest(2))
    assert len(made) == first_made, "the second checkpoint's files took the first one's maps"

    def fail(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # an aborted file's maps are kept too
        m.setattr(F.P, "pwrite_full", fail)
        with pytest.raises(OSError, match="No space"):
            store.put("j", "step-000000003-a1", {"state.pt": os.urandom(5 * PART)}, manifest(3))
    tail = os.urandom(PART + 1)
    third = store.put("j", "step-000000004-a1", {"state.pt": tail}, manifest(4))
    assert len(made) == first_made
    assert len(P._spare_maps[(os.getpid(), PART)]) <= P.spare_buffers()
    for uri, files in ((first, {"state.pt": big}), (second, {"state.pt": small, "more.pt": big[:2 * PART + 7]}),
                       (third, {"state.pt": tail})):
        out = tmp_path / uri.rsplit("/", 1)[-1]
        store.fetch(uri, out)
        assert {rel: (out / rel).read_bytes() for rel in files} == files
