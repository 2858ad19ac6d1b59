"""Dynamic partitions: one per job, one per checkpoint (`<job>/<step>`), one per experiment."""
import dagster as dg

JOBS = "jobs"
CHECKPOINTS = "checkpoints"
EXPERIMENTS = "experiments"

jobs_partitions = dg.DynamicPartitionsDefinition(name=JOBS)
checkpoints_partitions = dg.DynamicPartitionsDefinition(name=CHECKPOINTS)
experiments_partitions = dg.DynamicPartitionsDefinition(name=EXPERIMENTS)
