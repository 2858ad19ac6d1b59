"""Price feed: ingest ticks for the offers in use; flag jobs whose offer got too expensive;
request a migration run (make-before-break) when an offer's risk keeps rising, a deadline
needs on-demand, or a host got AWS's rebalance recommendation and its template says
`checkpoint.on_rebalance: migrate` (`control.migration.plan_migrations`)."""
from datetime import datetime, timezone

import dagster as dg

from ..control.migration import plan_migrations
from ..control.prices import ingest_prices
from ..ops.rental import migration_request, rental_job
from ..resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource, active


@dg.sensor(job=rental_job, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Ingests price ticks of the offers in use; flags jobs above their max price; requests a run "
                       "that moves a job off an offer whose risk keeps rising, or off an instance AWS recommends "
                       "rebalancing off (make-before-break).")
def price_feed_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource, sim_market: SimMarketResource,
                      ssh_rental: SshRentalResource, aws_spot: AwsSpotResource):
    since = datetime.fromtimestamp(float(context.cursor), timezone.utc) if context.cursor else None
    now = datetime.now(timezone.utc)
    with active(sim_market, ssh_rental, aws_spot):
        report = ingest_prices(orbit.settings(), since)
        moves = plan_migrations(orbit.settings())
    context.update_cursor(str(now.timestamp()))
    for flag in report.flagged:
        context.log.warning(f"{flag['job_id']}: {flag['offer_id']} now ${flag['usd_per_gpu_hour']:.4f}/GPU-h, "
                            f"above its max ${flag['max']}/GPU-h")
    for move in moves:
        context.log.info(f"{move['job_id']} attempt {move['attempt']}: move {move['from']} -> {move['to']} "
                         f"requested ({move['trigger']})")
        yield migration_request(move)
    if not report.ticks and not report.flagged and not moves:
        yield dg.SkipReason("no new price ticks, no move to make")
