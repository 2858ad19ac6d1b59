"""Checkpoint stores. Stdlib only (boto3 imported lazily by the S3 store), because this
package travels inside every bundle and runs on rented hosts as well as the control plane."""
from .base import CheckpointManifest, CheckpointStore, checkpoint_dir_name
from .factory import open_store, store_of

__all__ = ["CheckpointStore", "CheckpointManifest", "open_store", "store_of", "checkpoint_dir_name"]
