"""The decision layer: pure functions and small classes, no Dagster, boto3 or paramiko.

- ``interval``: how often to checkpoint (Young/Daly, notice- and age-aware)
- ``reclaim_rate``: online reclaim-rate estimate per offer/zone, prior from the spot-advisor band
- ``offer_choice``: which offer to rent (expected $ per useful PFLOP), with a ledger record
- ``migration``: when to move make-before-break
- ``deadline`` / ``deadline_plan``: spot vs on-demand under a deadline (greedy, uniform progress, orbit, optimal)
- ``checkpointing`` / ``simulate`` / ``report``: the deterministic trace replay behind ``orbit simulate``

The control plane and the replay call the same functions, so a benchmark result is a
statement about production code. See docs/policies.md for definitions and fitted constants.
"""
