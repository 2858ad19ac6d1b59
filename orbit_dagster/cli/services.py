"""The services: the demo, the daemon, the UI, the code server, the deployment profile.

Each command imports the layers it drives inside its body: `orbit --help` and every command
then load only their own path (importing all of them at start-up takes 3.3 s instead of 1.2 s).
"""
from __future__ import annotations

import json
import sys

import click

from ..core.submission import parse_set_args
from .common import load_settings, print_df


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last line")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="an override of the example template")
@click.option("--no-reclaims", is_flag=True, help="a market that never reclaims (default: replayed spot trace)")
def demo(as_json: bool, sets: tuple[str, ...], no_reclaims: bool) -> None:
    """Train the example through Dagster on the sim market; evaluate, rank, bill."""
    import signal

    from .demo import run_demo

    # Stopped with SIGTERM, still stop the daemon this command started (the finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = load_settings()
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
        print_df(Q.checkpoints(settings.ledger(), result["job"]), False)
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


@click.command()
def daemon() -> None:
    """Run the Dagster daemon (sensors, run queue, monitoring) for the active profile, in the foreground.

    One per Dagster home: a second one refuses, naming the first. Starts the code server it
    uses (unless ORBIT_CODE_SERVER names one); its log goes to stdout without colour codes
    or per-tick lines; SIGTERM or Ctrl-C stops it."""
    from ..deploy.serve import run_daemon

    sys.exit(run_daemon(load_settings()))


@click.command()
@click.option("--port", default=3000, show_default=True)
@click.option("--no-daemon", is_flag=True, help="the webserver only (a daemon runs elsewhere, e.g. its own service)")
def ui(port: int, no_daemon: bool) -> None:
    """The Dagster UI on 127.0.0.1 only, with a daemon unless one is running; SIGTERM or Ctrl-C stops both."""
    from ..deploy.serve import run_ui

    sys.exit(run_ui(load_settings(), port, no_daemon))


@click.command("code-server")
@click.option("--socket", "socket_path", default=None, metavar="PATH",
              help="serve on this unix socket (default: $ORBIT_CODE_SERVER, else code-server.sock in the Dagster home)")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="serve on this TCP port instead")
@click.option("--host", default=None, help="with --port: 127.0.0.1 (default), localhost or ::1")
def code_server(socket_path: str | None, port: int | None, host: str | None) -> None:
    """Serve orbit's code location (`dagster api grpc`, no heartbeat) in the foreground, for a daemon and
    a UI started with ORBIT_CODE_SERVER pointing at it; SIGTERM or Ctrl-C stops it."""
    from ..deploy.serve import code_server_address, run_code_server

    settings = load_settings()
    sys.exit(run_code_server(settings, code_server_address(settings, socket_path, host, port)))


@click.command()
@click.option("--config", "show_config", is_flag=True, help="print the dagster.yaml the profile would write now")
@click.option("--json", "as_json", is_flag=True)
def profile(show_config: bool, as_json: bool) -> None:
    """The deployment profile in use (ORBIT_PROFILE): Dagster home, storage, ledger, pools, daemon.

    Creates what is missing (the Dagster home, dagster.yaml, the team's databases); never
    rewrites an existing dagster.yaml."""
    from ..deploy.instance import profile as active_profile
    from ..deploy.profiles import render_dagster_yaml
    from ..deploy.report import describe, format_report

    settings = load_settings()
    if show_config:
        click.echo(render_dagster_yaml(active_profile(settings)), nl=False)
        return
    report = describe(settings)
    click.echo(json.dumps(report, sort_keys=True) if as_json else format_report(report))

