"""`orbit`: a front door to the same paths the Dagster UI drives (not a second orchestrator).

User errors print one line on stderr and exit 2, without a traceback; so do a full or
read-only disk and a malformed input. Anything else is an internal error: one line, exit 1,
the traceback in $ORBIT_HOME/logs/cli-errors.log.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..core.errors import OrbitError
from ..core.submission import parse_set_args
from ..settings import Settings


def _settings() -> Settings:
    return Settings.from_env()


def _print_df(df, as_json: bool) -> None:
    if as_json:
        click.echo(df.to_json(orient="records", date_format="iso"))
    elif df.empty:
        click.echo("(no rows)")
    else:
        import pandas as pd

        with pd.option_context("display.max_columns", 50, "display.width", 200, "display.max_colwidth", 60):
            click.echo(df.to_string(index=False))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Post-train and evaluate models on rented and spot GPUs (state in $ORBIT_HOME, default ./.orbit)."""


@cli.command()
@click.argument("template")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="an override the template allows")
@click.option("--experiment", default="default", show_default=True)
@click.option("--project", default="default", show_default=True)
def submit(template: str, sets: tuple[str, ...], experiment: str, project: str) -> None:
    """Freeze TEMPLATE (+ overrides) into a bundle and queue it as a new job."""
    from ..control.submit import submit as do_submit
    from ..core.submission import check_name, check_template_ref

    # Names first, then the overrides: each refusal names its field before anything is read.
    check_template_ref(template)
    check_name("experiment", experiment)
    check_name("project", project)
    job_id = do_submit(_settings(), template, parse_set_args(sets), experiment=experiment, project=project)
    click.echo(job_id)
    click.echo("queued: the daemon's job_queue_sensor launches it (`make ui` or `orbit daemon` runs one)", err=True)


@cli.command()
@click.argument("job")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="an override the template allows")
@click.option("--from-scratch", is_flag=True, help="start from step 0 instead of the newest checkpoint")
def retry(job: str, sets: tuple[str, ...], from_scratch: bool) -> None:
    """Queue a new attempt of JOB (same job id, attempt+1)."""
    from ..control.submit import retry as do_retry
    from ..core.submission import check_job_id

    check_job_id(job)
    attempt = do_retry(_settings(), job, parse_set_args(sets), from_scratch=from_scratch)
    click.echo(f"{job}: attempt {attempt} queued")


@cli.command()
@click.argument("job")
def cancel(job: str) -> None:
    """Cancel JOB now: its workload stopped, its instance released and billed, its Dagster runs CANCELED."""
    from ..control.submit import cancel as do_cancel
    from ..deploy.instance import dagster_instance
    from ..ops.runs import terminate_runs_of

    settings = _settings()
    changed = do_cancel(settings, job)
    with dagster_instance(settings) as instance:
        stopped = terminate_runs_of(instance, job)
    click.echo(f"{job}: {'cancelled' if changed else 'had already ended'}"
               + (f"; {len(stopped)} Dagster run(s) terminated" if stopped else ""))


@cli.command("import-run")
@click.argument("directory")  # a plain string: the importer checks it (click's Path stats it, and a NUL raises)
@click.option("--experiment", default=None)
@click.option("--name", default=None)
def import_run(directory: str, experiment: str | None, name: str | None) -> None:
    """Register a run trained outside the platform, with its checkpoints."""
    from ..control.importer import import_run as do_import

    def bar(items):
        with click.progressbar(items, label="importing checkpoints", file=sys.stderr) as it:
            yield from it

    result = do_import(_settings(), directory, experiment=experiment, name=name, progress=bar)
    _register_partitions(result["checkpoints"])
    if result.get("note"):
        click.echo(f"note: {result['note']}", err=True)
    click.echo(json.dumps(result))


