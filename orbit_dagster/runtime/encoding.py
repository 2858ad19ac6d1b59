"""Checkpoint bytes: host copies of a state, serialisation streamed into the store, digests.

Each byte is hashed once: torch.save writes into the store writer's file (a
`storage.parts.PartStream`), which cuts it into parts hashed and written on the store's
threads while torch goes on; the weights are hashed once more for the weights digest, in a
second thread. torch.save's own zip CRC32 is switched off for these saves: it was a second
checksum of every byte, on the saving thread (as slow as the sha256 on our machines), and
the manifest's part digests already cover them.

Runs on rented hosts: stdlib + torch only.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Iterator, Mapping

import torch

from ..storage.parts import process_pool
from . import delta as D

try:  # torch's switch for the zip CRC of torch.save (older torch has none)
    from torch.utils.serialization import config as _serialization_config
except ImportError:
    _serialization_config = None


def weights_digest(model_state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of the weights: 'same model' exactly."""
    h = hashlib.sha256()
    for name in sorted(model_state):
        t = model_state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of the bytes
    return h.hexdigest()


# ---- serialisation ------------------------------------------------------------------
_crc_lock = threading.Lock()
_crc_users = 0


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """torch.save without its CRC32 pass while any of our saves runs (process-wide setting,
    so reference-counted: two of our saves may overlap)."""
    global _crc_users
    config = _serialization_config
    if config is None:  # older torch: no switch, the CRC is computed
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _without_zip_crc.previous = config.save.compute_crc32  # type: ignore[attr-defined]
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _without_zip_crc.previous  # type: ignore[attr-defined]


def write_state(writer: Any, rel: str, payload: dict[str, Any], model_state: dict[str, torch.Tensor]) -> str:
    """torch.save `payload` as file `rel` of a store writer (streamed: no copy of the whole
    file in memory); returns the weights digest, computed in a second thread meanwhile
    (hashlib releases the GIL)."""
    out: dict[str, Any] = {}

    def digest() -> None:
        try:
            out["weights"] = weights_digest(model_state)
        except BaseException as exc:  # re-raised below, on the caller's thread
            out["error"] = exc

    worker = threading.Thread(target=digest, name="weights-digest", daemon=True)
    worker.start()
    try:
        with _without_zip_crc(), writer.open(rel) as fh:
            torch.save(payload, fh)
    finally:
        worker.join()
    if "error" in out:
        raise out["error"]
    return out["weights"]


def map_setting(env: Mapping[str, str] | None = None) -> bool:
    """ORBIT_LOAD_MMAP in the host's environment: 1 (the default) maps a checkpoint read in
    place, 0 reads it into memory. On a network file system a page of a mapped file that the
    kernel dropped is read again when touched; if another machine deleted the file meanwhile
    (retention on the control plane), that read fails and the process gets SIGBUS. 0 is the
    setting for such a store when runs keep loaded tensors on the CPU."""
    raw = (os.environ if env is None else env).get("ORBIT_LOAD_MMAP", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"ORBIT_LOAD_MMAP={raw!r} is neither 0 nor 1; fix: ORBIT_LOAD_MMAP=1 (map a checkpoint "
                         "read in place, the default) or 0 (read it into memory)")
    return raw == "1"


def read_state(path: Any, *, in_place: bool) -> Any:
    """torch.load a verified checkpoint file, `weights_only=True` (a checkpoint from a rented
    host is data, never code), onto the CPU.

    `in_place`: the file is a committed checkpoint of a local store, read where it lies (never
    rewritten: the store refuses other bytes under its name). It is then mapped (mmap=True,
    copy-on-write), not copied: its pages are in the page cache from the verify just before, so
    the load neither reads the disk again nor faults in fresh memory for every tensor (in
    docs/benchmarks.md, section checkpoint-io, the load without the mapping took 1.18x as
    long at 1 GB and 1.50x at 4 GB). A tensor written to
    later gets private copies of the pages it writes; the file never changes. What this costs:
    a tensor kept for the process's life keeps the file's disk space held after the store
    deletes it (the mapping holds the inode) until the tensor is dropped. A fetched copy (a
    remote store's, deleted right after the load) is read into memory instead, so its space is
    freed at once. A file saved in torch's legacy (non-zip) format cannot be mapped and is
    read. ORBIT_LOAD_MMAP=0 reads it in any case (see `map_setting`)."""
    if in_place and map_setting():
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # a corrupt file: its own error, not a second read
                raise
    return torch.load(path, map_location="cpu", weights_only=True)


# ---- host copies --------------------------------------------------------------------
def has_cuda(state: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for _, v in D.leaves(state))


