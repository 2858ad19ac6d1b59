"""Turning ledger rows into Dagster events: checkpoint materialisations, check results, logs."""
from __future__ import annotations

import dagster as dg

from .partitions import add_checkpoint_partitions, partition_of

CHECKPOINT_KEY = dg.AssetKey("checkpoint")
EVALUATION_KEY = dg.AssetKey("evaluation")


def checkpoint_materialization(row: dict) -> dg.AssetMaterialization:
    metadata = {
        "job": row["job_id"],
        "step": int(row["step"]),
        "attempt": int(row["attempt"] or 0),
        "lineage": row.get("lineage") or "",
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
        partition=partition_of(row["checkpoint_key"]),
        description=f"{row['tier']} checkpoint of {row['job_id']} at step {row['step']} (attempt {row['attempt']})",
        metadata={k: v for k, v in metadata.items() if v is not None},
    )


def check_result(asset: dg.AssetKey, name: str, checkpoint_key: str, passed: bool, **metadata) -> dg.AssetCheckEvaluation:
    """One partition's result of a check, as an event any run (or none) can report."""
    return dg.AssetCheckEvaluation(asset_key=asset, check_name=name, passed=passed, partition=partition_of(checkpoint_key),
                                   metadata={k: v for k, v in metadata.items() if v is not None},
                                   severity=dg.AssetCheckSeverity.ERROR)


def registration_checks(row: dict) -> list[dg.AssetCheckEvaluation]:
    """What registration verified: the bytes match the sha256 the ledger recorded, and it is live."""
    key = row["checkpoint_key"]
    return [check_result(CHECKPOINT_KEY, "checkpoint_integrity", key, True, sha256=row["sha256"],
                         detail="verified against its manifest when it was registered"),
            check_result(CHECKPOINT_KEY, "checkpoint_present", key, True, detail="registered, not deleted")]


class DagsterReporter:
    """The control plane's Reporter, inside a Dagster run."""

    def __init__(self, context):
        self.context = context

    def checkpoints(self, rows: list[dict]) -> None:
        if not rows:
            return
        add_checkpoint_partitions(self.context.instance, [r["checkpoint_key"] for r in rows])
        for row in rows:
            self.context.log_event(checkpoint_materialization(row))
            for result in registration_checks(row):
                self.context.log_event(result)

    def log(self, message: str) -> None:
        self.context.log.info(message)
