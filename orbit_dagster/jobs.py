"""Asset jobs the sensors and schedules launch (one per kind of work, so runs are easy to find).

Each job names exactly the checks it runs: an evaluation run first re-verifies its
checkpoint's bytes (`checkpoint_integrity`, blocking: a failure stops the evaluation before
anything is rented) and then checks the metrics it wrote; the cost run checks that the bill
adds up and that every live checkpoint has been evaluated.
"""
import dagster as dg

from .assets.checks import checkpoint_integrity, evaluation_metrics_valid, every_checkpoint_evaluated

# One asset per job, run in the run's own process: the multiprocess default would start a
# second Python process (and import Dagster again) for every step.
EXECUTOR = dg.in_process_executor

train_job = dg.define_asset_job("train_job", selection=dg.AssetSelection.assets("training_run").without_checks(),
                                tags={"orbit/kind": "train"}, executor_def=EXECUTOR)
eval_job = dg.define_asset_job(
    "eval_job",
    selection=dg.AssetSelection.assets("evaluation").without_checks()
    | dg.AssetSelection.checks(checkpoint_integrity, evaluation_metrics_valid),
    tags={"orbit/kind": "eval"}, executor_def=EXECUTOR)
best_job = dg.define_asset_job("best_job", selection=dg.AssetSelection.assets("best_checkpoint"),
                               tags={"orbit/kind": "best"}, executor_def=EXECUTOR)
discovery_job = dg.define_asset_job("discovery_job", selection=["offer_catalog"], tags={"orbit/kind": "discovery"},
                                    executor_def=EXECUTOR)
cost_job = dg.define_asset_job("cost_job", selection=dg.AssetSelection.assets("cost_summary")
                               | dg.AssetSelection.checks(every_checkpoint_evaluated),
                               tags={"orbit/kind": "cost"}, executor_def=EXECUTOR)
# What a team reads to decide where to run (docs/cost.md): refreshed daily and on demand, not
# after every stop (the face's DuckDB process and the advice's replays cost seconds).
cost_insight_job = dg.define_asset_job("cost_insight_job", selection=dg.AssetSelection.assets("cost_efficiency", "advice"),
                                       tags={"orbit/kind": "cost"}, executor_def=EXECUTOR)
