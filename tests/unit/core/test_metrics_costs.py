import math
from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from orbit_dagster.core.costs import attribute_instance
from orbit_dagster.core.metrics import Candidate, pick_best, resolve_primary_metric

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_primary_metric_resolution_order():
    assert resolve_primary_metric(("eval/acc", "max"), ("eval/loss", "min")).resolved_from == "experiment"
    assert resolve_primary_metric((None, None), ("eval/f1", "max")).name == "eval/f1"
    g = resolve_primary_metric(None, None, ["eval/loss", "eval/accuracy"])
    assert (g.name, g.mode, g.resolved_from) == ("eval/loss", "min", "global")
    assert resolve_primary_metric(None, None, ["eval/accuracy"]).name == "eval/accuracy"


def test_eval_metrics_beat_training_metrics():
    cands = [Candidate("j/10", 10, None, 0.1), Candidate("j/20", 20, 2.0, 3.0), Candidate("j/30", 30, 1.5, 9.0)]
    best = pick_best(cands, "min")
    assert best.checkpoint_key == "j/30" and best.source == "eval" and best.candidates == 2


def test_training_metric_used_when_nothing_is_evaluated_and_nan_never_wins():
    cands = [Candidate("j/10", 10, None, math.nan), Candidate("j/20", 20, None, 3.0)]
    assert pick_best(cands, "min").checkpoint_key == "j/20"
    assert pick_best([Candidate("j/1", 1, None, None)], "min") is None


def test_ties_go_to_the_earlier_step():
    cands = [Candidate("j/20", 20, 1.0, None), Candidate("j/10", 10, 1.0, None)]
    assert pick_best(cands, "max").checkpoint_key == "j/10"


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=1, max_size=20))
def test_best_is_the_minimum(values):
    cands = [Candidate(f"j/{i}", i, v, None) for i, v in enumerate(values)]
    assert pick_best(cands, "min").value == min(values)
    assert pick_best(cands, "max").value == max(values)


@given(
    st.floats(min_value=1, max_value=10_000),
    st.lists(st.floats(min_value=0, max_value=10_000), max_size=10),
    st.booleans(),
    st.floats(min_value=1e-6, max_value=1.0),
    st.floats(min_value=0, max_value=1.0),
)
def test_cost_lines_sum_to_the_bill(duration, marks, lost, price, lag):
    stop = T0 + timedelta(seconds=duration)
    # Each checkpoint durable some seconds after training went on past it (an async save).
    ckpts = [(T0 + timedelta(seconds=m), f"j/{i}", T0 + timedelta(seconds=m * (1 - lag)))
             for i, m in enumerate(sorted(marks))]
    lines = attribute_instance(start=T0, stop=stop, usd_per_second=price, checkpoints=ckpts, lost=lost,
                               last_progress=stop - timedelta(seconds=duration / 3))
    billed = (stop - T0).total_seconds() * price  # datetimes hold microseconds
    assert math.isclose(sum(line.usd for line in lines), billed, rel_tol=1e-9)
    assert all(line.seconds >= 0 for line in lines)
    assert lost or not any(line.kind == "wasted" for line in lines)


def test_wasted_is_the_work_after_the_last_checkpoint_of_a_lost_attempt():
    lines = attribute_instance(start=T0, stop=T0 + timedelta(seconds=100), usd_per_second=1.0,
                               checkpoints=[(T0 + timedelta(seconds=60), "j/60")], lost=True,
                               last_progress=T0 + timedelta(seconds=90))
    kinds = {line.kind: line.seconds for line in lines}
    assert kinds == {"train": 60, "wasted": 30, "overhead": 10}


def test_a_lost_attempts_waste_begins_where_training_went_on_past_its_last_checkpoint():
    """An async save (or a script's upload) became durable at 70 s, but training had gone on
    past its step at 60 s: the steps after 60 s are lost with the attempt, so its waste
    begins there, not at 70 s; a sync save (no third time) is cut at its durable time."""
    at = lambda s: T0 + timedelta(seconds=s)  # noqa: E731
    lines = attribute_instance(start=T0, stop=at(100), usd_per_second=1.0, lost=True, last_progress=at(90),
                               checkpoints=[(at(30), "j/30", at(25)), (at(70), "j/60", at(60))])
    assert [(line.kind, line.checkpoint_key, line.seconds) for line in lines] == [
        ("train", "j/30", 30), ("train", "j/60", 30), ("wasted", None, 30), ("overhead", None, 10)]
    # No progress after it went on (an emergency save: training stopped for it): the save's
    # seconds up to durable stay its own, the rest is overhead.
    lines = attribute_instance(start=T0, stop=at(100), usd_per_second=1.0, lost=True, last_progress=at(58),
                               checkpoints=[(at(70), "j/60", at(60))])
    assert [(line.kind, line.seconds) for line in lines] == [("train", 70), ("overhead", 30)]
    # An attempt that was not lost keeps every checkpoint's seconds up to its durable time.
    lines = attribute_instance(start=T0, stop=at(100), usd_per_second=1.0, lost=False, last_progress=at(90),
                               checkpoints=[(at(70), "j/60", at(60))])
    assert [(line.kind, line.seconds) for line in lines] == [("train", 70), ("overhead", 30)]
