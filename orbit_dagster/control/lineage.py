"""Checkpoint lineages: which weights an attempt may continue from.

A lineage is one chain of training: it starts at an attempt (the first, or a retry from
scratch, or a retry whose config changes what is trained) and continues through every
attempt that resumes from its checkpoints. Its id, `L<attempt it started>-<config hash>`,
is recorded on the job (the lineage its current attempt trains), on every run and on every
checkpoint. An attempt resumes only from its own lineage's checkpoints, and the best
checkpoint of a job is ranked among its current lineage's, so a retry with `config.lr`
changed can never resume from, register or rank the old weights.

The config hash covers what defines the weights: the workload, its entrypoint and its
config, except the keys the template declares `resume_compatible` (e.g. `config.steps`:
training longer continues the same chain).
"""
from __future__ import annotations

import hashlib
import json

from ..core.templates import TaskTemplate


def config_hash(template: TaskTemplate) -> str:
    method = getattr(template, "lineage_hash", None)
    if callable(method):
        return method()
    keep = {k.split(".", 1)[1] for k in getattr(template, "resume_compatible", ()) if k.startswith("config.")}
    payload = {"workload": template.workload, "entrypoint": template.entrypoint,
               "config": {k: v for k, v in sorted(template.config.items()) if k not in keep}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def lineage_id(attempt: int, template: TaskTemplate) -> str:
    return f"L{int(attempt)}-{config_hash(template)[:16]}"


def same_config(lineage: str | None, template: TaskTemplate) -> bool:
    return bool(lineage) and lineage.split("-", 1)[-1] == config_hash(template)[:16]


def next_lineage(current: str | None, template: TaskTemplate, attempt: int, *, from_scratch: bool) -> str:
    """The lineage attempt `attempt` trains: the current one when it may continue it, else new."""
    if current and not from_scratch and same_config(current, template):
        return current
    return lineage_id(attempt, template)
