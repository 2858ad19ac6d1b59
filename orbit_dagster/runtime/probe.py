"""Effective-TFLOPS probe: a short square-matmul benchmark run when an instance starts.

Spec sheets overstate what a rented GPU delivers (clocks, thermals, a noisy neighbour, a
mislabelled SKU). The agent measures once per instance and the catalog ranks offers by the
measured figure when it exists. BF16 on a GPU (what training uses), FP32 on a CPU (CPUs
have no fast BF16 path in most torch builds, so FP32 is the honest CPU figure).

Runs on rented hosts: stdlib + torch only.
"""
from __future__ import annotations

import platform
import time

import torch

from .device import prepare_cuda_determinism

_DEFAULT_SIZE = {"cuda": 8192, "cpu": 1024}  # big enough to saturate, small enough for ~1 s
_WARMUP_ITERS = 3


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _resolve(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"probe device {device!r} is not a torch device ({e}); fix: pass 'cpu' or 'cuda[:N]'") from e
    if dev.type not in _DEFAULT_SIZE:
        raise ValueError(f"probe device {device!r} is unsupported; fix: pass 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"probe device {device!r}: torch sees no CUDA device here; fix: pass 'cpu'")
    return dev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_tflops(*, device: str | None = None, seconds: float = 1.0, size: int | None = None) -> dict:
    """Measured dense matmul TFLOP/s of one device: 2*n^3 FLOP per n x n product.

    Warm-up iterations (kernel selection, clocks) are excluded; the timed loop runs in
    batches sized from the warm-up so that the device is synchronised once per batch,
    not once per product, until `seconds` have passed. Inputs come from a seeded
    generator, so a rerun multiplies the same matrices.
    """
    if not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"probe seconds={seconds!r}; fix: pass a positive duration, e.g. 1.0")
    dev = _resolve(device)
    if dev.type == "cuda":
        # The probe may make the process's first cuBLAS handle: fix its workspace now, or a
        # deterministic workload later in this process would not be (see runtime.device).
        prepare_cuda_determinism()
    n = _DEFAULT_SIZE[dev.type] if size is None else size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"probe size={size!r}; fix: pass a positive matrix size, e.g. 1024")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=dev, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)

    start = time.perf_counter()
    for _ in range(_WARMUP_ITERS):
        torch.matmul(a, b, out=out)
    _sync(dev)
    per_iter = max((time.perf_counter() - start) / _WARMUP_ITERS, 1e-6)
    batch = max(1, min(1000, int(0.1 * seconds / per_iter)))  # ~10 syncs over the run

    iterations, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < seconds:
        for _ in range(batch):
            torch.matmul(a, b, out=out)
        _sync(dev)
        iterations += batch
        elapsed = time.perf_counter() - start
    flop = 2.0 * n ** 3 * iterations
    return {
        "tflops": flop / elapsed / 1e12,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(dev),
        "device_name": _device_name(dev),
        "size": n,
        "iterations": iterations,
        "seconds": elapsed,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "torch": torch.__version__,
    }
