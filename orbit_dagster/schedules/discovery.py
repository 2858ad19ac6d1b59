"""Daily offer discovery (control/discovery.py)."""
import dagster as dg

from ..jobs import discovery_job

offer_discovery_schedule = dg.ScheduleDefinition(
    name="offer_discovery_schedule",
    job=discovery_job,
    cron_schedule="0 6 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Asks every provider for its shapes every day; the change set is recorded in the ledger "
                "(catalog_changes) and on offer_catalog, whose check fails when an offer in use is gone.",
)
