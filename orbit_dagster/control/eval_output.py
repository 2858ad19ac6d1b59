"""What an evaluation may report: a non-empty mapping of metric names to finite numbers."""
from __future__ import annotations

import math

from ..core.errors import OrbitError


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        return False


def valid_metrics(metrics: object) -> dict[str, float]:
    """An evaluation's output: a non-empty mapping of metric names to finite numbers."""
    if not isinstance(metrics, dict) or not metrics:
        raise OrbitError(f"the evaluation reported {type(metrics).__name__} {str(metrics)[:80]!r}, not metrics",
                         field="metrics", fix="the eval script reports {\"metrics\": {\"name\": number, ...}}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise OrbitError(f"metric name {str(name)[:80]!r} is not valid", field="metrics", value=str(name)[:80],
                             fix="names are non-empty strings of at most 200 characters")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise OrbitError(f"metric {name!r} = {str(value)[:80]!r} is not a finite number", field=f"metrics.{name}",
                             value=str(value)[:80], fix="report finite numbers only")
        out[name] = float(value)
    return out
