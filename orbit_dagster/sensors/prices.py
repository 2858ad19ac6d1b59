"""Price feed: ingest ticks for the offers in use; flag jobs whose offer got too expensive."""
from datetime import datetime, timezone

import dagster as dg

from ..control.migration import consider_migrations
from ..control.prices import ingest_prices
from ..resources import OrbitResource


@dg.sensor(minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Ingests price ticks of the offers in use; flags jobs above their max price; "
                       "moves jobs off offers whose risk keeps rising (make-before-break).")
def price_feed_sensor(context: dg.SensorEvaluationContext, orbit: OrbitResource):
    since = datetime.fromtimestamp(float(context.cursor), timezone.utc) if context.cursor else None
    now = datetime.now(timezone.utc)
    report = ingest_prices(orbit.settings(), since)
    context.update_cursor(str(now.timestamp()))
    for flag in report.flagged:
        context.log.warning(f"{flag['job_id']}: {flag['offer_id']} now ${flag['usd_per_gpu_hour']:.4f}/GPU-h, "
                            f"above its max ${flag['max']}/GPU-h")
    moves = consider_migrations(orbit.settings())
    for move in moves:
        context.log.info(f"{move['job_id']} attempt {move['attempt']}: moving {move['from']} -> {move['to']} "
                         f"(replacement {move['replacement']} provisioned first)")
    if not report.ticks and not report.flagged and not moves:
        yield dg.SkipReason("no new price ticks, no move to make")
