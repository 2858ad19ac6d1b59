"""Partitions: one per job, one per checkpoint, one per experiment.

A checkpoint's partition is two-dimensional, (job, checkpoint within the job): the job
dimension is the `jobs` partitions of `training_run`, so Dagster maps every checkpoint to
exactly its own job's training run (`MultiToSingleDimensionPartitionMapping("job")`), and
the lineage graph shows that, not every checkpoint under every run. The second dimension
is `a<attempt>/<step>`; the ledger's checkpoint key is `<job>/a<attempt>/<step>`.

Experiments are not a dimension of checkpoints (Dagster's multi-partitions have two), so no
built-in mapping ties an experiment's `best_checkpoint` to exactly its evaluations; see
`best.py` for what the UI shows instead.
"""
from __future__ import annotations

import dagster as dg

JOBS = "jobs"
CHECKPOINT_STEPS = "checkpoint_steps"
EXPERIMENTS = "experiments"
JOB_DIM, CHECKPOINT_DIM = "job", "checkpoint"

jobs_partitions = dg.DynamicPartitionsDefinition(name=JOBS)
checkpoint_steps_partitions = dg.DynamicPartitionsDefinition(name=CHECKPOINT_STEPS)
checkpoints_partitions = dg.MultiPartitionsDefinition({JOB_DIM: jobs_partitions, CHECKPOINT_DIM: checkpoint_steps_partitions})
experiments_partitions = dg.DynamicPartitionsDefinition(name=EXPERIMENTS)


def partition_of(checkpoint_key: str) -> dg.MultiPartitionKey:
    """`<job>/a<attempt>/<step>` -> its partition of `checkpoint` and `evaluation`."""
    job, _, within = checkpoint_key.partition("/")
    return dg.MultiPartitionKey({JOB_DIM: job, CHECKPOINT_DIM: within})


def checkpoint_key_of(partition_key: str | dg.MultiPartitionKey) -> str:
    """The ledger's checkpoint key of a partition of `checkpoint` or `evaluation`."""
    if not isinstance(partition_key, dg.MultiPartitionKey):
        dims = dict(zip(sorted([CHECKPOINT_DIM, JOB_DIM]), str(partition_key).split("|")))
    else:
        dims = partition_key.keys_by_dimension
    return f"{dims[JOB_DIM]}/{dims[CHECKPOINT_DIM]}"


def add_checkpoint_partitions(instance: dg.DagsterInstance, keys: list[str]) -> None:
    """Add the partitions of these checkpoints (both dimensions), one call per dimension:
    a call per key is ~700x slower on a SQLite instance."""
    if not keys:
        return
    jobs = sorted({k.partition("/")[0] for k in keys})
    steps = sorted({k.partition("/")[2] for k in keys})
    have_jobs = set(instance.get_dynamic_partitions(JOBS))
    have_steps = set(instance.get_dynamic_partitions(CHECKPOINT_STEPS))
    if set(jobs) - have_jobs:
        instance.add_dynamic_partitions(JOBS, sorted(set(jobs) - have_jobs))
    if set(steps) - have_steps:
        instance.add_dynamic_partitions(CHECKPOINT_STEPS, sorted(set(steps) - have_steps))


def checkpoint_partition_requests(instance: dg.DagsterInstance, keys: list[str]) -> list:
    """The same, as a sensor's dynamic partition requests."""
    jobs = sorted({k.partition("/")[0] for k in keys} - set(instance.get_dynamic_partitions(JOBS)))
    steps = sorted({k.partition("/")[2] for k in keys} - set(instance.get_dynamic_partitions(CHECKPOINT_STEPS)))
    return ([jobs_partitions.build_add_request(jobs)] if jobs else []) + \
        ([checkpoint_steps_partitions.build_add_request(steps)] if steps else [])
