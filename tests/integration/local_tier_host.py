"""A rented host for tests/integration/test_local_tier.py, in a process of its own so that a
test can SIGKILL it (the instance going) at any point:

    python -m tests.integration.local_tier_host STORE_URI LOCAL_DIR EVENTS MB_PER_S STATE_MB NOTICE_S

The checkpoint store is the one at STORE_URI with every write throttled to MB_PER_S (a slow
network store: the files are real, only their pace is set); LOCAL_DIR stands for the
instance's own disk. The host saves a STATE_MB state durably (which measures both the store
and the disk), changes it, and on a notice NOTICE_S seconds from its deadline makes the
emergency save of step 2. Everything it reports is in EVENTS (the host contract's file).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from orbit_dagster.runtime.checkpointing import Checkpointer
from orbit_dagster.runtime.events import EventWriter
from orbit_dagster.storage import open_store
from orbit_dagster.storage.fs import FsStore

JOB = "job-local-tier"


class _SlowFile:
    """A store writer's file whose writes take len / rate seconds (then go through as they are)."""

    def __init__(self, inner, rate: float):
        self.inner, self.rate = inner, rate

    def write(self, data) -> int:
        time.sleep(len(memoryview(data).cast("B")) / self.rate)
        return self.inner.write(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class _SlowWriter:
    def __init__(self, inner, rate: float):
        self.inner, self.rate = inner, rate

    def open(self, rel: str):
        return _SlowFile(self.inner.open(rel).__enter__(), self.rate)

    def add(self, rel: str, data: bytes) -> None:
        time.sleep(len(data) / self.rate)
        self.inner.add(rel, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class ThrottledStore:
    """A checkpoint store whose writes run at `rate` bytes/s; everything else is the store's own."""

    def __init__(self, inner, rate: float):
        self.inner, self.rate = inner, rate

    def writer(self, job_id: str, name: str):
        return _SlowWriter(self.inner.writer(job_id, name), self.rate)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main(store_uri: str, local_dir: str, events: str, mb_per_s: float, state_mb: float, notice_s: float) -> None:
    store = ThrottledStore(open_store(store_uri), mb_per_s * 1e6)
    ck = Checkpointer(store, EventWriter(Path(events)), job_id=JOB, attempt=1, parent_uri=None,
                      local_store=FsStore(Path(local_dir).as_uri()))
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(int(state_mb * 1e6) // 4)}, "step": 1}
    ck.save_durable_async(1, state, {"train/loss": 1.0})
    ck.flush()  # landed, and the local disk measured after it
    state["model"]["w"].mul_(0.5).add_(1.0)  # an optimiser step: the emergency save must hold these values
    state["step"] = 2
    now = time.time()
    ck.save_emergency(2, state, {"train/loss": 0.5}, source="metadata",
                      notice={"source": "metadata", "deadline": now + notice_s, "received_at": now})
    ck.close()
    print("host done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(float, sys.argv[4:7]))