def _register_partitions(keys: list[str]) -> None:
    """Make imported checkpoints partitions of the `checkpoint` asset (runless materialisations)."""
    from ..assets.partitions import add_checkpoint_partitions
    from ..assets.reporting import checkpoint_materialization, registration_checks
    from ..deploy.instance import dagster_instance

    ledger = _settings().ledger()
    with dagster_instance(_settings()) as instance:
        add_checkpoint_partitions(instance, keys)
        for key in keys:
            row = ledger.one("SELECT * FROM checkpoints WHERE checkpoint_key = ?", [key])
            if row is not None:
                instance.report_runless_asset_event(checkpoint_materialization(row))
                for result in registration_checks(row):
                    instance.report_runless_asset_event(result)


@cli.command()
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True)
def status(job: str | None, as_json: bool) -> None:
    """Jobs (imported runs included) and their state; with JOB, its checkpoints too."""
    from ..ledger import queries as Q
    from ..ledger import records as R

    ledger = _settings().ledger()
    if job:
        R.require_job(ledger, job)  # raises the error that names the fix
    _print_df(Q.status(ledger, job), as_json)
    if job and not as_json:
        click.echo("")
        _print_df(Q.checkpoints(ledger, job), False)


@cli.command()
@click.argument("job")
@click.option("--attempt", type=int, default=None, help="default: the latest")
@click.option("--tail", type=int, default=200, show_default=True)
def logs(job: str, attempt: int | None, tail: int) -> None:
    """The workload's log of JOB's attempt (live while it runs, collected after)."""
    from ..control.logs import attempt_log

    click.echo(attempt_log(_settings(), job, attempt, tail))


@cli.command()
@click.argument("experiment")
@click.option("--lineage", default="current", show_default=True,
              help="rank each job's current lineage (default), `all` lineages, or one lineage by id")
@click.option("--json", "as_json", is_flag=True)
def best(experiment: str, lineage: str, as_json: bool) -> None:
    """The best checkpoint of EXPERIMENT by its primary metric, with its lineage (reads only)."""
    from ..control.best import compute_best

    result = compute_best(_settings(), experiment, lineage=lineage)
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


@cli.group()
def ledger() -> None:
    """The ledger's own maintenance."""


@ledger.command("upgrade")
def ledger_upgrade() -> None:
    """Convert this home's Parquet-commit ledger (an older orbit-dagster's) into the current one, once."""
    from ..ledger.legacy import upgrade

    settings = _settings()
    counts = upgrade(settings.ledger_dir, settings.ledger_url)
    click.echo(f"upgraded {settings.ledger_dir}: " + ", ".join(f"{n} {t}" for t, n in counts.items() if n)
               + f"; the old files are in {settings.ledger_dir / 'segments.bak'}")


@ledger.command("check")
@click.option("--json", "as_json", is_flag=True)
def ledger_check(as_json: bool) -> None:
    """Cross-check bundles, checkpoints and the ledger; name every orphan and every missing file.

    Exit 0: consistent; 1: the ledger is sound but disagrees with the disk; 3: the ledger is
    damaged, missing or not this home's. Works (reads only) whatever state the ledger is in."""
    from ..control.ledger_care import check

    report = check(_settings())
    if as_json:
        click.echo(json.dumps(report.as_json(), sort_keys=True, default=str))
    else:  # the summary, then one line per finding (the ledger's own state is in the summary)
        click.echo("\n".join([report.summary, *(f"  {f.kind}: {f.subject}: {f.detail}" for f in report.findings
                                                if f.kind != "ledger")]))
    sys.exit(report.exit_code)


@ledger.command("repair")
def ledger_repair() -> None:
    """Set a damaged or foreign ledger aside (never deleted) and re-register what verifies.

    Exit 0 when the ledger and the disk then agree, 1 when findings remain that it cannot mend."""
    from ..control.ledger_repair import repair

    settings = _settings()

    def no_daemon() -> None:
        from ..deploy.instance import daemon_alive

        if daemon_alive(settings):
            raise OrbitError("a Dagster daemon is running on this home and holds the ledger open; moving the file "
                             "aside under it would lose its writes", field="daemon",
                             fix="stop it (SIGTERM to `orbit daemon` / `orbit ui`, or systemctl stop), then run "
                                 "`orbit ledger repair` again")

    report = repair(settings, before_moving=no_daemon)
    for line in report.lines(settings.ledger().display):
        click.echo(line)
    sys.exit(report.exit_code)


