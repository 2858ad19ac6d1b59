"""A store for a uri: `file:///abs/dir` or a plain path -> FsStore; `s3://bucket/prefix` -> S3Store.

Its own module, above the stores: both stores import the protocol and the manifest from
base.py, so a factory there closed an import circle with them. Importing s3.py costs nothing
(boto3 is imported when an S3 store is made).
"""
from __future__ import annotations

from typing import Mapping

from .base import CheckpointStore
from .fs import FsStore, direct_setting
from .s3 import S3Store


def open_store(root_uri: str, *, env: Mapping[str, str] | None = None) -> CheckpointStore:
    """The store rooted at `root_uri`, tuned by `env` (the settings' snapshot, or the host's
    environment): an S3 store's parts (see s3.py), a filesystem store's O_DIRECT (see fs.py)."""
    if root_uri.startswith("s3://"):
        return S3Store(root_uri, env=env)
    return FsStore(root_uri, direct=direct_setting(env))


def store_of(uri: str) -> CheckpointStore:
    """A store that can read, verify and delete the checkpoint at `uri` (any kind)."""
    return open_store(uri)
