"""What the ledger has observed about offers: reclaim rates and measured TFLOPS."""
from __future__ import annotations

import json
import statistics

from ..ledger import Ledger


def observed_reclaims(ledger: Ledger) -> dict[str, tuple[int, float]]:
    """offer_id -> (reclaims, exposure hours) over every instance the ledger has billed."""
    rows = ledger.rows(
        """SELECT u.offer_id,
                  sum(CASE WHEN r.state = 'LOST' AND coalesce(r.failure_class, '') <> 'migration' THEN 1 ELSE 0 END)
                      AS reclaims,
                  sum(u.seconds) / 3600.0 AS hours
           FROM instance_usage u LEFT JOIN runs r ON r.instance_id = u.instance_id
           WHERE u.spot = 1 GROUP BY u.offer_id"""
    )
    return {r["offer_id"]: (int(r["reclaims"]), float(r["hours"] or 0.0)) for r in rows if r["offer_id"]}


def measured_tflops(ledger: Ledger) -> dict[str, float]:
    """offer_id -> the newest effective TFLOPS per GPU measured by the agent's probe."""
    rows = ledger.rows(
        """SELECT i.offer_id, e.detail FROM events e JOIN instances i ON i.instance_id = e.instance_id
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


def measured_step_seconds(ledger: Ledger, template: str | None = None, scale: float = 1.0) -> float:
    """Median seconds per training step of this template's recent runs (a prior when none), in
    the market's seconds: the measurement (wall clock) times `scale` (`market_clock.time_scale`).

    From consecutive training metric points of one run: (Δtime / Δstep)."""
    # The newest runs of the template only: the answer must not cost more as history grows.
    rows = ledger.rows(
        """WITH recent AS (
               SELECT r.run_id FROM runs r JOIN jobs j ON j.job_id = r.job_id
               WHERE r.imported = 0 AND (? IS NULL OR j.template = ?) ORDER BY r.started_at DESC LIMIT 20
           ), m AS (
               SELECT m.run_id, m.step, m.ts AS t FROM metric_points m JOIN recent ON recent.run_id = m.run_id
               WHERE m.source = 'train' AND m.name = 'train/loss'
           )
           SELECT (t - lag(t) OVER (PARTITION BY run_id ORDER BY step))
                  / (step - lag(step) OVER (PARTITION BY run_id ORDER BY step)) AS s FROM m""",
        [template, template],
    )
    values = [float(r["s"]) for r in rows if r["s"] is not None and r["s"] > 0]
    return statistics.median(values) * scale if values else DEFAULT_STEP_S


def probed_offers(ledger: Ledger) -> set[str]:
    """Offers on which the agent's TFLOPS probe has already run."""
    return {r["offer_id"] for r in ledger.rows(
        """SELECT DISTINCT i.offer_id FROM events e JOIN instances i ON i.instance_id = e.instance_id
           WHERE e.kind = 'host_probe'""")}