@ledger.command("backup")
@click.argument("dest", required=False, type=click.Path(path_type=Path))
def ledger_backup(dest: Path | None) -> None:
    """A consistent copy of the SQLite ledger, safe while the daemon runs (default: $ORBIT_HOME/backups/)."""
    from ..ledger.backup import backup, default_destination, refuse_postgres

    settings = _settings()
    if not settings.ledger_url.startswith("sqlite"):
        raise refuse_postgres(settings.ledger_url)
    ledger = settings.ledger()  # refused here when damaged or not this home's: a backup of that helps no one
    done = backup(ledger.path, dest or default_destination(settings.home))
    click.echo(done["path"])
    click.echo(f"backed up ledger {done['ledger_id']} ({done['bytes']} bytes, integrity ok); restore: stop the daemon, "
               "copy it back as ledger/ledger.sqlite (docs/deploy.md), run `orbit ledger check`", err=True)


@cli.group()
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

    set_primary_metric(_settings().ledger(), name=name, mode=mode, experiment=experiment, project=project)
    click.echo(f"primary metric of {'experiment ' + experiment if experiment else 'project ' + str(project)}: "
               f"{name} ({mode})")


@cli.command()
@click.option("--by", type=click.Choice(["job", "experiment", "checkpoint"]), default="job", show_default=True)
@click.option("--experiment", default=None, help="only this experiment's jobs")
@click.option("--job", "job_id", default=None, help="only this job")
@click.option("--json", "as_json", is_flag=True)
def cost(by: str, experiment: str | None, job_id: str | None, as_json: bool) -> None:
    """Cost attributed per job, experiment or checkpoint; waste and overhead are their own lines; the
    lines sum to the bill (instances still running are billed when they stop)."""
    from ..ledger import queries as Q

    ledger = _settings().ledger()
    df = Q.cost_table(ledger, by, experiment=experiment, job=job_id)
    _print_df(df, as_json)
    if not as_json:
        running = Q.running_instances(ledger, experiment=experiment, job=job_id)
        billed = Q.billed_usd(ledger, experiment=experiment, job=job_id)
        click.echo(f"total ${float(df['usd'].sum()) if len(df) else 0.0:.6f} = billed ${billed:.6f}"
                   + (f"; {running} instance(s) still running, billed when they stop" if running else ""))


@cli.command()
@click.argument("query")
@click.option("--json", "as_json", is_flag=True)
@click.option("--timeout", "timeout_s", type=float, default=None, metavar="SECONDS",
              help="stop the query after this long (default: ORBIT_SQL_TIMEOUT_S, else 60)")
def sql(query: str, as_json: bool, timeout_s: float | None) -> None:
    """Run one read-only SELECT on the ledger (the tables and views of `duckdb ledger.duckdb`).

    Bounded: a timeout, ORBIT_SQL_MEMORY (default 1GiB), a spill of ORBIT_SQL_TEMP_SIZE (4GiB)
    in the ledger's tmp/, a query of ORBIT_SQL_MAX_QUERY_CHARS (65536)."""
    from ..ledger.queries import sql as run_sql

    settings = _settings()
    limits = settings.sql_limits(timeout_s=timeout_s)  # a bad setting is refused before the ledger opens
    _print_df(run_sql(settings.ledger(), query, limits=limits), as_json)


