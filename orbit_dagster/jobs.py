"""Asset jobs the sensors and schedules launch (one per kind of work, so runs are easy to find)."""
import dagster as dg

# One asset per job, run in the run's own process: the multiprocess default would start a
# second Python process (and import Dagster again) for every step.
EXECUTOR = dg.in_process_executor

# Training (and recovery) runs go ahead of queued evaluations: a recovering job is paying
# for nothing until its new attempt runs.
train_job = dg.define_asset_job("train_job", selection=["training_run"],
                                tags={"orbit/kind": "train", "dagster/priority": "10"}, executor_def=EXECUTOR)
eval_job = dg.define_asset_job("eval_job", selection=["evaluation"], tags={"orbit/kind": "eval"}, executor_def=EXECUTOR)
best_job = dg.define_asset_job("best_job", selection=["best_checkpoint"], tags={"orbit/kind": "best"},
                               executor_def=EXECUTOR)
discovery_job = dg.define_asset_job("discovery_job", selection=["offer_catalog"], tags={"orbit/kind": "discovery"},
                                    executor_def=EXECUTOR)
cost_job = dg.define_asset_job("cost_job", selection=["cost_summary"], tags={"orbit/kind": "cost"}, executor_def=EXECUTOR)
