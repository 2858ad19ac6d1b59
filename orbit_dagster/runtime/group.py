"""A host that is one node of a group (resources.nodes > 1; docs/multi-node.md). Stdlib only.

torchrun on every node meets the others at a c10d rendezvous on node 0's host (the address
and port come in the agent's argv, from the control plane's launch: never through a shared
filesystem); node 0's torchrun hosts the rendezvous store (`is_host`). c10d hands out the
global ranks itself, so the rank that writes a DCP checkpoint's `.metadata` (global rank 0)
may be on any node: every node's checkpoint directory holds its own ranks' shards, and the
checkpoint is their union. Every node but node 0 stores its part of each checkpoint in the
store (`part_name`, the checkpoint's own name and `.node<K>`: never a checkpoint name, so no
scan registers it); node 0 waits for the parts, verifies each, and stores the union as the one
checkpoint (format `dcp` once it holds `.metadata`), which it reports; the parts are then
deleted. A part that does not come within the wait leaves the step unregistered (a node lost
while saving: the checkpoint is torn). The checkpoint is `emergency` when any node's part
was saved after a notice.

A notice on a node reaches the script's ranks there (the stop signal to torchrun's children:
torchrun itself is left alone, so every node's torchrun ends its run normally and meets the
others at its exit barrier); the other nodes' ranks learn it from the script's all-reduced
stop flag at the step's end (workloads/fsdpscript), so every rank stops at one step.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..core import process_tree
from ..storage.base import CheckpointManifest, StoreError, checkpoint_part_name
from .files import store_files
from .watcher import Found

POLL_S = 0.25


@dataclass(frozen=True)
class NodeGroup:
    nnodes: int
    node_rank: int
    endpoint: str  # HOST:PORT of the rendezvous, on node 0's host
    rdzv_id: str
    wait_s: float = 120.0  # node 0: how long it waits for the other nodes' parts of a checkpoint

    def launcher_args(self) -> list[str]:
        """torchrun's arguments for this node. `--node-rank` is not among them: torchrun ignores it
        for c10d (it warns), where the rendezvous assigns the ranks."""
        return ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"is_host={'true' if self.node_rank == 0 else 'false'}"]

    @property
    def others(self) -> list[int]:
        return [k for k in range(self.nnodes) if k != self.node_rank]


def part_name(step: int, attempt: int, node_rank: int) -> str:
    """Where a node stores its part of a checkpoint, beside the checkpoint's own name."""
    return checkpoint_part_name(step, attempt, node_rank)


def signal_ranks(proc: subprocess.Popen, sig: int) -> int:
    """The stop signal to torchrun's ranks on this node (not to torchrun); how many got it."""
    sent = 0
    for pid in process_tree.children(proc.pid):
        try:
            os.kill(pid, sig)
            sent += 1
        except OSError:
            continue
    if not sent and proc.poll() is None:  # no rank yet (still meeting the others): torchrun itself
        proc.send_signal(sig)
        sent = 1
    return sent


def log(message: str) -> None:
    print(f"orbit agent: {message}", flush=True)


def gather(store, job_id: str, attempt: int, step: int, group: NodeGroup, staging: Path) -> list[tuple[CheckpointManifest, Path]] | None:
    """Node 0: every other node's part of checkpoint `step`, fetched (each file verified) into
    `staging/node<K>`, in node order, once all are stored; None if one is still missing after the wait."""
    deadline = time.monotonic() + group.wait_s
    found: dict[int, tuple[CheckpointManifest, Path]] = {}
    while True:
        for rank in group.others:
            if rank in found:
                continue
            uri = store.uri_for(job_id, part_name(step, attempt, rank))
            try:
                store.read_manifest(uri)
            except StoreError:
                continue  # not there yet
            dest = staging / f"node{rank}"
            shutil.rmtree(dest, ignore_errors=True)
            found[rank] = (store.fetch(uri, dest), dest)
        if len(found) == len(group.others):
            return [found[k] for k in group.others]
        if time.monotonic() >= deadline:
            log(f"checkpoint at step {step}: no part from node(s) {sorted(set(group.others) - set(found))} within "
                f"{group.wait_s:.0f} s; not registered (a multi-node script saves on every node: DCP)")
            return None
        time.sleep(POLL_S)


def store_part(store, job_id: str, attempt: int, group: NodeGroup, found: Found, files: dict[str, Path], tier: str,
               source: str | None, notice: tuple[float | None, float | None] = (None, None)) -> None:
    """A node but node 0: its part of a checkpoint, for node 0 to put together. `notice`: when
    this node's notice came and its deadline (either None), for node 0's `local_checkpoint`."""
    name = part_name(found.step, attempt, group.node_rank)
    store_files(store, job_id, name, files, CheckpointManifest(
        job_id=job_id, step=found.step, tier=tier, files={}, created_at=datetime.now(timezone.utc).isoformat(),
        attempt=attempt, meta={"layout": found.layout, "name": found.name, "format": "command",
                               "group_part": group.node_rank, "source": source,
                               "notice_at": notice[0], "deadline": notice[1]}))
    log(f"node {group.node_rank}'s part of the checkpoint at step {found.step} stored ({tier})")


def union(files: dict[str, Path], parts: list[tuple[CheckpointManifest, Path]], tier: str,
          source: str | None) -> tuple[dict[str, Path], str, str | None]:
    """Node 0's files and every other node's part: the checkpoint's files, its tier (emergency
    when any node saved after a notice, which stopped the group) and that notice's source."""
    files = dict(files)
    for part, where in parts:
        files.update({rel: where / rel for rel in part.files})
        if part.tier == "emergency":
            tier, source = "emergency", source or part.meta.get("source")
    return files, tier, source


def earliest_notice(parts: list[tuple[CheckpointManifest, Path]], own: tuple[float | None, float | None]
                    ) -> tuple[float | None, float | None]:
    """The group's notice for a checkpoint: the earliest time a node got one and the earliest
    deadline given (the group goes when its first node does); each None where no node had one.
    A part's value that is not a finite number (a part from elsewhere) is left out."""
    def finite(values) -> list[float]:
        return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v)]

    times = finite([own[0], *(part.meta.get("notice_at") for part, _ in parts)])
    deadlines = finite([own[1], *(part.meta.get("deadline") for part, _ in parts)])
    return (min(times) if times else None), (min(deadlines) if deadlines else None)


def drop_parts(store, job_id: str, attempt: int, step: int, group: NodeGroup) -> None:
    for rank in group.others:
        try:
            store.delete(store.uri_for(job_id, part_name(step, attempt, rank)))
        except (OSError, StoreError) as exc:  # a leftover part is garbage, never a checkpoint
            log(f"part {part_name(step, attempt, rank)} was not deleted: {exc}")