@cli.command()
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
    from .offers import offers_document, offers_table

    ledger = _settings().ledger()
    doc = offers_document(gpu=gpu, max_price=max_price, gpu_count=gpu_count, observed=observed_reclaims(ledger),
                          measured=measured_tflops(ledger),
                          save_s=measured_save_seconds(ledger) if save_seconds is None else save_seconds,
                          restore_s=restore_seconds, notice_s=notice_seconds)
    click.echo(json.dumps(doc, indent=2) if as_json else offers_table(doc))


@cli.command()
@click.option("--trace", "trace", required=True, type=click.Path(), help="a spot trace file (formats: docs/policies.md)")
@click.option("--policy", default=None, help="notice-only, fixed-30m, young-daly, young-daly-true, hindsight, orbit "
              "(or none); with a deadline: greedy, uniform-progress, orbit, optimal (default: all)")
@click.option("--job-hours", type=float, default=None)
@click.option("--deadline-hours", type=float, default=None)
@click.option("--notice-seconds", type=float, default=None, help="default: the trace's cloud's (AWS 120, GCP 30)")
@click.option("--save-seconds", type=float, default=60.0, show_default=True)
@click.option("--restore-seconds", type=float, default=300.0, show_default=True)
@click.option("--notice-miss-rate", type=float, default=0.0, show_default=True, help="share of notices lost")
@click.option("--starts", type=int, default=8, show_default=True, help="jobs per trace, evenly spaced")
@click.option("--json", "as_json", is_flag=True)
def simulate(trace: str, policy: str | None, job_hours: float | None, deadline_hours: float | None,
             notice_seconds: float | None, save_seconds: float, restore_seconds: float, notice_miss_rate: float,
             starts: int, as_json: bool) -> None:
    """Replay a spot trace through the policies the control plane uses (deterministic)."""
    from .simulate import format_result_table, simulate_command

    result = simulate_command(trace, policy, job_hours, deadline_hours, notice_seconds, save_seconds=save_seconds,
                              restore_seconds=restore_seconds, notice_miss_rate=notice_miss_rate, starts=starts)
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else format_result_table(result))


@cli.command()
def templates() -> None:
    """List the shipped and user templates."""
    from ..core.templates import list_templates

    for name in list_templates(_settings().template_dirs):
        click.echo(name)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last line")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="an override of the example template")
@click.option("--no-reclaims", is_flag=True, help="a market that never reclaims (default: replayed spot trace)")
def demo(as_json: bool, sets: tuple[str, ...], no_reclaims: bool) -> None:
    """Train the example through Dagster on the sim market; evaluate, rank, bill."""
    import signal

    from .demo import run_demo

    # Stopped with SIGTERM, still stop the daemon this command started (the finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = _settings()
    bar = {"obj": None}

    def on_progress(job_id, p) -> None:
        if bar["obj"] is None:
            from tqdm import tqdm

            bar["obj"] = tqdm(total=None, desc=job_id, file=sys.stderr, unit="step", leave=False)
        b = bar["obj"]
        b.n = p.step
        b.set_postfix_str(f"{p.state} attempt={p.attempt} ckpt={p.checkpoints} eval={p.evaluations}")
        b.refresh()

    try:
        result = run_demo(settings, overrides=parse_set_args(sets), reclaims=not no_reclaims, on_progress=on_progress)
    finally:
        if bar["obj"] is not None:
            bar["obj"].close()
    if not as_json:
        from ..ledger import queries as Q

        click.echo(f"job {result['job']} ({result['state']}, {result['attempts']} attempt(s)), experiment {result['experiment']}")
        _print_df(Q.checkpoints(settings.ledger(), result["job"]), False)
        click.echo(f"best checkpoint: {result['best_checkpoint']}  "
                   f"{result['best_metric']['name']} = {result['best_metric']['value']:.4f}" if result["best_metric"] else "best: none")
        click.echo(f"interruptions: {result['interruptions']} (recovered {result['recovered']}), lost steps: "
                   f"{result['lost_steps']}, wasted GPU-seconds: {result['wasted_gpu_seconds']}, "
                   f"final weights bit-identical to an uninterrupted run: {result['bit_identical']}")
        click.echo(f"cost: ${result['cost_usd']:.6f} attributed, ${result['billed_usd']:.6f} billed "
                   f"({result['instance_seconds']:.1f} instance-seconds); ledger: {result['ledger']}")
    click.echo(json.dumps(result, sort_keys=True))
    if result["state"] != "SUCCEEDED":
        sys.exit(1)


