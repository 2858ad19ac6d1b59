"""Pieces every provider shares: the agent's command line and the event-file reader (the host contract's)."""
from __future__ import annotations

import json
from pathlib import Path

from ..core.execution import Resources
from ..core.host_contract import READ_MAX, Entry, read_file
from ..core.offers import Offer
from .base import LaunchSpec


def agent_argv(python: str, bundle: Path, workdir: Path, spec: LaunchSpec, metadata_url: str | None) -> list[str]:
    """The runtime agent's command line, as an argv list (never a shell string)."""
    argv = [python, "-m", "orbit_dagster.runtime.agent", str(bundle), "--workdir", str(workdir),
            "--task", spec.task, "--attempt", str(spec.attempt), "--store", spec.store_uri]
    if spec.resume_from:
        argv += ["--resume-from", spec.resume_from]
        if spec.resume_sha256:
            argv += ["--expect-sha256", spec.resume_sha256]
    if spec.eval_checkpoint:
        argv += ["--checkpoint", spec.eval_checkpoint]
        if spec.eval_sha256:
            argv += ["--expect-sha256", spec.eval_sha256]
        for uri, sha256 in spec.eval_more:
            argv += ["--also-evaluate", uri, sha256]
    if spec.checkpoint_every:
        argv += ["--checkpoint-every", str(spec.checkpoint_every)]
    if spec.interval_plan:
        argv += ["--interval-plan", json.dumps(spec.interval_plan, sort_keys=True, allow_nan=False)]
    if spec.memory_every:
        argv += ["--memory-every", str(spec.memory_every)]
    if metadata_url:
        argv += ["--metadata-url", metadata_url]
    if spec.probe:
        argv.append("--probe")
    if spec.nnodes > 1:  # one node of a group: where torchrun meets the others (runtime/group.py)
        argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                 "--rdzv-endpoint", str(spec.rdzv_endpoint), "--rdzv-id", str(spec.rdzv_id)]
    return argv + list(spec.extra_args)


EVENTS_READ_MAX = READ_MAX  # bytes per call: a host's file is read in bounded steps, the rest next poll


def read_event_file(path: Path, offset: int) -> tuple[list[Entry], int]:
    """The host-contract records (and refusals) of the whole event lines after byte `offset`
    (at most EVENTS_READ_MAX bytes of them), and the offset after the last whole line. A line
    longer than that is no event: refused, and skipped."""
    return read_file(path, offset, limit=EVENTS_READ_MAX)


def offer_fits(offer: Offer, r: Resources) -> bool:
    """Does the offer meet the requested GPU model, count and memory?"""
    if r.gpu not in ("any", "", None) and offer.gpu.lower() != r.gpu.lower():
        return False
    return offer.gpu_count >= r.gpu_count and offer.gpu_memory_gb >= r.gpu_memory_gb

