"""What runs on the rented host: the agent, the workload SDK, tiered checkpoints, notices.

Stdlib + torch + orbit_dagster.storage + orbit_dagster.core.host_contract only: this
package is copied into every bundle (with those) and must never import the control plane.
"""
