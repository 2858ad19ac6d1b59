"""The agent's exit codes and the failure class each means (the one taxonomy: core/failures.py).

Shared by the SDK path (runtime/agent.py) and command workloads (runtime/command.py), which
map a script's exit onto the same codes; stdlib only, so that an agent running a command
workload (whose script may not use torch at all) never imports torch.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 1
EXIT_OOM = 3
EXIT_DIVERGED = 4
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on purpose after an emergency checkpoint
EXIT_BUNDLE = 65  # EX_DATAERR: the bundle does not match its manifest
EXIT_INFRA = 74  # EX_IOERR: disk full, I/O or network error, a checkpoint that fails its check

FAILURE_CLASS = {
    EXIT_OK: None,
    EXIT_USER_ERROR: "user_error",
    EXIT_OOM: "oom",
    EXIT_DIVERGED: "divergence",
    EXIT_PREEMPTED: "reclaim",
    EXIT_BUNDLE: "user_error",
    EXIT_INFRA: "infrastructure",
}


class Preempted(Exception):
    """Raised in the workload after the emergency checkpoint: stop, the host is going away."""


class Diverged(Exception):
    """A training metric became NaN or infinite."""


class CheckpointMismatch(Exception):
    """The checkpoint to load is not the one the control plane registered."""


# errno values that mean the platform failed, not the workload (see core/failures.py).
INFRA_ERRNOS = {28, 122, 5, 30, 101, 104, 110, 113}  # ENOSPC EDQUOT EIO EROFS ENETUNREACH ECONNRESET ETIMEDOUT EHOSTUNREACH


# What allocators say when they run out, as torch surfaces it: the caching allocator raises
# torch.OutOfMemoryError, but an allocation outside it (cuBLAS/cuDNN workspaces, a kernel
# launch, the CPU allocator) arrives as a RuntimeError with one of these in its message.
OOM_MESSAGES = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "hip out of memory",
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure, here or anywhere in the chain of causes (a workload may wrap it)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(cur).__mro__):
            return True
        text = str(cur).lower()
        if any(m in text for m in OOM_MESSAGES):
            return True
        cur = cur.__cause__ or cur.__context__
    return False
