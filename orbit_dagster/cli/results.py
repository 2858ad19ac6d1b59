"""Results: the best checkpoint, the primary metric, exports, cost, read-only SQL.

Each command imports the layers it drives inside its body: `orbit --help` and every command
then load only their own path (importing all of them at start-up takes 3.3 s instead of 1.2 s).
"""
from __future__ import annotations

import json

import click

from ..core.errors import OrbitError
from .common import load_settings, print_df


@click.command()
@click.argument("experiment")
@click.option("--lineage", default="current", show_default=True,
              help="rank each job's current lineage (default), `all` lineages, or one lineage by id")
@click.option("--json", "as_json", is_flag=True)
def best(experiment: str, lineage: str, as_json: bool) -> None:
    """The best checkpoint of EXPERIMENT by its primary metric, with its lineage (reads only)."""
    from ..control.best import compute_best

    result = compute_best(load_settings(), experiment, lineage=lineage)
    if result is None:
        raise OrbitError(f"experiment {experiment} has no checkpoint with a value for its primary metric yet",
                         field="experiment", value=experiment, fix="wait for evaluations, or check `orbit status`")
    if as_json:
        click.echo(json.dumps(result, default=str))
        return
    click.echo(f"best: {result['checkpoint_key']}  {result['metric_name']} = {result['metric_value']:.6g} "
               f"({result['metric_mode']}, from {result['metric_source']}, primary metric set at "
               f"{result['resolved_from']} level; {result['candidates']} candidates, lineages: {lineage})")
    click.echo("lineage: " + " <- ".join(f"{c['checkpoint_key']} (attempt {c['attempt']}, {c['tier']})"
                                         for c in result["lineage"]))


@click.command("export")
@click.argument("target", metavar="BEST_OR_CHECKPOINT")
@click.argument("dest", metavar="DEST", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["safetensors"]), default="safetensors", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def export(target: str, dest: str, fmt: str, as_json: bool) -> None:
    """Write the weights of BEST_OR_CHECKPOINT (an experiment: its best checkpoint; or a checkpoint
    key <job>/a<attempt>/<step>) to DEST as safetensors: no pickle, verified against the ledger,
    its sha256 recorded there (event `checkpoint_export`)."""
    from pathlib import Path

    from ..control.export import export_weights

    record = export_weights(load_settings(), target, Path(dest), fmt=fmt)
    if as_json:
        click.echo(json.dumps(record))
        return
    click.echo(f"exported {record['checkpoint_key']} -> {record['dest']} ({record['format']}, {record['tensors']} "
               f"tensors, {record['bytes']} bytes, sha256 {record['sha256']})")


@click.group()
def metric() -> None:
    """The primary metric of an experiment or a project."""


@metric.command("set")
@click.argument("name")
@click.argument("mode", type=click.Choice(["min", "max"]))
@click.option("--experiment", default=None)
@click.option("--project", default=None)
def metric_set(name: str, mode: str, experiment: str | None, project: str | None) -> None:
    """Rank EXPERIMENT's (or PROJECT's) checkpoints by NAME, lower (min) or higher (max) is better."""
    from ..control.best import set_primary_metric

    set_primary_metric(load_settings().ledger(), name=name, mode=mode, experiment=experiment, project=project)
    click.echo(f"primary metric of {'experiment ' + experiment if experiment else 'project ' + str(project)}: "
               f"{name} ({mode})")


@click.command()
@click.option("--by", type=click.Choice(["job", "experiment", "checkpoint", "provider", "node"]), default="job",
              show_default=True, help="provider: per provider, offer and GPU model, with $ per effective "
                                      "TFLOP-hour, interruptions per hour and recovery overhead; node: each "
                                      "training instance (a group's node) per attempt, its seconds and waste")
@click.option("--experiment", default=None, help="only this experiment's jobs")
@click.option("--job", "job_id", default=None, help="only this job")
@click.option("--json", "as_json", is_flag=True)
def cost(by: str, experiment: str | None, job_id: str | None, as_json: bool) -> None:
    """Cost attributed per job, experiment or checkpoint; waste and overhead are their own lines; the
    lines sum to the bill (instances still running are billed when they stop). `--by provider`:
    what each offer's dollars bought in effective compute (docs/cost.md). `--by node`: the
    training instances only, each node of a group on its own line (docs/multi-node.md)."""
    from ..ledger import queries as Q

    ledger = load_settings().ledger()
    df = Q.cost_table(ledger, by, experiment=experiment, job=job_id)
    print_df(df if as_json or by != "provider" else df.round(6), as_json)
    if not as_json:
        purpose = "train" if by == "node" else None
        running = Q.running_instances(ledger, experiment=experiment, job=job_id, purpose=purpose)
        billed = Q.billed_usd(ledger, experiment=experiment, job=job_id, purpose=purpose)
        click.echo(f"total ${float(df['usd'].sum()) if len(df) else 0.0:.6f} = billed ${billed:.6f}"
                   + (f"; {running} instance(s) still running, billed when they stop" if running else ""))


@click.command()
@click.option("--experiment", default=None, help="only this experiment's jobs (default: all)")
@click.option("--last", type=int, default=10, show_default=True, help="the last N finished jobs")
@click.option("--json", "as_json", is_flag=True)
def advise(experiment: str | None, last: int, as_json: bool) -> None:
    """Which offers' share of the work to raise or lower, and what it would have saved on the last N jobs:
    each offer's recorded spot availability replayed with the policy production runs (as `orbit simulate`);
    refused (exit 2) on too little history. docs/cost.md says how to read it."""
    from ..control.advice import advise as make_advice
    from .advise import advice_text

    doc = make_advice(load_settings(), experiment=experiment, last=last)
    click.echo(json.dumps(doc, indent=2, default=str) if as_json else advice_text(doc))


@click.command()
@click.argument("query")
@click.option("--json", "as_json", is_flag=True)
@click.option("--timeout", "timeout_s", type=float, default=None, metavar="SECONDS",
              help="stop the query after this long (default: ORBIT_SQL_TIMEOUT_S, else 60)")
def sql(query: str, as_json: bool, timeout_s: float | None) -> None:
    """Run one read-only SELECT on the ledger (the tables and views of `duckdb ledger.duckdb`).

    Bounded: a timeout, ORBIT_SQL_MEMORY (default 1GiB), a spill of ORBIT_SQL_TEMP_SIZE (4GiB)
    in the ledger's tmp/, a query of ORBIT_SQL_MAX_QUERY_CHARS (65536)."""
    from ..ledger.queries import sql as run_sql

    settings = load_settings()
    limits = settings.sql_limits(timeout_s=timeout_s)  # a bad setting is refused before the ledger opens
    print_df(run_sql(settings.ledger(), query, limits=limits), as_json)

