"""`orbit ledger ...`: the ledger's own maintenance (upgrade, check, repair, backup).

Each command imports the layers it drives inside its body: `orbit --help` and every command
then load only their own path (importing all of them at start-up takes 3.3 s instead of 1.2 s).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..core.errors import OrbitError
from .common import load_settings


@click.group()
def ledger() -> None:
    """The ledger's own maintenance."""


@ledger.command("upgrade")
def ledger_upgrade() -> None:
    """Convert this home's Parquet-commit ledger (an older orbit-dagster's) into the current one, once."""
    from ..ledger.legacy import upgrade

    settings = load_settings()
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

    report = check(load_settings())
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

    settings = load_settings()

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

    settings = load_settings()
    if not settings.ledger_url.startswith("sqlite"):
        raise refuse_postgres(settings.ledger_url)
    ledger = settings.ledger()  # refused here when damaged or not this home's: a backup of that helps no one
    done = backup(ledger.path, dest or default_destination(settings.home))
    click.echo(done["path"])
    click.echo(f"backed up ledger {done['ledger_id']} ({done['bytes']} bytes, integrity ok); restore: stop the daemon, "
               "copy it back as ledger/ledger.sqlite (docs/deploy.md), run `orbit ledger check`", err=True)

