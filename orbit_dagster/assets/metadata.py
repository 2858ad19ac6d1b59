"""Metadata people read in the UI: tables with a column schema, curves, lineage."""
from __future__ import annotations

import base64
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
        # Dagster plots numeric metadata by partition or by event time, not by step, so the
        # curve is a picture: Markdown with an inline SVG, which the UI renders.
        "train/loss curve": dg.MetadataValue.md(f"![train/loss by step](data:image/svg+xml;base64,{loss_svg(points)})"),
        "train/loss by step": table(points, [("step", "int", "optimiser steps done"),
                                             ("attempt", "int", "the attempt that trained it"),
                                             ("train_loss", "float", "mean training loss since the last point")]),
    }


def loss_svg(points: list[dict], width: int = 480, height: int = 200, pad: int = 32) -> str:
    """A line chart of train_loss against step, one colour per attempt, base64 SVG."""
    steps = [p["step"] for p in points]
    losses = [p["train_loss"] for p in points if math.isfinite(p["train_loss"])] or [0.0]
    x0, x1 = min(steps), max(steps) or 1
    y0, y1 = min(losses), max(losses)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x0 -= 1

    def xy(p: dict) -> str:
        x = pad + (p["step"] - x0) / (x1 - x0) * (width - 2 * pad)
        y = height - pad - (p["train_loss"] - y0) / (y1 - y0) * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    colours = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")
    lines = []
    for i, attempt in enumerate(sorted({p["attempt"] for p in points})):
        mine = [p for p in points if p["attempt"] == attempt and math.isfinite(p["train_loss"])]
        lines.append(f'<polyline fill="none" stroke="{colours[i % len(colours)]}" stroke-width="1.5" '
                     f'points="{" ".join(xy(p) for p in mine)}"><title>attempt {attempt}</title></polyline>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>'
           f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#999"/>'
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#999"/>'
           f'<text x="{pad}" y="{height - 8}">step {x0}</text>'
           f'<text x="{width - pad}" y="{height - 8}" text-anchor="end">{x1}</text>'
           f'<text x="4" y="{pad - 8}">train/loss {y1:.3g}</text>'
           f'<text x="4" y="{height - pad + 12}">{y0:.3g}</text>' + "".join(lines) + "</svg>")
    return base64.b64encode(svg.encode()).decode()


def bars_svg(bars: list[tuple[str, float]], *, unit: str, width: int = 560, bar: int = 18) -> str:
    """A horizontal bar chart (label, value), one bar per row in the given order, base64 SVG."""
    label_w, pad = 250, 8
    height = pad * 2 + bar * max(len(bars), 1) + 16
    top = max((v for _, v in bars if math.isfinite(v)), default=0.0) or 1.0
    scale = (width - label_w - 2 * pad - 70) / top
    parts = []
    for i, (label, value) in enumerate(bars):
        y = pad + i * bar
        w = value * scale if math.isfinite(value) else 0.0
        shown = label if len(label) <= 38 else label[:37] + "…"
        parts.append(f'<text x="{label_w - 4}" y="{y + bar - 5}" text-anchor="end">{_xml(shown)}</text>'
                     f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{bar - 4}" fill="#2563eb">'
                     f'<title>{_xml(label)}: {value:.6g} {_xml(unit)}</title></rect>'
                     f'<text x="{label_w + w + 4:.1f}" y="{y + bar - 5}">{value:.4g}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>' + "".join(parts)
           + f'<text x="{label_w}" y="{height - 4}">{_xml(unit)}</text></svg>')
    return base64.b64encode(svg.encode()).decode()


def _xml(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
