"""The one resource every asset and sensor takes: where orbit's state lives."""
from __future__ import annotations

from typing import Optional

import dagster as dg
from pydantic import PrivateAttr

from ..control.liveness import Heartbeat
from ..settings import Settings


class OrbitResource(dg.ConfigurableResource):
    """orbit's home directory (ledger, bundles, checkpoint store, sim market).

    Unset means `$ORBIT_HOME`, else `./.orbit`. Provider credentials are separate
    resources, configured from the environment with `dagster.EnvVar`.

    In a run's worker it also keeps the run's liveness record (control/liveness.py) from
    the moment its resources start until they are torn down: every run of this code
    location takes this resource, so every run worker says whether it lives.
    """

    home: Optional[str] = None
    _heartbeat: Optional[Heartbeat] = PrivateAttr(default=None)

    def settings(self) -> Settings:
        return Settings.from_env(self.home)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        if context.run_id and context.dagster_run is not None:  # a run's worker (sensors have no run)
            self._heartbeat = Heartbeat(self.settings().ledger(), context.run_id).start()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:  # noqa: ARG002
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
