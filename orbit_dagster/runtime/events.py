"""The event channel from host to control plane: an append-only JSON-lines file.

Each line is a record of the host contract (orbit_dagster/core/host_contract.py: the
kinds, their fields, the contract version), encoded by it. The control plane reads the
file from an offset while the run is alive (and after a reconnect, from where it
stopped), so the host never needs the control plane to be up. Each line is flushed and
fsynced: a line is either whole or absent after a crash; a reader leaves a trailing
partial line until it is completed.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ..core.host_contract import EVENTS_FILE, HostEvent, encode, fields_of, stamp

__all__ = ["EVENTS_FILE", "EventWriter", "readable"]


class EventWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._seq = self._last_seq()

    def _last_seq(self) -> int:
        """The last line's number (a restarted agent continues the file's numbering)."""
        if not self.path.exists():
            return 0
        seq = 0
        for line in self.path.read_bytes().splitlines():
            try:
                seq = max(seq, int(json.loads(line).get("seq", 0)))
            except (ValueError, TypeError, AttributeError, RecursionError, OverflowError):
                continue
        return seq

    def emit(self, event: HostEvent) -> HostEvent:
        """Append one record (numbered and timed here); returns it as written."""
        with self._lock:
            self._seq += 1
            event = stamp(event, seq=self._seq, ts=time.time())
            line = encode(event)
            with open(self.path, "a") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            # The same, readable, in the workload's log (`orbit logs JOB`): metric values shown.
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(event.ts))}Z {event.KIND} "
                  f"{readable(fields_of(event))}", flush=True)
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
