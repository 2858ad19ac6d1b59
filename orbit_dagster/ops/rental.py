"""Runs that rent or release GPUs on a sensor's decision, so each has a run record.

The interruption sensor decides (a host lost while no run followed it, a cancelled workload
still running, a dispatch abandoned, an instance still metered after its attempt, a LOST
job to requeue); the price-feed sensor decides migrations (rising risk, a deadline, a rebalance
recommendation: tag `orbit/trigger`). Each decision becomes one run of `rental_job`, keyed by
the decision and tagged with the job, attempt, provider, offer and failure class, which
carries it out (`control.reconcile.act`, `control.migration.carry_out`).
"""

import json
from typing import Optional

import dagster as dg

from ..control.evaluate import abandon_evaluation
from ..control.migration import carry_out
from ..control.reconcile import Decision, act
from ..resources import AwsSpotResource, OrbitResource, SimMarketResource, SshRentalResource, active


class RentalConfig(dg.Config):
    action: str  # close_lost | stop_cancelled | abandon_dispatch | release_orphan | recover | migrate | abandon_eval
    job_id: str
    attempt: int
    reason: str = ""
    run_id: Optional[str] = None
    instance_id: Optional[str] = None
    provider: Optional[str] = None
    offer_id: Optional[str] = None
    failure_class: Optional[str] = None
    move: Optional[str] = None  # a planned migration, or a stale evaluation claim, as JSON


@dg.op(description="Carry out one rental decision (idempotent).")
def rental_op(context: dg.OpExecutionContext, config: RentalConfig, orbit: OrbitResource,
              sim_market: SimMarketResource, ssh_rental: SshRentalResource, aws_spot: AwsSpotResource) -> str:
    settings = orbit.settings()
    with active(sim_market, ssh_rental, aws_spot):
        if config.action == "abandon_eval":
            done = abandon_evaluation(settings, json.loads(config.move or "{}"))
        elif config.action == "migrate":
            move = carry_out(settings, json.loads(config.move or "{}"))
            done = (f"moving {move['job_id']} attempt {move['attempt']}: {move['from']} -> {move['to']}, replacement "
                    f"{move['replacement']}") if move.get("replacement") else f"no move: {move.get('skipped')}"
        else:
            done = act(settings, Decision(config.action, config.job_id, config.attempt, config.reason, config.run_id,
                                          config.instance_id, config.provider, config.offer_id, config.failure_class))
    context.log.info(done)
    return done


@dg.job(tags={"orbit/kind": "rental"}, description="Rent or release on a sensor's decision (recover, release, migrate).")
def rental_job() -> None:
    rental_op()


def decision_request(d: Decision) -> dg.RunRequest:
    config = {k: v for k, v in {"action": d.action, "job_id": d.job_id, "attempt": d.attempt, "reason": d.reason[:1000],
                                "run_id": d.run_id, "instance_id": d.instance_id, "provider": d.provider,
                                "offer_id": d.offer_id, "failure_class": d.failure_class}.items() if v is not None}
    return dg.RunRequest(run_key=d.key, job_name="rental_job", tags=d.tags(),
                         run_config={"ops": {"rental_op": {"config": config}}})


def migration_request(move: dict) -> dg.RunRequest:
    tags = {"orbit/job": move["job_id"], "orbit/attempt": str(move["attempt"]), "orbit/action": "migrate",
            "orbit/kind": "rental", "orbit/provider": move["provider"], "orbit/offer": move["to"],
            "orbit/instance": move["instance_id"], "orbit/trigger": move.get("trigger", "risk")}
    config = {"action": "migrate", "job_id": move["job_id"], "attempt": int(move["attempt"]), "reason": move["reason"][:1000],
              "run_id": move["run_id"], "instance_id": move["instance_id"], "provider": move["provider"],
              "offer_id": move["to"], "move": json.dumps(move)}
    return dg.RunRequest(run_key=f"migrate:{move['run_id']}", job_name="rental_job", tags=tags,
                         run_config={"ops": {"rental_op": {"config": config}}})


def abandoned_eval_request(row: dict) -> dg.RunRequest:
    tags = {"orbit/job": row["job_id"], "orbit/checkpoint": row["checkpoint_key"], "orbit/suite": row["suite"],
            "orbit/action": "abandon_eval", "orbit/kind": "rental"}
    config = {"action": "abandon_eval", "job_id": row["job_id"], "attempt": 0, "reason": row["why"],
              "move": json.dumps(row, default=str)}
    return dg.RunRequest(run_key=f"abandon_eval:{row['checkpoint_key']}:{row['suite']}:try-{row['tries']}",
                         job_name="rental_job", tags=tags, run_config={"ops": {"rental_op": {"config": config}}})
