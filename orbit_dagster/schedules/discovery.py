"""Daily offer discovery."""
import dagster as dg

from ..jobs import discovery_job

offer_discovery_schedule = dg.ScheduleDefinition(
    name="offer_discovery_schedule",
    job=discovery_job,
    cron_schedule="0 6 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Refreshes the offer catalog every day; changes are recorded as catalog_change events.",
)
