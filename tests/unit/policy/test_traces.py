from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_dagster.catalog.traces import (
    TraceFormatError,
    cyclic_ticks,
    cyclic_time,
    find_trace_files,
    load_trace,
    next_available,
    reclaim_offsets,
    up_runs,
)

from .helpers import expand, make_trace, runs


def test_loads_every_shared_trace_format(shared_data):
    files = find_trace_files(shared_data)
    assert files, "the shared data set has traces"
    kinds = {}
    for f in files:
        t = load_trace(f)
        raw = json.loads(f.read_text())
        assert t.data == tuple(raw["data"])
        assert t.gap_seconds == raw["metadata"]["gap_seconds"]
        assert (t.prices is not None) == ("prices" in raw)
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    assert set(kinds) == {"preemption", "availability", "multinode"}


@pytest.mark.parametrize("doc, field", [
    ({"data": [0, 1]}, "metadata.gap_seconds"),
    ({"metadata": {"gap_seconds": -3}, "data": [0, 1]}, "metadata.gap_seconds"),
    ({"metadata": {"gap_seconds": 30}, "data": []}, "data"),
    ({"metadata": {"gap_seconds": 30}, "data": [0, 1, "x"]}, "data[2]"),
    ({"metadata": {"gap_seconds": 30}, "data": [0, -1]}, "data[1]"),
    ({"metadata": {"gap_seconds": 30}, "data": [0, 1], "prices": [1.0]}, "prices"),
    ({"metadata": {"gap_seconds": 30}, "data": [0, 1], "prices": [1.0, -2]}, "prices[1]"),
    ([1, 2, 3], "<document>"),
])
def test_malformed_trace_names_file_field_and_fix(tmp_path, doc, field):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError) as err:
        load_trace(p)
    assert err.value.field == field
    assert str(p) in str(err.value) and "fix:" in str(err.value)


def test_not_json_and_missing_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{nope")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        load_trace(p)
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(tmp_path / "missing.json")


def test_reclaim_offsets_and_next_available_by_hand():
    t = make_trace([0, 1, 1, 0, 1, 0, 0, 1], gap=10)
    assert next_available(t, 0) == 10
    assert next_available(t, 15) == 15  # already available mid-tick
    assert next_available(t, 31) == 40
    assert next_available(t, 75) == 75
    assert next_available(t, 80) is None  # past the end
    assert next_available(t, 80, cyclic=True) == 80  # the next pass starts at the first up tick (1)
    assert reclaim_offsets(t, 10, 100) == [20, 40]
    assert reclaim_offsets(t, 10, 25) == [20]


@settings(max_examples=60, deadline=None)
@given(runs, st.floats(min_value=0, max_value=500), st.floats(min_value=0, max_value=3000))
def test_reclaims_are_exactly_the_falling_edges(rs, start, horizon):
    bits = expand(rs)
    t = make_trace(bits, gap=10)
    offs = reclaim_offsets(t, start, horizon)
    assert offs == sorted(offs) and len(set(offs)) == len(offs)
    for off in offs:
        at = start + off
        k = round(at / 10)
        assert abs(at - k * 10) < 1e-6 and bits[k - 1] == 1 and bits[k] == 0
        assert 0 < off <= horizon + 1e-9
    edges = [k * 10 - start for k in range(1, len(bits)) if bits[k - 1] == 1 and bits[k] == 0
             and 0 < k * 10 - start <= horizon]
    assert offs == pytest.approx(edges)


@settings(max_examples=60, deadline=None)
@given(runs, st.floats(min_value=0, max_value=1500))
def test_next_available_is_the_first_available_instant(rs, t_s):
    bits = expand(rs)
    t = make_trace(bits, gap=10)
    got = next_available(t, t_s)
    ticks_after = [k for k in range(len(bits)) if bits[k] and (k + 1) * 10 > t_s]
    if not ticks_after:
        assert got is None
    else:
        assert got == max(t_s, ticks_after[0] * 10)


@settings(max_examples=40, deadline=None)
@given(runs)
def test_up_runs_cover_exactly_the_available_ticks(rs):
    bits = expand(rs)
    t = make_trace(bits, gap=1)
    covered = [0] * len(bits)
    for b, e, _ in up_runs(t, 0, len(bits)):
        for k in range(int(b), int(e)):
            covered[k] += 1
    assert covered == bits


def test_a_cyclic_replay_joins_end_and_start_where_the_trace_is_up():
    """A trace that ends up and starts down: the join is no reclaim (the trace has none there)."""
    t = make_trace([0, 0, 1, 1, 0, 1, 1], gap=10)  # one reclaim, at 40 s; up at the end
    # up 50-70, joined at tick 2 (20 s) and up on to the trace's reclaim at 40 s; each later pass
    # (ticks 2 to 6, 50 s) the same
    assert list(up_runs(t, 50, 200, cyclic=True)) == [(50, 90, True), (100, 140, True), (150, 190, True),
                                                      (200, 240, True)]
    assert reclaim_offsets(t, 50, 200, cyclic=True) == [40, 90, 140, 190]
    assert cyclic_ticks(t, 5, 6) == [5, 6, 2, 3, 4, 5]
    assert cyclic_time(t, 35) == 35 and cyclic_time(t, 75) == 25 and cyclic_time(t, 125) == 25
    # a gang of 2 (never held) reads every pass whole, and is never up
    assert next_available(t, 0, nodes=2, cyclic=True) is None


@settings(max_examples=60, deadline=None)
@given(runs, st.integers(min_value=0, max_value=60))
def test_every_cyclic_reclaim_is_a_falling_edge_of_the_trace(rs, start):
    bits = expand(rs)
    t = make_trace(bits, gap=1)
    start = start % len(bits)
    edges_in_trace = {k for k in range(1, len(bits)) if bits[k - 1] and not bits[k]}
    for off in reclaim_offsets(t, start, 4 * len(bits), cyclic=True):
        k = round(start + off)
        assert cyclic_ticks(t, k, 1)[0] in edges_in_trace  # never one the wrap made up
