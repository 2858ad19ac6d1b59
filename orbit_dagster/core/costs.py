"""Per-second cost attribution of one instance's life (pure).

An instance is billed for every second from start to stop at its price. For a training
attempt, the seconds up to each checkpoint are attributed to that checkpoint. After the
last checkpoint of a lost attempt, the seconds up to its last training step are `wasted`
(that work is redone by the next attempt); every other remaining second is `overhead`
(waiting for the reclaim after an emergency checkpoint, shutdown, collection). Evaluation instances are attributed whole to
the checkpoint they evaluate. The parts always sum to the bill.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class CostLine:
    checkpoint_key: str | None
    kind: str  # train | wasted | overhead | eval
    start: datetime
    end: datetime
    seconds: float
    usd: float


def attribute_instance(
    *,
    start: datetime,
    stop: datetime,
    usd_per_second: float,
    checkpoints: list[tuple[datetime, str]],
    lost: bool,
    purpose: str = "train",
    eval_checkpoint: str | None = None,
    last_progress: datetime | None = None,
) -> list[CostLine]:
    """Split [start, stop] into cost lines; `checkpoints` are (time durable, key)."""
    total = max((stop - start).total_seconds(), 0.0)
    if purpose == "eval":
        return [CostLine(eval_checkpoint, "eval", start, stop, total, total * usd_per_second)]
    lines: list[CostLine] = []
    cursor = start
    for when, key in sorted(checkpoints):
        when = min(max(when, cursor), stop)  # clamp clocks that disagree by a little
        secs = (when - cursor).total_seconds()
        lines.append(CostLine(key, "train", cursor, when, secs, secs * usd_per_second))
        cursor = when
    if lost:
        # Without a progress mark, all of the tail was (potentially) useful work, lost.
        cut = stop if last_progress is None else min(max(last_progress, cursor), stop)
        secs = (cut - cursor).total_seconds()
        if secs > 0:
            lines.append(CostLine(None, "wasted", cursor, cut, secs, secs * usd_per_second))
        cursor = cut
    tail = (stop - cursor).total_seconds()
    if tail > 0 or not lines:
        lines.append(CostLine(None, "overhead", cursor, stop, tail, tail * usd_per_second))
    return lines
