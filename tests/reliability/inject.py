"""Fault injection for the reliability suite: damage files the way crashes and attackers do,
run code in a process of its own so it can be SIGKILLed mid-write, and read the ledger
back independently of the code under test (plain sqlite3) to judge what is left."""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import unquote, urlparse

from tests.conftest import REPO

# ---- files --------------------------------------------------------------------------------

def path_of(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path)) if uri.startswith("file://") else Path(uri)


def flip_byte(path: Path, offset: int | None = None) -> int:
    """Invert one byte (the middle one by default), as a bad disk sector or bit rot would."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    return at


def truncate(path: Path, keep: float = 0.5) -> int:
    """Cut a file to a fraction of its length: a write torn by a crash."""
    size = int(path.stat().st_size * keep)
    with open(path, "r+b") as fh:
        fh.truncate(size)
    return size


def forge_checkpoint(uri: str) -> str:
    """Replace a checkpoint's weights and rewrite its manifest to match them, so that the
    checkpoint verifies against its own manifest: what an attacker with write access to
    the store (or a rented host) can do. Returns the forged manifest's digest."""
    import torch

    from orbit_dagster.runtime.checkpointing import weights_digest
    from orbit_dagster.storage.base import MANIFEST, CheckpointManifest

    d = path_of(uri)
    state = torch.load(d / "state.pt", map_location="cpu", weights_only=True)
    model = state["model"]
    name = sorted(k for k, v in model.items() if torch.is_floating_point(v))[0]
    model[name] = model[name] + 1.0  # other weights: a different model
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    (d / "state.pt").write_bytes(blob)
    manifest = CheckpointManifest.from_json((d / MANIFEST).read_text())
    if manifest.version == 1:
        manifest.files["state.pt"] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    else:  # every part's sha256 recomputed: the forgery verifies against its own manifest
        size = manifest.part_size
        manifest.files["state.pt"] = {"bytes": len(blob), "parts": [hashlib.sha256(blob[i:i + size]).hexdigest()
                                                                     for i in range(0, len(blob), size)]}
    manifest.weights_sha256 = weights_digest(model)
    (d / MANIFEST).write_text(manifest.to_json())
    return manifest.digest


def tiny_state(path: Path, *, step: int = 1, scale: float = 1.0) -> Path:
    """A small weights-only torch state, as a user would export one."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(step)
    torch.save({"model": {"w": torch.randn(4, 4, generator=g) * scale, "b": torch.zeros(4)}, "step": step}, path)
    return path


# ---- processes ----------------------------------------------------------------------------

def spawn(code: str, *args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """Run a Python snippet in a process (and process group) of its own, with the repo on the
    path; `args` arrive as sys.argv[1:]. Its output goes to `log` (a pipe nobody reads would
    fill and block it)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log:
            out.close()


def sigkill(proc: subprocess.Popen) -> int:
    """SIGKILL the process and its group (nothing it started survives unless it left the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait(30)


# ---- the ledger, read independently ---------------------------------------------------------

def sqlite_path(home: Path) -> Path:
    return home / "ledger" / "ledger.sqlite"


def integrity(db: Path) -> str:
    # Read-only: closing a read-write connection would checkpoint the WAL a test inspects.
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        con.close()


def snapshot(db: Path, *, skip: tuple[str, ...] = ()) -> dict[str, list[tuple]]:
    """Every table's rows, sorted: equal snapshots mean nothing in the ledger changed."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: sorted(map(repr, con.execute(f'SELECT * FROM "{t}"'))) for t in tables if t not in skip}
    finally:
        con.close()


def count(db: Path, sql: str, params: tuple = ()) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return int(con.execute(sql, params).fetchone()[0] or 0)
    finally:
        con.close()


def events_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
