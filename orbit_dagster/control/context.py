"""What an attempt runs with: its frozen bundle, its provider, its checkpoint store, its reporter."""
from __future__ import annotations

from typing import Protocol

from ..core.bundle import JobBundle
from ..ledger import Ledger
from ..ledger import records as R
from ..providers.base import Provider
from .providers import provider_for
from .settings import Settings


def bundle_of(ledger: Ledger, job_id: str, attempt: int, *, verify: bool = False) -> JobBundle:
    return JobBundle.load(R.bundle_for(ledger, job_id, attempt)["path"], verify=verify)


def store_for(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> str:
    """The checkpoint store root the job's template names (fs or s3)."""
    return settings.store_uri_for(bundle_of(ledger, job_id, attempt).spec.template.checkpoint.store)


def eval_suite_for(settings: Settings, ledger: Ledger, job_id: str, attempt: int) -> str | None:  # noqa: ARG001
    """The evaluation suite new checkpoints of this job are queued for (None: not evaluable)."""
    template = bundle_of(ledger, job_id, attempt).spec.template
    return template.eval.suite_id if template.eval else None


def bundle_and_provider(settings: Settings, ledger: Ledger, job_id: str, attempt: int, *,
                        verify: bool = False) -> tuple[JobBundle, Provider]:
    """The attempt's bundle and its provider. `verify` re-hashes every file of the bundle: what
    dispatch does before sending it to a host (the host's agent checks it again); following,
    billing and reconciling an attempt only need its settings."""
    bundle = bundle_of(ledger, job_id, attempt, verify=verify)
    return bundle, provider_for(settings, bundle.spec.execution_request.backend_key)


class Reporter(Protocol):
    def checkpoints(self, rows: list[dict]) -> None: ...

    def log(self, message: str) -> None: ...


class NullReporter:
    def checkpoints(self, rows: list[dict]) -> None:
        pass

    def log(self, message: str) -> None:
        pass
