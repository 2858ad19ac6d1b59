"""Checkpoints exactly as the code before version-2 manifests wrote them (main at f804083):
a directory (or S3 prefix) of files plus `manifest.json` with each file's whole-file sha256,
no `version` key. Written here with json and hashlib only, never with the code under test,
so a test can hold today's reader to what old homes contain (test_formats.py checks this
writer against text main produced)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def v1_manifest_text(*, job_id: str, step: int, tier: str, files: dict[str, bytes], weights_sha256: str = "",
                     parent: str | None = None, created_at: str = "", attempt: int = 0, meta: dict | None = None) -> str:
    listing = {rel: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)} for rel, data in files.items()}
    h = hashlib.sha256()
    for rel in sorted(listing):
        h.update(f"{rel}\0{listing[rel]['sha256']}\n".encode())
    d = {"job_id": job_id, "step": step, "tier": tier, "files": listing, "weights_sha256": weights_sha256,
         "parent": parent, "created_at": created_at, "attempt": attempt, "meta": meta or {}, "digest": h.hexdigest()}
    return json.dumps(d, sort_keys=True, indent=1)


def write_v1_fs(root: Path, name: str, files: dict[str, bytes], *, job_id: str, **fields) -> str:
    """A version-1 checkpoint in a filesystem store rooted at `root`; its uri."""
    final = root.resolve() / job_id / name
    for rel, data in files.items():
        (final / rel).parent.mkdir(parents=True, exist_ok=True)
        (final / rel).write_bytes(data)
    (final / "manifest.json").write_text(v1_manifest_text(job_id=job_id, files=files, **fields))
    return final.as_uri()


def write_v1_s3(s3, bucket: str, prefix: str, name: str, files: dict[str, bytes], *, job_id: str, **fields) -> str:
    """A version-1 checkpoint in an S3 store (`s3` a boto3 client): files, then the manifest."""
    base = "/".join(p for p in (prefix, job_id, name) if p)
    for rel, data in files.items():
        s3.put_object(Bucket=bucket, Key=f"{base}/{rel}", Body=data)
    s3.put_object(Bucket=bucket, Key=f"{base}/manifest.json", ContentType="application/json",
                  Body=v1_manifest_text(job_id=job_id, files=files, **fields).encode())
    return f"s3://{bucket}/{base}"
