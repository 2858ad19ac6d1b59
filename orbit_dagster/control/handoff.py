"""Hand-off: a training run launches its attempt, then hands following to the daemon.

With `ORBIT_FOLLOW=daemon` (the team profile's default) no Dagster run, and no run worker
process, is held while a GPU trains. The run that launches an attempt follows it for
`ORBIT_HANDOFF_AFTER_S` (a job that fails at once, or a short one, ends in it); if it still
runs then, the run records in the attempt's ledger row where it stopped reading (`follow_offset`, the
last step seen and when: billing needs them for the wasted compute of a reclaim) and when
it handed off, and ends. From then on the interruption sensor watches the attempt at each
tick, as it watches every attempt no run follows: it asks the host for its status and, here,
reads the new lines of the attempt's event stream (`Watch`). It requests a short
`training_run` run, a re-attach, when:
- the workload has ended or its host is lost: that run closes the attempt exactly as a run
  following it would have (artifacts, release and bill, recovery or the next attempt);
- the workload wrote a checkpoint, and the last run read its events at least
  `COLLECT_EVERY_S` ago: that run copies and verifies the checkpoints written since,
  registers them (their evaluations follow) and hands the attempt back. The wait batches
  checkpoints written every few seconds (a run takes seconds of CPU to start: waking one per
  checkpoint would cost more than following);
- `follow_every_s` passed since the last run: the metrics reach the ledger.
A following run and a re-attach share `attempt.run_attempt`; the notice a reclaim gives is
acted on by the runtime agent on the host either way (its emergency checkpoint).
"""
from __future__ import annotations

import threading
import time

from ..core.errors import ProviderError
from ..core.host_contract import Checkpoint, Exit, HostEvent
from ..ledger import Ledger

# Records of an event stream that make a run worth starting before `follow_every_s`: the end
# at once, a checkpoint once COLLECT_EVERY_S have passed since the last run read the stream.
WAKING_EVENTS: tuple[type[HostEvent], ...] = (Checkpoint, Exit)
COLLECT_EVERY_S = 60.0


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
        # run_id -> (handed-off offset, read to, the waking record types seen)
        self._seen: dict[str, tuple[int, int, set[type[HostEvent]]]] = {}
        self._lock = threading.Lock()

    def wants_run(self, provider, row: dict, handle, *, every_s: float, now: float | None = None) -> str | None:
        """Why a run should take up this running, handed-off attempt now, or None."""
        now = time.time() if now is None else now
        age = now - float(row["handed_off_at"])
        if age >= every_s:
            return f"no run has read its events for {every_s:.0f} s"
        start = int(row["follow_offset"] or 0)
        with self._lock:
            base, read_to, seen = self._seen.get(row["run_id"], (start, start, set()))
        if base != start:  # a run took it up and handed it back since: read from its offset
            read_to, seen = start, set()
        if Exit not in seen:
            try:
                events, read_to = provider.read_events(handle, read_to)
            except (OSError, ProviderError):
                return None  # out of reach now: its status says when it is lost, the clock when to look
            seen = seen | {type(ev) for ev in events if isinstance(ev, WAKING_EVENTS)}  # refusals wake nothing
        with self._lock:
            self._seen[row["run_id"]] = (start, read_to, seen)
        if Exit in seen:
            return "its workload ended"
        if Checkpoint in seen and age >= min(COLLECT_EVERY_S, every_s):
            return "it wrote a checkpoint"
        return None

    def forget(self, keep: set[str]) -> None:
        """Drop attempts no longer handed off (they ended, or a run follows them)."""
        with self._lock:
            for run_id in set(self._seen) - keep:
                del self._seen[run_id]


WATCH = Watch()  # the ticking process's one
