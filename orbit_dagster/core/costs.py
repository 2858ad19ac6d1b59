"""Per-second cost attribution of one instance's life (pure).

An instance is billed for every second from start to stop at its price. For a training
attempt, the seconds up to each checkpoint (until it was durable) are attributed to that
checkpoint. After the last checkpoint of a lost attempt, the seconds up to its last training
step are `wasted` (that work is redone by the next attempt), counted from when training went
on past that checkpoint's step where it did so before the save was durable (an async save,
an upload): the work of those seconds was lost too. Every other remaining second is `overhead`
(waiting for the reclaim after an emergency checkpoint, shutdown, collection). An evaluation
instance is attributed to the checkpoints it evaluated: one evaluating several (a shared
instance) gives each the seconds up to its result, and the rest (boot for the first, the
shutdown, an evaluation that failed) to `eval_checkpoint`; one that evaluated a single
checkpoint is attributed whole to it. The parts always sum to the bill.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

# What an attempt's seconds bought: (time durable, key), or (time durable, key, time training
# went on past its step; None when unknown).
Bought = tuple[datetime, str] | tuple[datetime, str, datetime | None]


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
    checkpoints: list[Bought],
    lost: bool,
    purpose: str = "train",
    eval_checkpoint: str | None = None,
    last_progress: datetime | None = None,
) -> list[CostLine]:
    """Split [start, stop] into cost lines; `checkpoints` as `Bought` (evaluations: (time of
    the result, key))."""
    if purpose == "eval":
        return _eval_lines(start, stop, usd_per_second, checkpoints, eval_checkpoint)
    lines: list[CostLine] = []
    cursor = start
    ordered = sorted(checkpoints)
    for n, (when, key, *went_on) in enumerate(ordered):
        if lost and n == len(ordered) - 1:
            when = _lost_after(when, went_on[0] if went_on else None, last_progress)
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


def _lost_after(durable: datetime, went_on: datetime | None, last_progress: datetime | None) -> datetime:
    """Where a lost attempt's last checkpoint stops being paid for: when training went on past
    it, if training progressed after that (those steps are redone); else when it was durable
    (the seconds until then were its save, or waiting, not lost work)."""
    if went_on is None or went_on >= durable or (last_progress is not None and last_progress <= went_on):
        return durable
    return went_on


def _eval_lines(start: datetime, stop: datetime, usd_per_second: float, done: list[tuple[datetime, str]],
                rest_to: str | None) -> list[CostLine]:
    """An evaluation instance: each evaluated checkpoint its seconds up to its result, the rest
    to `rest_to` (the whole to it when nothing else was evaluated)."""
    lines: list[CostLine] = []
    cursor = start
    for when, key in sorted(done):
        when = min(max(when, cursor), stop)
        secs = (when - cursor).total_seconds()
        lines.append(CostLine(key, "eval", cursor, when, secs, secs * usd_per_second))
        cursor = when
    tail = (stop - cursor).total_seconds()
    if tail > 0 or not lines:
        lines.append(CostLine(rest_to or (lines[-1].checkpoint_key if lines else None), "eval", cursor, stop, tail,
                              tail * usd_per_second))
    return lines
