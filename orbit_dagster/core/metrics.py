"""Primary metric resolution and best-checkpoint ranking (pure)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal

GLOBAL_DEFAULT = ("eval/loss", "min")
FALLBACK_DEFAULT = ("eval/accuracy", "max")


@dataclass(frozen=True)
class PrimaryMetricChoice:
    name: str
    mode: Literal["min", "max"]
    resolved_from: str  # experiment | project | template | global


def resolve_primary_metric(
    experiment: tuple[str | None, str | None] | None,
    project: tuple[str | None, str | None] | None,
    available: Iterable[str] = (),
    template: tuple[str | None, str | None] | None = None,
) -> PrimaryMetricChoice:
    """A person's choice for the experiment -> for its project -> the experiment's template's
    -> the global default (`eval/loss` min, else `eval/accuracy` max)."""
    for level, pair in (("experiment", experiment), ("project", project), ("template", template)):
        if pair and pair[0]:
            return PrimaryMetricChoice(pair[0], (pair[1] or "min"), level)  # type: ignore[arg-type]
    names = set(available)
    if GLOBAL_DEFAULT[0] in names or not names or FALLBACK_DEFAULT[0] not in names:
        return PrimaryMetricChoice(*GLOBAL_DEFAULT, "global")  # type: ignore[arg-type]
    return PrimaryMetricChoice(*FALLBACK_DEFAULT, "global")  # type: ignore[arg-type]


def training_counterpart(metric: str) -> str:
    """`eval/loss` -> `train/loss`: the training-time metric used when no evaluation exists."""
    _, _, leaf = metric.rpartition("/")
    return f"train/{leaf}"


@dataclass(frozen=True)
class Candidate:
    checkpoint_key: str
    step: int
    eval_value: float | None
    train_value: float | None


@dataclass(frozen=True)
class BestChoice:
    checkpoint_key: str
    value: float
    source: Literal["eval", "train"]
    candidates: int


def pick_best(candidates: Iterable[Candidate], mode: Literal["min", "max"]) -> BestChoice | None:
    """Best by the primary metric; evaluation results beat training-time ones.

    If any checkpoint has an evaluation, only evaluated checkpoints compete (a training
    loss is not comparable with a held-out loss). Ties go to the earlier step, then to the
    key, so the answer is deterministic. NaN never wins.
    """
    cands = list(candidates)

    def finite(v: float | None) -> bool:
        return v is not None and not math.isnan(v) and not math.isinf(v)

    evaluated = [c for c in cands if finite(c.eval_value)]
    pool, source = (evaluated, "eval") if evaluated else ([c for c in cands if finite(c.train_value)], "train")
    if not pool:
        return None
    sign = 1.0 if mode == "min" else -1.0

    def value(c: Candidate) -> float:
        return float(c.eval_value if source == "eval" else c.train_value)  # type: ignore[arg-type]

    best = min(pool, key=lambda c: (sign * value(c), c.step, c.checkpoint_key))
    return BestChoice(best.checkpoint_key, value(best), source, len(pool))  # type: ignore[arg-type]
