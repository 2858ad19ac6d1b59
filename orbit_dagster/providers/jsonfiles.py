"""Small JSON state files, read tolerantly and written atomically (temp name, then rename).

Stdlib only: the simulated host process imports it too.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_json(path: Path) -> dict | None:
    """The file's object, or None when it is missing or half-written."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.replace(path)
