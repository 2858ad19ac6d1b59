"""The market: rentable offers in dispatch's order, trace replays through the policies, and
the embedded market's operator (`orbit sim reclaim`).

Each command imports the layers it drives inside its body: `orbit --help` and every command
then load only their own path (importing all of them at start-up takes 3.3 s instead of 1.2 s).
"""
from __future__ import annotations

import json

import click

from .common import load_settings


@click.command()
@click.option("--gpu", default=None, help="GPU model or family, e.g. H100, A100, L4")
@click.option("--max-price", type=float, default=None, metavar="USD_PER_GPU_HOUR")
@click.option("--gpu-count", type=int, default=1, show_default=True, help="GPUs the job uses")
@click.option("--save-seconds", type=float, default=None, help="durable save time (default: the ledger's median)")
@click.option("--restore-seconds", type=float, default=None, help="restore time (default: dispatch's)")
@click.option("--notice-seconds", type=float, default=None, help="reclaim notice (default: each provider's)")
@click.option("--json", "as_json", is_flag=True)
def offers(gpu: str | None, max_price: float | None, gpu_count: int, save_seconds: float | None,
           restore_seconds: float | None, notice_seconds: float | None, as_json: bool) -> None:
    """Rentable offers in the order dispatch ranks them (expected $ per useful PFLOP), each with its reason."""
    from ..control.observations import measured_tflops, observed_reclaims
    from ..control.placement import measured_save_seconds
    from ..control.trends import trend_choices
    from .offers import offers_document, offers_table

    ledger = load_settings().ledger()
    doc = offers_document(gpu=gpu, max_price=max_price, gpu_count=gpu_count, observed=observed_reclaims(ledger),
                          measured=measured_tflops(ledger),
                          save_s=measured_save_seconds(ledger) if save_seconds is None else save_seconds,
                          restore_s=restore_seconds, notice_s=notice_seconds,
                          trends=lambda listed: trend_choices(ledger, listed))
    click.echo(json.dumps(doc, indent=2) if as_json else offers_table(doc))


@click.command()
@click.option("--trace", "trace", required=True, multiple=True, type=click.Path(),
              help="a spot trace file (formats: docs/policies.md); several: one job over them as offers")
@click.option("--policy", default=None, help="notice-only, fixed-30m, young-daly, young-daly-true, hindsight, orbit "
              "(or none); with a deadline: greedy, uniform-progress, orbit, optimal (default: all)")
@click.option("--job-hours", type=float, default=None)
@click.option("--deadline-hours", type=float, default=None)
@click.option("--cloud", type=click.Choice(["aws", "gcp"]), default=None,
              help="the cloud the trace was measured in (default: the trace's metadata.cloud)")
@click.option("--notice-seconds", type=float, default=None, help="default: the trace's cloud's (AWS 120, GCP 30)")
@click.option("--save-seconds", type=float, default=60.0, show_default=True)
@click.option("--restore-seconds", type=float, default=300.0, show_default=True)
@click.option("--notice-miss-rate", type=float, default=0.0, show_default=True, help="share of notices lost")
@click.option("--starts", type=int, default=8, show_default=True, help="jobs per trace, evenly spaced")
@click.option("--group", is_flag=True, help="an N-node trace as a group: a reclaim of some nodes is decided by the "
              "group policy (replace, shrink or regroup) as production decides it, not as the whole gang's")
@click.option("--min-nodes", type=int, default=None, help="with --group: the template's elastic.min_nodes "
              "(default: not elastic)")
@click.option("--json", "as_json", is_flag=True)
def simulate(trace: tuple[str, ...], policy: str | None, job_hours: float | None, deadline_hours: float | None, cloud: str | None,
             notice_seconds: float | None, save_seconds: float, restore_seconds: float, notice_miss_rate: float,
             starts: int, group: bool, min_nodes: int | None, as_json: bool) -> None:
    """Replay a spot trace through the policies the control plane uses (deterministic).

    The trace's cloud (its notice and prices) is --cloud, else the file's metadata.cloud; a trace
    with neither is refused. Only the shared data set's files are named by cloud (its SOURCES.md).
    Several --trace: one job over them as offers (dispatch's ranking, its avoided offers and
    the price sensor's migration rule replayed; the orbit policy, no deadline). --group: an
    N-node trace's partial reclaims decided by the group policy (docs/multi-node.md)."""
    from .simulate import format_result_table, simulate_command

    result = simulate_command(trace, policy, job_hours, deadline_hours, notice_seconds, save_seconds=save_seconds,
                              restore_seconds=restore_seconds, notice_miss_rate=notice_miss_rate, starts=starts,
                              cloud=cloud, group=group, min_nodes=min_nodes)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_result_table(result))



@click.group()
def sim() -> None:
    """The embedded (simulated) spot market."""


@sim.command("reclaim")
@click.argument("job")
@click.option("--at-step", type=int, default=None, help="once the workload reports this training step (default: now)")
@click.option("--notice-seconds", type=float, default=None, help="notice before the reclaim (default: the market's)")
@click.option("--node", type=int, default=None,
              help="which node of a job that spans several instances (default: node 0; docs/multi-node.md)")
def sim_reclaim(job: str, at_step: int | None, notice_seconds: float | None, node: int | None) -> None:
    """Reclaim the instance running JOB: the notice, then the instance gone, as a spot market does."""
    from ..control.forced_reclaim import force_reclaim
    from ..core.submission import check_job_id

    check_job_id(job)
    armed = force_reclaim(load_settings(), job, at_step=at_step, notice_seconds=notice_seconds, node=node)
    when = f"when it reports step {at_step}" if at_step is not None else "now"
    where = f"node {armed['node']} of {armed['nodes']} ({armed['instance']})" if armed["nodes"] > 1 else armed["instance"]
    click.echo(f"{job}: attempt {armed['attempt']} on {where} is reclaimed {when} "
               f"(notice {armed['notice_seconds']:g} s before); `orbit logs {job}` shows how it ends")


@sim.command("rebalance")
@click.argument("job")
@click.option("--at-step", type=int, default=None, help="once the workload reports this training step (default: now)")
@click.option("--node", type=int, default=None,
              help="which node of a job that spans several instances (default: node 0; docs/multi-node.md)")
def sim_rebalance(job: str, at_step: int | None, node: int | None) -> None:
    """Serve AWS's rebalance recommendation on the instance running JOB (no reclaim follows):
    the template's checkpoint.on_rebalance answers it (docs/recovery.md)."""
    from ..control.forced_reclaim import force_rebalance
    from ..core.submission import check_job_id

    check_job_id(job)
    armed = force_rebalance(load_settings(), job, at_step=at_step, node=node)
    when = f"when it reports step {at_step}" if at_step is not None else "now"
    where = f"node {armed['node']} of {armed['nodes']} ({armed['instance']})" if armed["nodes"] > 1 else armed["instance"]
    click.echo(f"{job}: attempt {armed['attempt']} on {where} is recommended to rebalance {when}; "
               f"`orbit logs {job}` shows what the job does about it")
