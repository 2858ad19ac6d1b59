"""Dagster resources: thin wrappers over the control plane's settings and providers."""
from .orbit import OrbitResource

__all__ = ["OrbitResource"]
