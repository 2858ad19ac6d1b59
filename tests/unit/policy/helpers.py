"""Small builders shared by the policy tests (hand-made traces, a fitted-looking model)."""
from __future__ import annotations

from hypothesis import strategies as st

from orbit_dagster.catalog.reclaim_model import ReclaimModel
from orbit_dagster.catalog.traces import Trace


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
