"""The run launcher orbit's `dagster.yaml` names: Dagster's default launcher, with health checks.

Dagster's run monitoring fails a run whose worker died only when the launcher can say so,
and the default launcher (runs as processes of the code server) cannot: a run whose worker
was SIGKILLed, or whose machine rebooted, stays STARTED for good, holding its pool slot.
This launcher answers the health check from orbit's liveness record of each run worker
(control/liveness.py, written by every run of this code location), so the monitoring daemon
fails a dead run within its poll interval and its slot is given back; reconcile then takes
up the attempt it followed (re-attach, close, release, bill, requeue).

Terminating a run whose code server no longer knows it (a restarted code server) falls
back to interrupting its worker directly, or cancels the run at once when its worker is
already gone.
"""
from __future__ import annotations

import os
import signal

from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.launcher.default_run_launcher import DefaultRunLauncher
from dagster._core.storage.dagster_run import DagsterRun, RunsFilter


class OrbitRunLauncher(DefaultRunLauncher):
    """DefaultRunLauncher + `check_run_worker_health` from orbit's liveness records.

    Configured exactly like DefaultRunLauncher (no config); `from_config_value` builds `cls`."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def _verdict(self, run: DagsterRun):
        # lazy: these bring the ledger and the control plane (0.3 s or more) into every Dagster process that
        # loads its instance (webserver, daemon); only a health check needs them
        from ..ops.runs import verdicts
        from ..settings import Settings

        settings = Settings.from_env()
        records = list(self._instance.get_run_records(RunsFilter(run_ids=[run.run_id])))
        if not records:
            return None
        return verdicts(self._instance, settings.ledger(), records,
                        timeout_s=settings.worker_timeout_s)[run.run_id]

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        try:
            verdict = self._verdict(run)
        except Exception as exc:  # noqa: BLE001 - an unreadable ledger proves nothing dead
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, f"orbit's liveness records unreadable: {exc}")
        if verdict is None or verdict.alive:
            return CheckRunHealthResult(WorkerStatus.RUNNING)
        return CheckRunHealthResult(WorkerStatus.FAILED, verdict.why)

    def terminate(self, run_id: str) -> bool:
        try:
            if super().terminate(run_id):
                return True
        except Exception:  # noqa: BLE001 - e.g. the code server that started it is gone
            pass
        return self._terminate_directly(run_id)

    def _terminate_directly(self, run_id: str) -> bool:
        # lazy: as in _verdict; only a direct terminate needs them
        from ..control import liveness
        from ..settings import Settings

        run = self._instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return False
        worker = liveness.workers(Settings.from_env().ledger(), [run_id]).get(run_id)
        if worker is not None and worker.here and worker.process_alive():
            # SIGINT is what Dagster's own termination raises in the worker: the run stops
            # through its normal path (a training cancels its attempt) and shows CANCELED.
            os.kill(worker.pid, signal.SIGINT)
            return True
        verdict = self._verdict(run)
        if verdict is not None and not verdict.alive:
            self._instance.report_run_canceled(run, message=f"terminated: {verdict.why}")
            return True
        return False
