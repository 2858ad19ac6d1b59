"""The one place that wires orbit-dagster's assets, checks, jobs, sensors, schedules and resources."""
import warnings

import dagster as dg

from .assets.advice import advice
from .assets.best import best_checkpoint
from .assets.catalog import offer_catalog
from .assets.checks import CHECKS
from .assets.costs import cost_efficiency, cost_summary
from .assets.evaluation import evaluation
from .assets.training import checkpoint, training_run
from .jobs import EXECUTOR, best_job, cost_insight_job, cost_job, discovery_job, eval_job, train_job
from .ops.launchpad import cancel_job, retry_job, submit_job
from .ops.rental import rental_job
from .resources import OrbitResource, from_environment
from .schedules.backfill import eval_backfill_sensor
from .schedules.costs import cost_insight_schedule
from .schedules.discovery import offer_discovery_schedule
from .sensors.evaluations import checkpoint_evaluation_sensor
from .sensors.followups import best_checkpoint_sensor, cost_summary_sensor
from .sensors.interruptions import spot_interruption_sensor
from .sensors.prices import price_feed_sensor
from .sensors.queue import job_queue_sensor

# Dagster's own sensor decorator passes `owners` to SensorDefinition, which then warns that
# the parameter is beta when the code location loads its sensors of the code location, though orbit sets no owners.
warnings.filterwarnings("ignore", message="Parameter `owners` of initializer `SensorDefinition.__init__`",
                        category=dg.BetaWarning)

defs = dg.Definitions(
    assets=[training_run, checkpoint, evaluation, best_checkpoint, cost_summary, cost_efficiency,
            advice, offer_catalog],
    asset_checks=CHECKS,
    jobs=[train_job, eval_job, best_job, cost_job, cost_insight_job, discovery_job, submit_job, retry_job, cancel_job, rental_job],
    schedules=[offer_discovery_schedule, cost_insight_schedule],
    sensors=[job_queue_sensor, checkpoint_evaluation_sensor, best_checkpoint_sensor, cost_summary_sensor,
             spot_interruption_sensor, price_feed_sensor, eval_backfill_sensor],
    resources={"orbit": OrbitResource(), **from_environment()},
    executor=EXECUTOR,
)
