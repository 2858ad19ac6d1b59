"""Checkpoint retention: keep the latest K, the best M by the primary metric, and every
emergency checkpoint until a newer durable one supersedes it; delete the rest.

Only evaluated checkpoints can lose their place (an unevaluated one has not been ranked
yet). Deletion drops the files first and records the deletion in the ledger; files that
are already gone are not an error.
"""
from __future__ import annotations

import json

from ..core.bundle import JobBundle
from ..ledger import records as R
from ..ledger import rollups, utcnow
from ..settings import Settings
from ..storage import store_of
from .best import primary_metric_for


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
    """Delete the job's checkpoints the policy does not keep; returns the keys deleted.

    Only the job's current lineage is pruned by rank; checkpoints of superseded lineages are
    kept while they are the only ones (a person may still rank them explicitly)."""
    ledger = settings.ledger()
    bundle = ledger.one("SELECT path FROM bundles WHERE job_id = ? ORDER BY attempt DESC LIMIT 1", [job_id])
    job = R.job(ledger, job_id)
    if bundle is None or job is None:
        return []  # an imported run: its owner decides
    policy = JobBundle.load(bundle["path"], verify=False).spec.template.checkpoint
    pm = primary_metric_for(ledger, job["experiment"])
    rows = ledger.rows(
        """SELECT c.checkpoint_key, c.step, c.tier, c.uri, c.parent_key,
                  (SELECT m.value FROM metric_points m WHERE m.checkpoint_key = c.checkpoint_key AND m.source = 'eval'
                   AND m.name = ? ORDER BY m.ts DESC LIMIT 1) AS value,
                  (SELECT count(*) FROM evaluations e WHERE e.checkpoint_key = c.checkpoint_key
                   AND e.state IN ('PENDING', 'RUNNING')) AS pending
           FROM checkpoints c WHERE c.job_id = ? AND c.deleted_at IS NULL AND c.lineage = ?""",
        [pm.name, job_id, job["lineage"]],
    )
    # A checkpoint still waiting for (or being) evaluated is not ranked yet: plan() keeps it.
    for r in rows:
        if r["pending"]:
            r["value"] = None
    keep, delete = plan(rows, keep_latest=policy.keep_latest, keep_best=policy.keep_best, mode=pm.mode)
    if not delete:
        return []
    uris = {r["checkpoint_key"]: r["uri"] for r in rows}
    gone = []
    for key in sorted(delete):
        existed = store_of(uris[key]).delete(uris[key])
        with ledger.write() as tx:  # one by one: a crash half-way leaves the ledger true to the store
            tx.execute("UPDATE checkpoints SET deleted_at = ?, deleted_reason = ? WHERE checkpoint_key = ? "
                       "AND deleted_at IS NULL",
                       [utcnow(), "retention" + ("" if existed else " (files already gone)"), key])
            rollups.checkpoint_deleted(tx, key)
        gone.append(key)
    ledger.commit({"events": [R.event("retention", job_id=job_id, deleted=gone, kept=sorted(keep),
                                      policy=json.loads(policy.model_dump_json()))]})
    return gone
