"""Evaluation backfill, every six hours: one Dagster backfill per suite, of exactly the pairs missing.

Dagster lets only sensors launch backfills (a schedule yields runs), so the six-hourly
cadence is this sensor's interval. What it backfills is `control.backfill.plan_backfill`'s:
live checkpoints without a result for their job's current suite version, and evaluations
that failed hours ago, one backfill per suite and provider so that its runs carry their
provider's pool tag (`orbit/pool`) like every other evaluation. The ledger's claim lets only
one run evaluate a (checkpoint, suite) at a time, whoever launched it.
"""
import dagster as dg
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.events import AssetKeyPartitionKey

from ..assets.partitions import checkpoint_partition_requests, partition_of
from ..control.backfill import plan_backfill
from ..deploy.profiles import job_pools, pool_tags
from ..resources import OrbitResource

EVALUATION = dg.AssetKey("evaluation")
INTERVAL_S = 6 * 3600


def backfill_request(context, suite: str, placement: str, keys: list[str]) -> dg.RunRequest:
    # Dagster builds a backfill from an asset-partition subset only through this constructor
    # (what its own automation uses); there is no other public way to launch one from code.
    subset = AssetGraphSubset.from_asset_partition_set(
        {AssetKeyPartitionKey(EVALUATION, str(partition_of(k))) for k in keys}, context.repository_def.asset_graph)
    return dg.RunRequest.for_asset_graph_subset(subset, tags={"orbit/suite": suite, "orbit/kind": "eval",
                                                              "orbit/backfill": "scheduled",
                                                              **pool_tags(placement, "eval")})


@dg.sensor(minimum_interval_seconds=INTERVAL_S, default_status=dg.DefaultSensorStatus.RUNNING,
           asset_selection=dg.AssetSelection.assets(EVALUATION),
           description="Every 6 hours: a Dagster backfill of the (checkpoint, suite) pairs still missing an "
                       "evaluation (a new suite version, failures to retry).")
def eval_backfill_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource) -> dg.SensorResult:
    planned = plan_backfill(orbit.settings())
    if not planned:
        return dg.SensorResult(skip_reason="every live checkpoint has its current suite's evaluation")
    keys = [k for ks in planned.values() for k in ks]
    # One backfill per suite and provider, so that its runs carry their provider's pool tag.
    placements = job_pools(orbit.settings().ledger(), [k.split("/", 1)[0] for k in keys])
    groups: dict[tuple[str, str], list[str]] = {}
    for suite, ks in planned.items():
        for k in ks:
            groups.setdefault((suite, placements.get(k.split("/", 1)[0]) or "sim"), []).append(k)
    return dg.SensorResult(run_requests=[backfill_request(context, suite, placement, ks)
                                         for (suite, placement), ks in sorted(groups.items())],
                           dynamic_partitions_requests=checkpoint_partition_requests(context.instance, keys))