@cli.command()
def daemon() -> None:
    """Run the Dagster daemon (sensors, run queue, monitoring) for the active profile, in the foreground.

    One per Dagster home: a second one refuses, naming the first. Starts the code server it
    uses (unless ORBIT_CODE_SERVER names one); its log goes to stdout without colour codes
    or per-tick lines; SIGTERM or Ctrl-C stops it."""
    from ..deploy.serve import run_daemon

    sys.exit(run_daemon(_settings()))


@cli.command()
@click.option("--port", default=3000, show_default=True)
@click.option("--no-daemon", is_flag=True, help="the webserver only (a daemon runs elsewhere, e.g. its own service)")
def ui(port: int, no_daemon: bool) -> None:
    """The Dagster UI on 127.0.0.1 only, with a daemon unless one is running; SIGTERM or Ctrl-C stops both."""
    from ..deploy.serve import run_ui

    sys.exit(run_ui(_settings(), port, no_daemon))


@cli.command("code-server")
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help="serve on this unix socket (default: $ORBIT_CODE_SERVER, else code-server.sock in the Dagster home)")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="serve on this TCP port instead")
@click.option("--host", default=None, help="with --port: 127.0.0.1 (default), localhost or ::1")
def code_server(socket_path: str | None, port: int | None, host: str | None) -> None:
    """Serve orbit's code location (`dagster api grpc`, no heartbeat) in the foreground, for a daemon and
    a UI started with ORBIT_CODE_SERVER pointing at it; SIGTERM or Ctrl-C stops it."""
    from ..deploy.serve import code_server_address, run_code_server

    settings = _settings()
    sys.exit(run_code_server(settings, code_server_address(settings, socket_path, host, port)))


@cli.command()
@click.option("--config", "show_config", is_flag=True, help="print the dagster.yaml the profile would write now")
@click.option("--json", "as_json", is_flag=True)
def profile(show_config: bool, as_json: bool) -> None:
    """The deployment profile in use (ORBIT_PROFILE): Dagster home, storage, ledger, pools, daemon.

    Creates what is missing (the Dagster home, dagster.yaml, the team's databases); never
    rewrites an existing dagster.yaml."""
    from ..deploy.instance import profile as active_profile
    from ..deploy.profiles import render_dagster_yaml
    from ..deploy.report import describe, format_report

    settings = _settings()
    if show_config:
        click.echo(render_dagster_yaml(active_profile(settings)), nl=False)
        return
    report = describe(settings)
    click.echo(json.dumps(report, sort_keys=True) if as_json else format_report(report))


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every failure is one line on stderr and a non-zero exit, never a traceback."""
    try:
        rc = cli.main(args=argv, prog_name="orbit", standalone_mode=False)
    except OrbitError as exc:
        _fail(f"error: {exc}", 2)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except click.ClickException as exc:
        where = getattr(getattr(exc, "ctx", None), "command_path", None) or "orbit"
        _fail(f"error: {_one_line(exc.format_message())}; fix: see `{where} --help`", exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:  # (a reader gone away, `orbit status | head`, is click's: a quiet exit 1)
        from .errors import describe_failure

        line, code = describe_failure(exc, argv if argv is not None else sys.argv[1:])
        _fail(line, code)
    else:
        if isinstance(rc, int) and rc:  # click's Exit(code) under standalone_mode=False
            sys.exit(rc)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(line: str, code: int) -> None:
    click.echo(_one_line(line), err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
