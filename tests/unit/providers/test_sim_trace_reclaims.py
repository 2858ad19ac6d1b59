"""The sim market's reclaims from a trace, across the trace's end (the market replays it cyclically)."""
import json

from orbit_dagster.core.offers import Offer
from orbit_dagster.providers.sim.market import MarketConfig, TraceReclaims

OFFER = Offer(offer_id="sim:p3.2xlarge:z", provider="sim", instance_type="p3.2xlarge", gpu="V100", gpu_count=1,
              usd_per_gpu_second_spot=0.9 / 3600, usd_per_gpu_second_on_demand=3.0 / 3600)


def test_an_instance_up_at_the_trace_end_is_reclaimed_where_the_trace_says_not_at_the_wrap(tmp_path):
    # ticks of 60 s: down 10 min, up 60, down 5, up 20 (to the end): 95 min in all
    data = [0] * 10 + [1] * 60 + [0] * 5 + [1] * 20
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60, "cloud": "aws"}, "data": data}))
    # market time 0 is trace second 4800 (15 min before the end); 1 market second per wall second
    config = MarketConfig(epoch_wall=0.0, trace_offset_s=0.0, scale=1.0, notice_s=120.0, traces=(str(path),),
                          zone_offsets={OFFER.offer_id: 4800.0})
    reclaims = TraceReclaims(config)
    # up 15 min to the end, then on at the trace's first up tick (600 s) for its 60 min: reclaimed at
    # trace second 4200, 75 min after the launch; never at the end's join with the down start
    assert reclaims.reclaim_at(OFFER, start_wall=0.0) == 900.0 + 3600.0
    # a launch in the second pass reads the trace from its first up tick: 1 min past the end is
    # trace second 660, reclaimed at 4200
    assert reclaims.reclaim_at(OFFER, start_wall=960.0) == 960.0 + 4200.0 - 660.0
