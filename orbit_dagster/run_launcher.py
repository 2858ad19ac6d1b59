"""The name a `dagster.yaml` written by an earlier orbit gives the run launcher (orbit never
rewrites that file): the class lives in deploy/run_launcher.py."""
from .deploy.run_launcher import OrbitRunLauncher

__all__ = ["OrbitRunLauncher"]
