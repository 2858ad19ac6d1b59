"""Which device a workload runs on, in which precision, with which determinism settings.

The runtime chooses, not the job: a bundle is a frozen contract that must run unchanged on
whatever host the placement found, a GPU box or a CPU fallback. CUDA when torch sees one,
the CPU otherwise; `ORBIT_DEVICE` (`auto`, `cpu`, `cuda`, `cuda:N`) overrides it through
the host's environment, and `ORBIT_PRECISION` (`auto`, `fp32`, `bf16`) the autocast dtype.

Determinism (what makes a resumed run bit-identical to an uninterrupted one):
- CPU: a pinned thread count and deterministic algorithms (eager mode).
- CUDA: the same, plus `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS picks reproducible
  reductions only with a fixed workspace, and reads it when its first handle is made, so
  it is set here, before any matmul), cuDNN autotuning off, TF32 off (its rounding depends
  on the kernel chosen). Same device model + same torch/CUDA versions => same bits; a
  different GPU model or library version may round differently, so a resume onto another
  GPU type continues correctly but is not bit-identical.
- bf16 autocast (CUDA default where the GPU supports it) is deterministic under these
  settings too; it changes the numbers compared with fp32, never their reproducibility.

Runs on rented hosts: stdlib + torch only.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

DEVICE_ENV = "ORBIT_DEVICE"
PRECISION_ENV = "ORBIT_PRECISION"
CUBLAS_DETERMINISTIC = ":4096:8"
_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


class DeviceError(ValueError):
    """A device or precision setting the host cannot honour; names the field, value and fix."""

    def __init__(self, message: str, *, field: str, value: object, fix: str):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"{message}; fix: {fix}")


@dataclass(frozen=True)
class DevicePlan:
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: no autocast (fp32)
    name: str

    @property
    def precision(self) -> str:
        return "fp32" if self.autocast_dtype is None else str(self.autocast_dtype).removeprefix("torch.")

    def describe(self) -> dict:
        return {"device": str(self.device), "device_name": self.name, "precision": self.precision}


def select_device(env: Mapping[str, str] | None = None, *, cuda_count: int | None = None) -> torch.device:
    """The device named by `ORBIT_DEVICE`, or CUDA when present, else the CPU.

    `cuda_count` stands in for `torch.cuda.device_count()` (unit tests of this one function).
    """
    env = os.environ if env is None else env
    raw = (env.get(DEVICE_ENV) or "auto").strip().lower()
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if raw == "auto":
        return torch.device("cuda:0" if count > 0 else "cpu")
    try:
        dev = torch.device(raw)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"{DEVICE_ENV}={raw!r} is not a device this runtime supports", field=DEVICE_ENV,
                          value=raw, fix=f"set {DEVICE_ENV} to auto, cpu, cuda or cuda:N (or unset it)")
    if dev.type == "cpu":
        return torch.device("cpu")
    index = 0 if dev.index is None else dev.index
    if count == 0:
        raise DeviceError(f"{DEVICE_ENV}={raw!r} but torch {torch.__version__} sees no CUDA device on this host",
                          field=DEVICE_ENV, value=raw,
                          fix=f"unset {DEVICE_ENV} (CPU fallback) or place the job on a GPU host with a CUDA build of torch")
    if index >= count:
        raise DeviceError(f"{DEVICE_ENV}={raw!r} but this host has {count} CUDA device(s)", field=DEVICE_ENV,
                          value=raw, fix=f"use cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", index)


def select_precision(device: torch.device, env: Mapping[str, str] | None = None, *,
                     bf16_supported: bool | None = None) -> torch.dtype | None:
    """bf16 autocast on a CUDA device that supports it, fp32 elsewhere; `ORBIT_PRECISION` overrides."""
    env = os.environ if env is None else env
    raw = (env.get(PRECISION_ENV) or "auto").strip().lower()
    if raw == "auto":
        if device.type != "cuda":
            return None  # most CPUs have no fast bf16 path; fp32 keeps CPU runs as they were
        supported = torch.cuda.is_bf16_supported() if bf16_supported is None else bf16_supported
        return torch.bfloat16 if supported else None
    if raw not in _PRECISIONS:
        raise DeviceError(f"{PRECISION_ENV}={raw!r} is not a precision this runtime supports", field=PRECISION_ENV,
                          value=raw, fix=f"set {PRECISION_ENV} to auto, fp32 or bf16 (or unset it)")
    return _PRECISIONS[raw]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def plan(env: Mapping[str, str] | None = None) -> DevicePlan:
    """Device, precision and name for this host (DeviceError when a setting cannot be honoured)."""
    dev = select_device(env)
    if dev.type == "cuda":
        prepare_cuda_determinism()
    return DevicePlan(dev, select_precision(dev, env), device_name(dev))


def prepare_cuda_determinism() -> None:
    """Set cuBLAS's fixed workspace before the first cuBLAS handle exists (a later set is ignored)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)


def make_deterministic(device: torch.device, threads: int) -> None:
    """Settings under which the same seed and steps give the same bits on this host (see module doc)."""
    torch.set_num_threads(max(1, int(threads)))
    if device.type == "cuda":
        prepare_cuda_determinism()
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    deterministic_algorithms()


def deterministic_algorithms() -> None:
    """`torch.use_deterministic_algorithms(True)` for eager mode, without its import of the
    compiler stack (torch._inductor, ~2.8 s of CPU per process start, only to set a flag for
    torch.compile, which workloads here do not use)."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:  # another torch: the public call, whatever it imports
        torch.use_deterministic_algorithms(True)
    else:
        setter(True)


@contextlib.contextmanager
def autocast(p: DevicePlan) -> Iterator[None]:
    """Mixed precision for the forward pass per the plan; a no-op in fp32."""
    if p.autocast_dtype is None:
        yield
        return
    with torch.autocast(device_type=p.device.type, dtype=p.autocast_dtype):
        yield
