"""Hand-off: a training run launches its attempt, then hands following to the daemon.

With `ORBIT_FOLLOW=daemon` (the team profile's default) no Dagster run, and no run worker
process, is held while a GPU trains. The run that launches an attempt reads the events
written so far, records in the attempt's ledger row where it stopped (`follow_offset`, the
last step seen and when: billing needs them for the wasted compute of a reclaim) and when
it handed off, and ends. From then on the interruption sensor watches the attempt at each
tick, as it watches every attempt no run follows: it asks the host for its status and, here,
reads the new lines of the attempt's event stream (`Watch`). It requests a short
`training_run` run, a re-attach, when:
- the workload has ended or its host is lost: that run closes the attempt exactly as a run
  following it would have (artifacts, release and bill, recovery or the next attempt);
- the workload wrote a checkpoint: that run copies and verifies it, registers it (its
  evaluation follows) and hands the attempt back;
- `follow_every_s` passed since the last run: the metrics reach the ledger.
A following run and a re-attach share `attempt.run_attempt`; the notice a reclaim gives is
acted on by the runtime agent on the host either way (its emergency checkpoint).
"""
from __future__ import annotations

import threading
import time

from ..core.errors import ProviderError
from ..ledger import Ledger

# Lines of an event stream that make a run worth starting before `follow_every_s`.
WAKING_EVENTS = {"checkpoint", "exit"}


def hand_off(ledger: Ledger, run_id: str, *, offset: int, last_step: int | None,
             last_progress: float | None) -> bool:
    """Record that no run follows this attempt from now on; False if it is no longer RUNNING."""
    with ledger.write() as tx:
        moved = tx.execute(
            "UPDATE runs SET handed_off_at = ?, follow_offset = ?, follow_step = ?, follow_progress_at = ? "
            "WHERE run_id = ? AND state = 'RUNNING'",
            [time.time(), offset, last_step, last_progress, run_id])
    return bool(moved)


class Watch:
    """What the sensor has read of each handed-off attempt's event stream, between ticks.

    Kept in the process that ticks (the daemon's code server) only to avoid re-reading lines:
    after a restart it starts again from the offset the last run recorded, which is always safe.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, bool]] = {}  # run_id -> (handed_off offset, read to, woke)
        self._lock = threading.Lock()

    def wants_run(self, provider, row: dict, handle, *, every_s: float, now: float | None = None) -> str | None:
        """Why a run should take up this running, handed-off attempt now, or None."""
        now = time.time() if now is None else now
        if now - float(row["handed_off_at"]) >= every_s:
            return f"no run has read its events for {every_s:.0f} s"
        start = int(row["follow_offset"] or 0)
        with self._lock:
            base, read_to, woke = self._seen.get(row["run_id"], (start, start, False))
        if base != start:  # a run took it up and handed it back since: read from its offset
            read_to, woke = start, False
        if not woke:
            try:
                events, read_to = provider.read_events(handle, read_to)
            except (OSError, ProviderError):
                return None  # out of reach now: its status says when it is lost, the clock when to look
            woke = any(isinstance(ev, dict) and ev.get("type") in WAKING_EVENTS for ev in events)
        with self._lock:
            self._seen[row["run_id"]] = (start, read_to, woke)
        return "it wrote a checkpoint or ended" if woke else None

    def forget(self, keep: set[str]) -> None:
        """Drop attempts no longer handed off (they ended, or a run follows them)."""
        with self._lock:
            for run_id in set(self._seen) - keep:
                del self._seen[run_id]


WATCH = Watch()  # the ticking process's one
