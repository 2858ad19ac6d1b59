"""What runs on the rented host: the agent, the workload SDK, tiered checkpoints, notices.

Stdlib + torch + orbit_dagster.storage only: this package is copied into every bundle and
must never import the control plane.
"""
