"""The run queue orbit's `dagster.yaml` names: Dagster's queued run coordinator, plus pool tags.

Every run that rents a GPU must count against its provider's pool, the `orbit/pool` run tag
(deploy/profiles.py). Sensors, the queue and the scheduled backfill tag the runs they request, but
a run a person launches in the UI (a backfill of `evaluation` partitions, a materialisation
of a `training_run` partition) carries only Dagster's tags. Dagster's own `pool=` is fixed
per asset, while the provider is chosen per job, so the pool is found here, on submission,
from the ledger: the one place every submitted run passes, whoever launched it.
"""
from __future__ import annotations

from dagster._core.run_coordinator.base import SubmitRunContext
from dagster._core.run_coordinator.queued_run_coordinator import QueuedRunCoordinator
from dagster._core.storage.dagster_run import DagsterRun

from ..assets.partitions import checkpoint_key_of
from ..settings import Settings
from .profiles import POOL_TAG, job_pools, pool_tags

# The assets that rent a GPU, and the kind of run each makes (which pool tags it gets).
RENTING = {"training_run": "train", "evaluation": "eval"}
PARTITION_TAG = "dagster/partition"


class OrbitRunCoordinator(QueuedRunCoordinator):
    """QueuedRunCoordinator that adds the provider's pool tags to an untagged renting run.

    Configured exactly like QueuedRunCoordinator: its config schema and `from_config_value`
    (which builds `cls`) are inherited."""

    def submit_run(self, context: SubmitRunContext) -> DagsterRun:
        run = context.dagster_run
        if POOL_TAG not in run.tags and run.tags.get(PARTITION_TAG):
            try:
                tags = self._pool_tags(run)
                if tags:
                    self._instance.add_run_tags(run.run_id, tags)
            except Exception as exc:  # a lookup never blocks a run: it then fails or succeeds on its own
                why = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line in the daemon's log
                self._logger.warning(f"run {run.run_id}: no pool tag added ({why}); "
                                     f"it is queued outside its provider's pool")
        return super().submit_run(context)

    def _pool_tags(self, run: DagsterRun) -> dict[str, str]:
        kind = _renting_kind(self._instance, run)
        if kind is None:
            return {}
        # Imported on use: every Dagster process (run workers too) loads this class with its instance.
        partition = run.tags[PARTITION_TAG]
        # A training partition is its job; an evaluation's is a checkpoint, `<job>/a<attempt>/<step>`.
        job_id = partition if kind == "train" else checkpoint_key_of(partition).split("/", 1)[0]
        placement = job_pools(Settings.from_env().ledger(), [job_id]).get(job_id)
        if placement is None:
            raise LookupError(f"job {job_id!r} is not in the ledger")
        return pool_tags(placement, kind)


def _renting_kind(instance, run: DagsterRun) -> str | None:
    """`train` or `eval` if the run materialises a renting asset (a training holds the longer slot)."""
    if run.asset_selection is not None:
        names = {key.to_user_string() for key in run.asset_selection}
    else:  # a whole asset job launched from the launchpad: the ops it runs
        snap = instance.get_execution_plan_snapshot(run.execution_plan_snapshot_id) \
            if run.execution_plan_snapshot_id else None
        names = {step.key for step in snap.steps} if snap else set()
    kinds = {RENTING[name] for name in names if name in RENTING}
    return "train" if "train" in kinds else next(iter(kinds), None)
