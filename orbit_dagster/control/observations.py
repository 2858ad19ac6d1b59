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
        tflops = json.loads(r["detail"] or "{}").get("tflops")
        if tflops:
            out[r["offer_id"]] = float(tflops)
    return out
