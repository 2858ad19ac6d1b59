"""What the benches say about their figures: the step-overhead verdict on on/off block pairs (a
goal is called met only when the figures resolve a cost within it, never when the on blocks ran
faster: the machine drifted), and the share of CPU time a hypervisor took during a run."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)
try:
    from recording import steal_share
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


def test_the_stolen_share_is_steal_over_all_cpu_time_between_two_readings():
    # /proc/stat: user nice system idle iowait irq softirq steal guest guest_nice
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [300, 0, 100, 1300, 0, 0, 0, 250, 7, 0]  # 950 more, 200 of them stolen; guest is inside user
    assert steal_share(before, after) == 200 / 950
    assert steal_share(before, before) is None and steal_share(None, after) is None and steal_share([1, 2], [3, 4]) is None
