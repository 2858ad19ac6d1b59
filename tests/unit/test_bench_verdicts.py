"""The step-overhead bench's verdict on on/off block pairs: a goal is called met only when the
figures resolve a cost within it, never when the on blocks ran faster (the machine drifted)."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)
try:
    from step_overhead import overhead
finally:  # the benches' module names stay out of every other test's imports (the bench adds itself too)
    sys.path[:] = [p for p in sys.path if p != BENCH]


def test_on_blocks_faster_than_their_partners_are_drift_not_the_goal_met():
    assert overhead([(0.92, 1.0), (0.95, 1.0), (0.93, 1.0)])["verdict"] == "not resolved (drift: on blocks faster)"


def test_a_resolved_cost_is_judged_against_the_goal():
    assert overhead([(1.01, 1.0), (1.012, 1.0), (1.015, 1.0)])["verdict"] == "yes"
    assert overhead([(1.05, 1.0), (1.06, 1.0), (1.04, 1.0)])["verdict"] == "**NO**"
    assert overhead([(0.99, 1.0), (1.01, 1.0), (1.005, 1.0)])["verdict"] == "yes (bound)"
    assert overhead([(0.95, 1.0), (1.05, 1.0), (1.0, 1.0)])["verdict"] == "not resolved"
