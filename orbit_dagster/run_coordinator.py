"""The name a `dagster.yaml` written by an earlier orbit gives the run coordinator (orbit never
rewrites that file): the class lives in deploy/run_coordinator.py."""
from .deploy.run_coordinator import OrbitRunCoordinator

__all__ = ["OrbitRunCoordinator"]
