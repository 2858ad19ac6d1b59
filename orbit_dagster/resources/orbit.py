"""The one resource every asset and sensor takes: where orbit's state lives."""
from __future__ import annotations

from typing import Optional

import dagster as dg

from ..control.settings import Settings


class OrbitResource(dg.ConfigurableResource):
    """orbit's home directory (ledger, bundles, checkpoint store, sim market).

    Unset means `$ORBIT_HOME`, else `./.orbit`. Provider credentials are separate
    resources, configured from the environment with `dagster.EnvVar`.
    """

    home: Optional[str] = None

    def settings(self) -> Settings:
        return Settings.from_env(self.home)