def stage(state: Any, spare: dict[str, torch.Tensor] | None = None) -> Any:
    """A host copy of `state` that later training steps cannot change.

    CUDA tensors go to pinned buffers, asynchronously, synchronised once at the end; CPU
    tensors are copied synchronously. The buffers of `spare` (a flattened earlier copy that
    nothing reads any more) are reused where path, shape, dtype and layout match (for a CUDA
    tensor, pinned ones only): pinning memory is slow (a driver call per allocation), and fresh
    pageable memory is faulted in page by page as the copy first touches it: on the machine
    of docs/benchmarks.md a 1.2 GB copy into new memory took 0.5-2.1 s (it varies day to day),
    into buffers already held 0.09-0.24 s, after up to 150 s idle (bench/host_copy.py). The
    price is a host copy of the state kept between saves.

    The host-to-host copies are made together at the end (`copy_pieces`), on several threads
    where torch's own are fewer than the cores: the training thread waits for them either way,
    and one thread's memcpy leaves the other cores' share of the memory bandwidth unused (for a
    job pinned to 1 torch thread, `resources.cpu_threads`, two threads made the copy 1.1-2.0x
    faster on the 2-core machine of docs/benchmarks.md, bench/host_copy.py).
    """
    spare = spare or {}
    devices: set[torch.device] = set()
    on_host: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(obj: Any, path: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            pin = src.is_cuda
            if src.layout != torch.strided:
                return src.to("cpu", copy=True)
            buf = spare.get(D.path_key(path))
            if buf is None or not _fits(buf, src):
                buf = _host_buffer(src, pin)
            if pin:
                devices.add(src.device)
                return buf.copy_(src, non_blocking=True)
            on_host.append((buf, src))
            return buf
        if isinstance(obj, dict):
            return {k: copy(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
            return type(obj)(copy(v, path + (i,)) for i, v in enumerate(obj))
        if isinstance(obj, list):
            return list(obj)  # a later step may append to the live one
        return obj

    host = copy(state, ())
    copy_pieces(on_host)
    for dev in devices:
        torch.cuda.synchronize(dev)
    return host


# ---- host copies on several threads ---------------------------------------------------
PIECE_BYTES = 16 << 20  # small enough to spread a few large tensors evenly, large enough that a task's overhead is nothing
PARALLEL_MIN_BYTES = 64 << 20  # below this a copy takes milliseconds: the threads' hand-off would cost as much


def copy_threads() -> int:
    """One per core this process may run on, at most 8 (a memory copy saturates the bandwidth
    well before that)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _copy_pool() -> ThreadPoolExecutor:
    return process_pool("orbit-copy", copy_threads())


def copy_pieces(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`dst.copy_(src)` for each (dst, src) host pair; in pieces on the copy threads (torch
    releases the GIL in a copy) when there is enough to copy and torch's own threads, which
    share one copy out among themselves, are fewer than the cores; returns once every byte is
    copied, raising the first error."""
    total = sum(src.numel() * src.element_size() for _, src in pairs)
    if torch.get_num_threads() >= copy_threads() or total < PARALLEL_MIN_BYTES:
        for dst, src in pairs:
            dst.copy_(src)
        return
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if not (dst.is_contiguous() and src.is_contiguous()):
            pieces.append((dst, src))  # copied whole: a strided view has no flat slices
            continue
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        step = max(1, PIECE_BYTES // max(1, src.element_size()))
        pieces.extend((flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, flat_src.numel(), step))
    futures = [_copy_pool().submit(dst.copy_, src) for dst, src in pieces]
    wait(futures)  # every piece ended before an error is raised: none is still writing into a buffer after
    for future in futures:
        future.result()


def buffers_like(flat: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Host buffers shaped as the strided host tensors of `flat` (a flattened staged copy),
    their pages already touched, for a later `stage` to copy into.

    Fresh memory is faulted in as a copy first touches it, which made a save's copy into new
    memory 15 times slower than one into buffers already held (`stage`); a thread that can
    wait pays that here instead of the training thread. Pinned buffers stay pinned.
    """
    out: dict[str, torch.Tensor] = {}
    cuda = torch.cuda.is_available()
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and _fits(value, value):  # a strided host tensor
            out[key] = _host_buffer(value, cuda and value.is_pinned()).zero_()
    return out


def _fits(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `stage` may copy `src` into the held buffer `buf`: a strided host tensor of the
    same shape and dtype, pinned when `src` is on a GPU (an asynchronous copy needs it). The
    one rule for what `stage` reuses and what `buffers_like` readies for it."""
    return (buf.layout == src.layout == torch.strided and buf.device.type == "cpu" and buf.shape == src.shape
            and buf.dtype == src.dtype and (not src.is_cuda or buf.is_pinned()))


def _host_buffer(like: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
