"""What an attempt runs with: its frozen bundle, its provider, its checkpoint store, its reporter."""
from __future__ import annotations

from typing import Protocol

from ..core.bundle import JobBundle
from ..ledger import Ledger
from ..ledger import records as R
from ..providers.base import Provider
from .providers import provider_for
from .settings import Settings


def store_for(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> str:
    """The checkpoint store root the job's template names (fs or s3)."""
    bundle = JobBundle.load(R.bundle_for(ledger, job_id, attempt)["path"], verify=False)
    return settings.store_uri_for(bundle.spec.template.checkpoint.store)


def bundle_and_provider(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> tuple[JobBundle, Provider]:
    bundle = JobBundle.load(R.bundle_for(ledger, job_id, attempt)["path"])
    return bundle, provider_for(settings, bundle.spec.execution_request.backend_key)


class Reporter(Protocol):
    def checkpoints(self, rows: list[dict]) -> None: ...

    def log(self, message: str) -> None: ...


class NullReporter:
    def checkpoints(self, rows: list[dict]) -> None:
        pass

    def log(self, message: str) -> None:
        pass
