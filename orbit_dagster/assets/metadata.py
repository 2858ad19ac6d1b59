"""Metadata people read in the UI: tables with a column schema, curves, lineage."""
from __future__ import annotations

import math

import dagster as dg

MAX_CURVE_POINTS = 400  # a table row per point; a long run is thinned evenly


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> dg.MetadataValue:
    """A TableMetadataValue: `columns` are (name, type, description); NaN/None shown empty."""
    schema = dg.TableSchema(columns=[dg.TableColumn(name, type_, description=desc) for name, type_, desc in columns])
    records = []
    for row in rows:
        clean = {}
        for name, _, _ in columns:
            v = row.get(name)
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            clean[name] = v
        records.append(dg.TableRecord(clean))
    return dg.MetadataValue.table(records=records, schema=schema)


def loss_curve(ledger, job_id: str) -> dict[str, dg.MetadataValue]:
    """The job's training loss by step, every attempt, as a table (thinned to MAX_CURVE_POINTS)."""
    rows = ledger.rows(
        """SELECT m.step, r.attempt, m.value FROM metric_points m JOIN runs r ON r.run_id = m.run_id
           WHERE m.job_id = ? AND m.source = 'train' AND m.name = 'train/loss' ORDER BY r.attempt, m.step""", [job_id])
    if not rows:
        return {}
    stride = max(1, math.ceil(len(rows) / MAX_CURVE_POINTS))
    kept = rows[::stride] + ([rows[-1]] if (len(rows) - 1) % stride else [])
    points = [{"step": int(r["step"]), "attempt": int(r["attempt"]), "train_loss": float(r["value"])} for r in kept]
    return {
        "train/loss": dg.MetadataValue.float(points[-1]["train_loss"]),
        "train/loss by step": table(points, [("step", "int", "optimiser steps done"),
                                             ("attempt", "int", "the attempt that trained it"),
                                             ("train_loss", "float", "mean training loss since the last point")]),
    }
