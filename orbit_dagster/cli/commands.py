"""`orbit`: a front door to the same paths the Dagster UI drives (not a second orchestrator).

User errors print one line on stderr and exit 2, without a traceback; so do a full or
read-only disk and a malformed input. Anything else is an internal error: one line, exit 1,
the traceback in $ORBIT_HOME/logs/cli-errors.log.
"""
from __future__ import annotations

import sys

import click

from ..core.errors import OrbitError
from . import jobs, maintenance, market, results, services


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Post-train and evaluate models on rented and spot GPUs (state in $ORBIT_HOME, default ./.orbit)."""


# One module per group of commands (cli/jobs.py, results.py, maintenance.py, market.py, services.py).
for _command in (jobs.submit, jobs.retry, jobs.cancel, jobs.import_run, jobs.status, jobs.logs, jobs.templates,
                 results.best, results.export, results.metric, results.cost, results.advise, results.sql, maintenance.ledger,
                 market.offers, market.simulate, market.sim, services.demo, services.daemon, services.ui,
                 services.code_server, services.profile):
    cli.add_command(_command)


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
