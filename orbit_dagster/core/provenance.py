"""Dependency provenance frozen into every bundle: interpreter, packages, workload git state."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

TRACKED_PACKAGES = ("torch", "numpy", "orbit-dagster", "dagster", "dagster-pipes", "duckdb", "pydantic")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(path: Path) -> dict:
    """Commit and dirty flag of the git work tree holding `path` (None when not in git)."""
    path = Path(path).resolve()
    commit = _git(["rev-parse", "HEAD"], path)
    if commit is None:
        return {"commit": None, "dirty": None, "path": None}
    status = _git(["status", "--porcelain", "--", "."], path)
    top = _git(["rev-parse", "--show-toplevel"], path)
    rel = str(path.relative_to(top)) if top else None
    return {"commit": commit, "dirty": bool(status), "path": rel}


def collect(workload_dir: Path) -> dict:
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "packages": {name: _version(name) for name in TRACKED_PACKAGES},
        "workload_git": git_state(workload_dir),
    }
