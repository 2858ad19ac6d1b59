"""Turning ledger rows into Dagster events (materialisations of other assets, logs)."""
from __future__ import annotations

import dagster as dg

from .partitions import CHECKPOINTS

CHECKPOINT_KEY = dg.AssetKey("checkpoint")


def checkpoint_materialization(row: dict) -> dg.AssetMaterialization:
    metadata = {
        "job": row["job_id"],
        "step": int(row["step"]),
        "attempt": int(row["attempt"] or 0),
        "tier": row["tier"],
        "bytes": dg.MetadataValue.int(int(row["bytes"])),
        "sha256": row["sha256"],
        "weights_sha256": row.get("weights_sha256") or "",
        "train/loss": dg.MetadataValue.float(float(row["train_loss"])) if row.get("train_loss") is not None else None,
        "parent": row.get("parent_key") or "",
        "uri": dg.MetadataValue.path(row["uri"]),
    }
    return dg.AssetMaterialization(
        asset_key=CHECKPOINT_KEY,
        partition=row["checkpoint_key"],
        description=f"{row['tier']} checkpoint of {row['job_id']} at step {row['step']}",
        metadata={k: v for k, v in metadata.items() if v is not None},
    )


class DagsterReporter:
    """The control plane's Reporter, inside a Dagster run."""

    def __init__(self, context: dg.AssetExecutionContext):
        self.context = context

    def checkpoints(self, rows: list[dict]) -> None:
        if not rows:
            return
        # One call for the whole batch: per-key adds are ~700x slower on a sqlite instance.
        self.context.instance.add_dynamic_partitions(CHECKPOINTS, [r["checkpoint_key"] for r in rows])
        for row in rows:
            self.context.log_event(checkpoint_materialization(row))

    def log(self, message: str) -> None:
        self.context.log.info(message)
