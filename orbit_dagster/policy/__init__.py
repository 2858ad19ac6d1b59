"""The decision layer: pure functions and small classes, no Dagster, boto3 or paramiko.

- ``checkpointing``: checkpoint-interval policies (``OrbitInterval`` and the baselines)
- ``reclaim_rate``: online reclaim rate per offer/zone and notice reliability per cloud
- ``offer_choice``: which offer to rent (expected $ per useful PFLOP), a reason per position
- ``migration``: when to move make-before-break
- ``deadline`` / ``deadline_plan``: spot vs on-demand under a deadline (``spot_or_on_demand``;
  greedy, uniform progress, orbit, optimal in the replay)
- ``simulate`` / ``report``: the deterministic trace replay behind ``orbit simulate``

The interval formulas (Young/Daly, notice coverage, age-aware Weibull hazard) are in
``core.interval``: they travel to the host, which re-decides the interval as the instance ages.

The control plane and the replay call the same objects, so a benchmark result is a
statement about production code. See docs/policies.md ("How the control plane calls this").
"""
