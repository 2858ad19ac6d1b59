"""Sharded checkpoints (torch.distributed.checkpoint) for bench/checkpoint_io.py: a 2-process
save and a 2 -> 1 reshard load, through the production path, against raw I/O of the same bytes.

- save: 2 ranks under torchrun (gloo, CPU), each holding half of every tensor of a state of
  the given size (DTensors sharded on dim 0, what FSDP holds), `dcp.save` into a directory
  (each rank its shard, rank 0 the metadata), timed on rank 0 from the call to its return;
  and `dcp.async_save` (the fsdpscript's periodic save): the seconds until it returns (the
  training thread's share: staging into host memory) and until its future is done, twice
  each with DCP's default stager (new host memory on every call), with one DefaultStager
  kept for the run (its memory reused, its deep copy of the state dict's structure made on
  every call) and with the script's KeptStager (the first save allocates, the second copies
  into the same buffers, which is what every later save of a run does), the order of the
  three reversed every other repeat; and the floor of any staging: the same shards copied into
  buffers the rank already holds, nothing else of a save around it. Then the
  agent's registration of the directory into the filesystem store
  (`runtime.command.store_files`: every shard streamed, hashed part by part, manifest last).
- load: the registered checkpoint verified in the store (`checkout`, no copy) and loaded by
  `dcp.load` into one process's whole tensors (the reshard), its files' pages dropped first.
Raw: write+fsync of the same number of bytes from memory, and a cold read of them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/sharded_io.py DIR BYTES
is the worker; `measure(nbytes, root, repeat)` runs it and returns the timings.

    python bench/sharded_io.py --staging --sizes 100M,1G [--repeat 3] [--tensor-mb 16]
prints only the async_save comparison (the three stagers and the floor), side by side.
The tensor size matters on the CPU: glibc serves allocations under its mmap threshold (at
most 32 MiB) from memory a freed copy returned to it, so the default stager's second copy of
small tensors lands in warm pages anyway; larger ones are mapped afresh, and faulted in, on
every save.
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


def _shapes(nbytes: int, tensor_floats: int = TENSOR_FLOATS) -> list[int]:
    total = nbytes // 4
    return [min(tensor_floats, total - i) for i in range(0, total, tensor_floats)]


def worker(directory: str, nbytes: int, tensor_floats: int = TENSOR_FLOATS, reversed_order: int = 0) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    state = {}
    for i, n in enumerate(_shapes(nbytes, tensor_floats)):
        local = torch.randn(n // world, generator=g)  # this rank's half, made here: no rank holds the whole
        state[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size([n // world * world]),
                                                       stride=(1,))
    group = dist.new_group(backend="gloo")
    out = {}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save({"model": state}, checkpoint_id=os.path.join(directory, "sync"), process_group=group)
    out["save"] = time.perf_counter() - t0
    out.update(_async_saves(dcp, dist, state, directory, group, bool(reversed_order)))
    dist.barrier()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def _async_saves(dcp, dist, state: dict, directory: str, group, reversed_order: bool) -> dict:
    """Two async saves with DCP's default stager (a new one each call), two through one
    DefaultStager kept for the run, two through the fsdpscript's KeptStager (which pair goes
    first alternates between repeats); each timed until it returns (the caller's blocked time)
    and until its future is done."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from orbit_dagster.workloads.fsdpscript.train import KeptStager

    out = {}
    reused = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    kept = KeptStager()
    pairs = [[(name, stager, 0), (name, stager, 1)] for name, stager in (("async", None), ("reused", reused),
                                                                         ("kept", kept))]
    runs = [run for pair in (pairs[::-1] if reversed_order else pairs) for run in pair]
    for name, async_stager, i in runs:
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save({"model": state}, checkpoint_id=os.path.join(directory, f"{name}-{i}"),
                                process_group=group, async_stager=async_stager)
        blocked = time.perf_counter() - t0
        future.result()  # before the next save: a kept stager's buffers are the writer's until then
        done = time.perf_counter() - t0
        if i == 1:  # the second save of each: what every save after a run's first one costs
            out.update({f"{name}_blocked": blocked, f"{name}_save": done})
        elif name == "kept":
            out["kept_first_blocked"] = blocked
    reused.close()
    kept.close()
    out["copy_floor"] = _copy_floor(dist, state)
    return out


def _copy_floor(dist, state: dict) -> float:
    """The floor of any staging on this machine: this rank's shards copied into host buffers it
    already holds (faulted in by a first copy), with nothing else of a save around it."""
    shards = [t.to_local() for t in state.values()]
    buffers = [torch.empty_like(t) for t in shards]
    for b, t in zip(buffers, shards):
        b.copy_(t)
    dist.barrier()
    t0 = time.perf_counter()
    for b, t in zip(buffers, shards):
        b.copy_(t)
    return time.perf_counter() - t0


def _drop_cache(directory: Path) -> None:
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(nbytes: int, root: Path, repeat: int, tensor_floats: int = TENSOR_FLOATS) -> dict[str, list]:
    from orbit_dagster.runtime.command import store_files
    from orbit_dagster.storage import open_store
    from orbit_dagster.storage.base import CheckpointManifest

    store = open_store((root / "sharded-store").as_uri())
    out: dict[str, list] = {k: [] for k in ("save", "async_blocked", "async_save", "reused_blocked", "reused_save",
                                            "kept_blocked", "kept_save", "kept_first_blocked", "copy_floor", "register", "load", "raw_write", "raw_read")}
    blob = os.urandom(min(nbytes, 64 << 20)) * max(1, nbytes // (64 << 20))  # raw I/O: as many bytes
    for r in range(repeat):
        work = root / f"sharded-{r}"
        work.mkdir(parents=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               __file__, str(work), str(nbytes), str(tensor_floats), str(r % 2)], env=env, capture_output=True, text=True, timeout=1800)
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
        out["load"].append(_reshard_load(store, uri, nbytes, root, tensor_floats))
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


def _reshard_load(store, uri: str, nbytes: int, root: Path, tensor_floats: int) -> float:
    """The 2 ranks' checkpoint into one process's whole tensors (verify in place, then dcp.load)."""
    import torch.distributed.checkpoint as dcp

    world = 2
    state = {"model": {f"layer{i}.weight": torch.empty(n // world * world) for i, n in enumerate(_shapes(nbytes, tensor_floats))}}
    t0 = time.perf_counter()
    _, directory = store.checkout(uri, root / "scratch")
    dcp.load(state, checkpoint_id=directory)  # no process group: one process, the shards resharded into it
    return time.perf_counter() - t0


def staging_main(argv: list[str]) -> None:
    import argparse
    import statistics
    import tempfile

    ap = argparse.ArgumentParser(description="dcp.async_save blocked time: DCP's default stager vs one reused")
    ap.add_argument("--staging", action="store_true")
    ap.add_argument("--sizes", default="100M,1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--tensor-mb", type=int, default=TENSOR_FLOATS * 4 >> 20,
                    help="MiB per tensor of the whole state (each rank holds half)")
    args = ap.parse_args(argv)
    units = {"M": 10**6, "G": 10**9}
    print("| state | default stager (new each save): blocked s, median (min-max) | per GB | DefaultStager kept for the "
          "run | per GB | KeptStager (the fsdpscript's) | per GB | KeptStager, first save | plain copy into held "
          "buffers (the floor) | per GB | KeptStager / floor | done s: default / kept DefaultStager / KeptStager |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        nbytes = int(float(size[:-1]) * units[size[-1]])
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            t = measure(nbytes, Path(d), args.repeat, args.tensor_mb << 18)
        med = {k: statistics.median(v) for k, v in t.items() if v}
        gb = nbytes / 1e9

        def cell(k: str) -> str:
            return f"{med[k]:.3f} ({min(t[k]):.3f}-{max(t[k]):.3f}) | {med[k] / gb:.3f}"

        print(f"| {size} in {args.tensor_mb} MiB tensors | {cell('async_blocked')} | {cell('reused_blocked')} | "
              f"{cell('kept_blocked')} | {med['kept_first_blocked']:.3f} | {cell('copy_floor')} | "
              f"{med['kept_blocked'] / med['copy_floor']:.2f} | {med['async_save']:.3f} / {med['reused_save']:.3f} / "
              f"{med['kept_save']:.3f} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1].startswith("--"):
        staging_main(sys.argv[1:])
    else:
        worker(sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:5]))
