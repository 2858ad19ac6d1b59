"""Offer catalog: GPU specs, provider price tables, reliability.

Pure code: reads the derived tables shipped in `orbit_dagster/data/` (rebuilt by
`python -m orbit_dagster.catalog.build_data SHARED_DATA_DIR`) and never imports Dagster,
boto3 or paramiko. Submodules: `gpus` (names, specs), `gce` and `aws` (provider tables),
`listing` (assembly, filters, diffs, JSON rows). Ranking offers is dispatch's
(`control.placement.rank_placement`); printing them is the CLI's (`cli/offers.py`).
"""
from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from orbit_dagster.core.errors import OrbitError

#: Reclaim notice per provider, in seconds: AWS's instance-action warning, GCE's preemption
#: notice. The one copy (the trace market's clouds, the sim market and `orbit offers` read it).
PROVIDER_NOTICE_S = {"aws": 120.0, "gce": 30.0}


class CatalogError(OrbitError):
    """Catalog data or a catalog query is wrong: names the field, the value and the fix."""


def shipped_file(name: str) -> Path:
    """Path of a derived table shipped in `orbit_dagster/data/`; a clear error when it is missing."""
    path = Path(str(resources.files("orbit_dagster") / "data" / name))
    if not path.is_file():
        raise CatalogError(
            f"shipped catalog table {name!r} is missing from orbit_dagster/data",
            field="data file", value=name,
            fix="rebuild it: python -m orbit_dagster.catalog.build_data SHARED_DATA_DIR",
        )
    return path


def as_utc(at: datetime | None) -> datetime | None:
    """Aware UTC time; a naive datetime is taken as UTC, like every time in the catalog."""
    if at is None:
        return None
    return at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at.astimezone(timezone.utc)


_DECIMAL = re.compile(r"^\s*\d+(\.\d*)?([eE][+-]?\d+)?\s*$")


def price(value: object, *, where: str, field: str = "price") -> float:
    """A price from a file or an API: a finite, non-negative decimal number, else a CatalogError
    naming where. ('nan', 'inf', '-1', '1_0' and the like are refused, not read as prices.)"""
    text = str(value)
    if isinstance(value, bool) or not _DECIMAL.match(text):
        raise CatalogError(f"{where}: {field} {text[:40]!r} is not a price", field=field, value=text[:40],
                           fix="a non-negative decimal number of dollars, e.g. 0.9180")
    usd = float(text)
    if not math.isfinite(usd):
        raise CatalogError(f"{where}: {field} {text[:40]!r} is out of range", field=field, value=text[:40],
                           fix="a finite number of dollars")
    return usd
