"""Sharded checkpoints (torch.distributed.checkpoint) for bench/checkpoint_io.py: a 2-process
save and a 2 -> 1 reshard load, through the production path, against raw I/O of the same bytes.

- save: 2 ranks under torchrun (gloo, CPU), each holding half of every tensor of a state of
  the given size (DTensors sharded on dim 0, what FSDP holds), `dcp.save` into a directory
  (each rank its shard, rank 0 the metadata), timed on rank 0 from the call to its return;
  and `dcp.async_save` (the fsdpscript's periodic save): the seconds until it returns (the
  training thread's share: staging into host memory) and until its future is done. Then the
  agent's registration of the directory into the filesystem store
  (`runtime.command.store_files`: every shard streamed, hashed part by part, manifest last).
- load: the registered checkpoint verified in the store (`checkout`, no copy) and loaded by
  `dcp.load` into one process's whole tensors (the reshard), its files' pages dropped first.
Raw: write+fsync of the same number of bytes from memory, and a cold read of them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/sharded_io.py DIR BYTES
is the worker; `measure(nbytes, root, repeat)` runs it and returns the timings.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TENSOR_FLOATS = 4 << 20  # 16 MB float32 tensors, like the other benchmark's state


def _shapes(nbytes: int) -> list[int]:
    total = nbytes // 4
    return [min(TENSOR_FLOATS, total - i) for i in range(0, total, TENSOR_FLOATS)]


def worker(directory: str, nbytes: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    state = {}
    for i, n in enumerate(_shapes(nbytes)):
        local = torch.randn(n // world, generator=g)  # this rank's half, made here: no rank holds the whole
        state[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([n // world * world]),
                                                       stride=(1,))
    group = dist.new_group(backend="gloo")
    out = {}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save({"model": state}, checkpoint_id=os.path.join(directory, "sync"), process_group=group)
    out["save"] = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    future = dcp.async_save({"model": state}, checkpoint_id=os.path.join(directory, "async"), process_group=group)
    out["async_blocked"] = time.perf_counter() - t0
    future.result()
    out["async_save"] = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def _drop_cache(directory: Path) -> None:
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(nbytes: int, root: Path, repeat: int) -> dict[str, list]:
    from orbit_dagster.runtime.command import store_files
    from orbit_dagster.storage import open_store
    from orbit_dagster.storage.base import CheckpointManifest

    store = open_store((root / "sharded-store").as_uri())
    out: dict[str, list] = {k: [] for k in ("save", "async_blocked", "async_save", "register", "load", "raw_write",
                                            "raw_read")}
    blob = os.urandom(min(nbytes, 64 << 20)) * max(1, nbytes // (64 << 20))  # raw I/O: as many bytes
    for r in range(repeat):
        work = root / f"sharded-{r}"
        work.mkdir(parents=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               __file__, str(work), str(nbytes)], env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"sharded save failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        timings = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        for k, v in timings.items():
            out[k].append(v)
        d = work / "sync"
        files = {str(f.relative_to(d)): f for f in sorted(d.rglob("*")) if f.is_file()}
        t0 = time.perf_counter()
        manifest = store_files(store, "bench", f"step-{r + 1:09d}-a1", files,
                               CheckpointManifest(job_id="bench", step=r + 1, tier="durable", files={}, format="dcp"))
        out["register"].append(time.perf_counter() - t0)
        uri = store.uri_for("bench", f"step-{r + 1:09d}-a1")
        _drop_cache(Path(uri[len("file://"):]))
        out["load"].append(_reshard_load(store, uri, nbytes, root))
        raw = work / "raw.bin"
        t0 = time.perf_counter()
        with open(raw, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        out["raw_write"].append(time.perf_counter() - t0)
        _drop_cache(work)
        t0 = time.perf_counter()
        with open(raw, "rb") as fh:
            fh.read()
        out["raw_read"].append(time.perf_counter() - t0)
        store.delete(uri)
        assert manifest.total_bytes > 0
        shutil.rmtree(work)
    return out


def _reshard_load(store, uri: str, nbytes: int, root: Path) -> float:
    """The 2 ranks' checkpoint into one process's whole tensors (verify in place, then dcp.load)."""
    import torch.distributed.checkpoint as dcp

    world = 2
    state = {"model": {f"layer{i}.weight": torch.empty(n // world * world) for i, n in enumerate(_shapes(nbytes))}}
    t0 = time.perf_counter()
    _, directory = store.checkout(uri, root / "scratch")
    dcp.load(state, checkpoint_id=directory)  # no process group: one process, the shards resharded into it
    return time.perf_counter() - t0


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
