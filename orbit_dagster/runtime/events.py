"""The event channel from host to control plane: an append-only JSON-lines file.

The control plane reads it from an offset while the run is alive (and after a reconnect,
from where it stopped), so the host never needs the control plane to be up. Each line is
flushed and fsynced: a line is either whole or absent after a crash; a reader ignores a
trailing partial line until it is completed.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"


class EventWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._seq = self._last_seq()

    def _last_seq(self) -> int:
        if not self.path.exists():
            return 0
        seq = 0
        for line in self.path.read_text().splitlines():
            try:
                seq = max(seq, int(json.loads(line).get("seq", 0)))
            except (ValueError, AttributeError):
                continue
        return seq

    def emit(self, type_: str, **fields) -> dict:
        with self._lock:
            self._seq += 1
            event = {"seq": self._seq, "ts": time.time(), "type": type_, **fields}
            line = json.dumps(event, sort_keys=True, default=str) + "\n"
            with open(self.path, "a") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            # The same, readable, in the workload's log (`orbit logs JOB`): metric values shown.
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(event['ts']))}Z {type_} {readable(fields)}",
                  flush=True)
            return event


def _value(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def readable(fields: dict) -> str:
    """`step=18 train/loss=2.31`: nested values (metrics) inline, bulky ones (precheck) left out."""
    parts = []
    for k, v in fields.items():
        if k == "precheck":
            continue
        if isinstance(v, dict):
            parts += [f"{ik}={_value(iv)}" for ik, iv in v.items() if not isinstance(iv, (dict, list))]
        else:
            parts.append(f"{k}={_value(v)}")
    return " ".join(parts)


def parse_events(chunk: str) -> tuple[list[dict], int]:
    """Whole lines of `chunk` as events, and how many characters they used."""
    events, used = [], 0
    for line in chunk.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        used += len(line)
        line = line.strip()
        if line:
            try:
                events.append(json.loads(line))
            except (ValueError, RecursionError):  # garbage, or nested thousands deep: skipped
                continue
    return events, used
