"""Fixtures of the reliability suite, and the fault table's hooks (tests/reliability/faults.py)."""
from __future__ import annotations

import uuid

import pytest

from orbit_dagster.control.attempt import run_attempt
from orbit_dagster.control.submit import _bundle_row, ensure_experiment, submit
from orbit_dagster.core.bundle import build_bundle
from orbit_dagster.core.lifecycle import JobState
from orbit_dagster.core.submission import TaskSubmission, apply_overrides
from orbit_dagster.core.templates import load_template
from orbit_dagster.ledger import records as R
from orbit_dagster.ledger import utcnow
from orbit_dagster.settings import Settings
from tests.reliability.faults import (  # noqa: F401 - pytest finds hooks by name
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_terminal_summary,
)
from tests.security.test_cli_errors import fill, small_disk  # noqa: F401 - the same real full disk

# Small enough to keep the suite fast, large enough for two durable checkpoints.
FAST = {"config.steps": 8, "checkpoint.every_steps": 4}


def opened(settings: Settings) -> Settings:
    """Settings whose ledger is created (and migrated) before a test starts other processes."""
    settings.ledger().dispose()
    return settings


@pytest.fixture
def settings(orbit_home) -> Settings:
    return opened(Settings.from_env(orbit_home))


def train(settings: Settings, overrides: dict | None = None, *, experiment: str = "rel") -> str:
    """A job trained to the end on the sim market (real host and workload processes)."""
    job = submit(settings, "charlm-finetune", {**FAST, **(overrides or {})}, experiment=experiment)
    out = run_attempt(settings, job, poll_s=0.1)
    assert out.state == "SUCCEEDED", (out.state, out.reason)
    return job


def queue_unvalidated(settings: Settings, overrides: dict, *, experiment: str = "rel") -> str:
    """A queued job as a version without today's submission checks accepted it: the overrides
    pass the template's types but nobody asked whether they can be served here. What
    `submit` does, minus `check_serviceable`."""
    template = apply_overrides(load_template("charlm-finetune"), overrides)
    job_id = f"{template.name}-{uuid.uuid4().hex[:8]}"
    sub = TaskSubmission(template=template.name, overrides=overrides, experiment=experiment)
    bundle = build_bundle(template, sub, job_id, settings.bundles_dir)
    row = {"job_id": job_id, "template": template.name, "template_version": template.version, "kind": template.kind,
           "experiment": experiment, "project": "default", "placement": template.placement,
           "max_interruptions": template.max_interruptions, "imported": 0, "created_at": utcnow(),
           "lineage": f"L1-{uuid.uuid4().hex[:16]}"}
    with settings.ledger().write() as tx:
        ensure_experiment(tx, experiment, "default", template)
        R.insert_job(tx, row, [R.state_row(job_id, 1, JobState.CREATED), R.state_row(job_id, 1, JobState.QUEUED)])
        tx.insert("bundles", [_bundle_row(bundle, 1)])
    return job_id
