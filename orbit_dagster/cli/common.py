"""What every command module of the CLI shares: the settings, and how a table is printed."""
from __future__ import annotations

import click

from ..settings import Settings


def load_settings() -> Settings:
    return Settings.from_env()


def print_df(df, as_json: bool) -> None:
    if as_json:
        click.echo(df.to_json(orient="records", date_format="iso"))
    elif df.empty:
        click.echo("(no rows)")
    else:
        import pandas as pd

        with pd.option_context("display.max_columns", 50, "display.width", 200, "display.max_colwidth", 60):
            click.echo(df.to_string(index=False))

