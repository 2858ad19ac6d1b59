"""Checkpoint retention: keep the latest K, the best M by the primary metric, and every
emergency checkpoint until a newer durable one supersedes it; delete the rest.

Only evaluated checkpoints can lose their place (an unevaluated one has not been ranked
yet). Deletion drops the files first and records the deletion in the ledger; files that
are already gone are not an error.
"""
from __future__ import annotations

import json

from ..core.bundle import JobBundle
from ..ledger import utcnow
from ..ledger import records as R
from ..storage import store_of
from .best import primary_metric_for
from .settings import Settings


def plan(checkpoints: list[dict], *, keep_latest: int, keep_best: int, mode: str) -> tuple[set[str], set[str]]:
    """(keep, delete) for one job's live checkpoints; each row: key, step, tier, value (or None)."""
    by_step = sorted(checkpoints, key=lambda c: c["step"])
    keep = {c["checkpoint_key"] for c in by_step[-keep_latest:]} if keep_latest else set()
    ranked = sorted((c for c in by_step if c["value"] is not None),
                    key=lambda c: (c["value"] if mode == "min" else -c["value"], c["step"]))
    keep |= {c["checkpoint_key"] for c in ranked[:keep_best]}
    newest_durable = max((c["step"] for c in by_step if c["tier"] == "durable"), default=-1)
    keep |= {c["checkpoint_key"] for c in by_step if c["tier"] == "emergency" and c["step"] > newest_durable}
    keep |= {c["checkpoint_key"] for c in by_step if c["value"] is None}  # not ranked yet
    # An emergency checkpoint may be a delta against its parent: a kept one keeps its parent.
    keep |= {c.get("parent_key") for c in by_step if c["tier"] == "emergency" and c["checkpoint_key"] in keep} - {None}
    return keep, {c["checkpoint_key"] for c in by_step} - keep


def apply_retention(settings: Settings, job_id: str) -> list[str]:
    ledger = settings.ledger()
    bundles = ledger.rows("SELECT path FROM bundles WHERE job_id = ? ORDER BY attempt DESC LIMIT 1", [job_id])
    if not bundles:
        return []  # an imported run: its owner decides
    policy = JobBundle.load(bundles[0]["path"], verify=False).spec.template.checkpoint
    owner = ledger.rows("SELECT experiment FROM owners WHERE job_id = ?", [job_id])
    pm = primary_metric_for(ledger, owner[0]["experiment"])
    rows = ledger.rows(
        """SELECT c.checkpoint_key, c.step, c.tier, c.uri, c.parent_key,
                  TRY_CAST(json_extract_string(e.metrics, '$."' || ? || '"') AS DOUBLE) AS value
           FROM live_checkpoints c LEFT JOIN evaluations e USING (checkpoint_key) WHERE c.job_id = ?""",
        [pm.name, job_id],
    )
    keep, delete = plan(rows, keep_latest=policy.keep_latest, keep_best=policy.keep_best, mode=pm.mode)
    if not delete:
        return []
    uris = {r["checkpoint_key"]: r["uri"] for r in rows}
    deletions, gone = [], []
    for key in sorted(delete):
        existed = store_of(uris[key]).delete(uris[key])
        deletions.append({"checkpoint_key": key, "reason": "retention" + ("" if existed else " (files already gone)"),
                          "ts": utcnow()})
        gone.append(key)
    ledger.commit({"checkpoint_deletions": deletions,
                   "events": [R.event("retention", job_id=job_id, deleted=gone, kept=sorted(keep),
                                      policy=json.loads(policy.model_dump_json()))]})
    return gone
