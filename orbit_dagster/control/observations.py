"""What the ledger has observed about offers: reclaim rates and measured TFLOPS."""
from __future__ import annotations

import json

from ..ledger import Ledger


def observed_reclaims(ledger: Ledger) -> dict[str, tuple[int, float]]:
    """offer_id -> (reclaims, exposure hours) over every instance the ledger has billed."""
    rows = ledger.rows(
        """SELECT u.offer_id,
                  count(*) FILTER (WHERE r.state = 'LOST') AS reclaims,
                  sum(u.seconds) / 3600.0 AS hours
           FROM instance_usage u LEFT JOIN run_status r ON r.instance_id = u.instance_id
           WHERE u.spot GROUP BY u.offer_id"""
    )
    return {r["offer_id"]: (int(r["reclaims"]), float(r["hours"] or 0.0)) for r in rows if r["offer_id"]}


def measured_tflops(ledger: Ledger) -> dict[str, float]:
    """offer_id -> the newest effective TFLOPS per GPU measured by the agent's probe."""
    rows = ledger.rows(
        """SELECT i.offer_id, e.detail FROM events e JOIN instances i USING (instance_id)
           WHERE e.kind = 'host_probe' ORDER BY e.ts"""
    )
    out: dict[str, float] = {}
    for r in rows:
        probe = json.loads(r["detail"] or "{}")
        # Only a GPU's figure stands for a GPU offer: a simulated host (a CPU) is measured
        # and recorded, but never ranks an offer by its CPU's speed.
        if probe.get("tflops") and probe.get("device", "cpu") != "cpu":
            out[r["offer_id"]] = float(probe["tflops"]) / max(int(probe.get("gpus", 1) or 1), 1)
    return out


DEFAULT_STEP_S = 0.2


def measured_step_seconds(ledger: Ledger, template: str | None = None) -> float:
    """Median seconds per training step of this template's recent runs (a prior when none).

    From consecutive training metric points of one run: (Δtime / Δstep)."""
    rows = ledger.rows(
        """WITH m AS (
               SELECT m.run_id, m.step, epoch(m.ts) AS t FROM metric_points m JOIN jobs j USING (job_id)
               WHERE m.source = 'train' AND m.name = 'train/loss' AND (? IS NULL OR j.template = ?)
           ), d AS (
               SELECT (t - lag(t) OVER w) / nullif(step - lag(step) OVER w, 0) AS s FROM m
               WINDOW w AS (PARTITION BY run_id ORDER BY step)
           )
           SELECT median(s) AS s FROM d WHERE s > 0""",
        [template, template],
    )
    value = rows[0]["s"] if rows else None
    return float(value) if value else DEFAULT_STEP_S


def probed_offers(ledger: Ledger) -> set[str]:
    """Offers on which the agent's TFLOPS probe has already run."""
    return {r["offer_id"] for r in ledger.rows(
        "SELECT DISTINCT i.offer_id FROM events e JOIN instances i USING (instance_id) WHERE e.kind = 'host_probe'")}
