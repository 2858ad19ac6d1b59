"""Dagster resources: where orbit's state lives, and one GPU-rental resource per provider."""
from .orbit import OrbitResource
from .rentals import AwsSpotResource, SimMarketResource, SshRentalResource, active, from_environment

__all__ = ["OrbitResource", "SimMarketResource", "SshRentalResource", "AwsSpotResource", "active", "from_environment"]
