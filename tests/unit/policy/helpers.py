"""Small builders shared by the policy tests (hand-made traces, a fitted-looking model)."""
from __future__ import annotations

from hypothesis import strategies as st

from orbit_dagster.catalog.reclaim_model import ReclaimModel
from orbit_dagster.catalog.traces import Trace, trace_from_dict
from orbit_dagster.policy.simulate import JobParams


def make_trace(bits, gap: float = 60.0, prices=None, name: str = "t") -> Trace:
    data = tuple(int(b) for b in bits)
    kind = "preemption" if prices is not None else "availability"
    return Trace(name=name, gap_seconds=gap, data=data, prices=None if prices is None else tuple(prices), kind=kind)


def model(**over) -> ReclaimModel:
    """A model with the shape of the shipped one, independent of the shipped file."""
    kw = dict(up_shape=0.65, down_shape=0.7, zone_rate_alpha=1.1, zone_rate_beta_h=2.3,
              zone_down_log_mu=8.7, zone_down_log_sigma=0.6,
              band_rates_per_hour={"0": 0.05, "1": 0.15, "2": 0.25, "3": 0.34, "4": 0.49},
              calibrated_bands=(4,), spot_usd_per_hour=0.9, on_demand_usd_per_hour=3.0)
    kw.update(over)
    return ReclaimModel(**kw)


# availability traces as runs: (available?, ticks)
runs = st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=40)), min_size=1, max_size=25)


def expand(rs) -> list[int]:
    return [int(a) for a, n in rs for _ in range(n)]


# A zone's count of a 3-node shape, one value a minute: 2 h of 3, 1 h of 2, 30 min of 1, 2 h of 3,
# 10 min of 2, then 3 for the rest. Drops at 7200 s (3 -> 2), 10800 s (2 -> 1) and 19800 s (3 -> 2):
# the group reclaims of tests/unit/policy/test_group_replay.py and test_group_decisions_agree.py.
GROUP_GAP = 60
GROUP_RUNS = ((3, 120), (2, 60), (1, 30), (3, 120), (2, 10), (3, 400))


def group_trace(runs=GROUP_RUNS) -> Trace:
    data = [v for v, n in runs for _ in range(n)]
    return trace_from_dict({"metadata": {"gap_seconds": GROUP_GAP, "cloud": "aws", "nodes": 3}, "data": data,
                            "prices": [1.0] * len(data)}, name="three-nodes")


def group_job(**kw) -> JobParams:
    """6 hours of a 3-node group's work, a 60 s save, a 300 s restore, AWS's notice, 1 $/h a node."""
    return JobParams(**{"work_s": 6 * 3600.0, "save_s": 60.0, "restore_s": 300.0, "notice_s": 120.0, "nodes": 3,
                        "spot_usd_per_hour": 1.0, **kw})
