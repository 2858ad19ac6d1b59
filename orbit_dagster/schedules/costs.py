"""Daily cost insight: the cost-efficiency view and the advice built on it, refreshed."""
import dagster as dg

from ..jobs import cost_insight_job

cost_insight_schedule = dg.ScheduleDefinition(
    name="cost_insight_schedule",
    job=cost_insight_job,
    cron_schedule="0 7 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Refreshes cost_efficiency and advice every day (docs/cost.md); materialise them from the UI for "
                "fresh ones.",
)
