"""`orbit sim reclaim` and `orbit sim rebalance`: the embedded market's operator reclaims a
job's instance, or recommends rebalancing off it, on request.

What a spot market does to a job at a moment nobody chooses, done when a person wants to see
it: the notice (metadata endpoint and SIGTERM, as on AWS), then the instance gone after the
notice; or AWS's rebalance recommendation on the metadata endpoint, which the template's
`checkpoint.on_rebalance` answers. Only the embedded market takes such an order; a real
cloud's reclaims and recommendations are its own.
"""
from __future__ import annotations

from ..core.errors import OrbitError
from ..ledger import records as R
from ..providers.base import RunHandle
from ..providers.sim.provider import SimProvider
from ..settings import Settings
from .context import bundle_and_provider


def _target(settings: Settings, job_id: str, at_step: int | None, node: int | None, what: str):
    """(attempt, the node's instance, every node's handle, the provider) of JOB's running
    attempt, or the refusal naming what to fix."""
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0):
        raise OrbitError(f"--at-step {at_step!r} is not a step", field="--at-step", value=at_step,
                         fix="a training step: a whole number >= 0")
    ledger = settings.ledger()
    job = R.require_job(ledger, job_id)
    attempt = int(job["attempt"])
    run = R.run(ledger, R.run_id_for(job_id, attempt))
    if job["state"] != "RUNNING" or run is None or run["state"] != "RUNNING" or not run["handle"]:
        raise OrbitError(f"job {job_id} is {job['state']}: only a job running on an instance can be {what}",
                         field="job", value=job_id, fix=f"wait until `orbit status {job_id}` says RUNNING")
    _, provider = bundle_and_provider(settings, ledger, job_id, attempt)
    if not isinstance(provider, SimProvider):
        raise OrbitError(f"job {job_id} runs on {type(provider).__name__}, not on the embedded market",
                         field="job", value=job_id,
                         fix=f"only a job on the simulated market (placement: sim) can be {what} on request")
    nodes = RunHandle.model_validate_json(run["handle"]).members
    if node is not None and (isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < len(nodes)):
        raise OrbitError(f"--node {node!r}: job {job_id}'s attempt {attempt} runs on {len(nodes)} node(s)",
                         field="--node", value=node, fix=f"a node rank from 0 to {len(nodes) - 1}")
    return attempt, nodes[node or 0].instance, nodes, provider


def force_reclaim(settings: Settings, job_id: str, *, at_step: int | None = None,
                  notice_seconds: float | None = None, node: int | None = None) -> dict:
    """Arm a reclaim of the instance running JOB's current attempt (of node `node` of a group;
    default node 0): now, or once its workload (any node of its group) reports training step
    `at_step`. Returns what was armed."""
    if notice_seconds is not None and not 0 < notice_seconds <= 3600:
        raise OrbitError(f"--notice-seconds {notice_seconds} is out of range", field="--notice-seconds",
                         value=notice_seconds, fix="seconds between the notice and the reclaim, in (0, 3600]")
    attempt, instance, nodes, provider = _target(settings, job_id, at_step, node, "reclaimed")
    notice = notice_seconds or provider.notice_seconds
    if at_step is None:
        provider.inject_reclaim(instance, in_seconds=notice, notice_seconds=notice)
    else:  # the step any node reports: in a group, the rank that prints metrics may be on another node
        provider.inject_reclaim(instance, at_step=at_step, notice_seconds=notice, progress_of=list(nodes))
    return {"job": job_id, "attempt": attempt, "instance": instance.instance_id, "at_step": at_step,
            "notice_seconds": notice, "node": node or 0, "nodes": len(nodes)}


def force_rebalance(settings: Settings, job_id: str, *, at_step: int | None = None, node: int | None = None) -> dict:
    """Have the instance running JOB's current attempt (node `node` of a group; default node 0)
    serve AWS's rebalance recommendation: now, or once its workload (any node of its group)
    reports training step `at_step`. No reclaim follows. Returns what was armed."""
    attempt, instance, nodes, provider = _target(settings, job_id, at_step, node, "sent a rebalance recommendation")
    provider.inject_rebalance(instance, at_step=at_step, progress_of=list(nodes) if at_step is not None else None)
    return {"job": job_id, "attempt": attempt, "instance": instance.instance_id, "at_step": at_step,
            "node": node or 0, "nodes": len(nodes)}
