"""Where a workload's files are: a shipped workload (`orbit_dagster/workloads/<name>`) or a directory.

Its own module because both the bundle (which copies the files) and the config schema (which
reads `config.py` among them) look a workload up, and the bundle imports the templates, which
import the config schema: kept in the bundle, the lookup closed an import circle.
"""
from __future__ import annotations

from importlib import resources as importlib_resources
from pathlib import Path

from .errors import TemplateError


def workload_dir(workload: str) -> Path:
    shipped = Path(str(importlib_resources.files("orbit_dagster") / "workloads" / workload))
    if shipped.is_dir():
        return shipped
    path = Path(workload).expanduser()
    if path.is_dir():
        return path.resolve()
    raise TemplateError(
        f"workload {workload!r} is neither a shipped workload nor a directory",
        field="workload",
        value=workload,
        fix="name a directory holding the entrypoint script",
    )
