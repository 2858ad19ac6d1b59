"""What an attempt runs with: its frozen bundle, its provider, its checkpoint store, its reporter."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Iterable, Protocol, TypeVar

from ..core.bundle import JobBundle
from ..ledger import Ledger
from ..ledger import records as R
from ..providers.base import Provider
from ..settings import Settings
from .providers import provider_for

T = TypeVar("T")
U = TypeVar("U")


@lru_cache(maxsize=4096)
def bundle_at(path: str, bundle_hash: str) -> JobBundle:  # noqa: ARG001 - part of the key
    """A bundle's settings, read once per process: a bundle never changes, and its hash in
    the ledger names its bytes, so (path, hash) names one content (a sensor tick over 1,000
    attempts no longer parses 1,000 job.json files every 2 s)."""
    return JobBundle.load(path, verify=False)


def bundle_of(ledger: Ledger, job_id: str, attempt: int, *, verify: bool = False) -> JobBundle:
    row = R.bundle_for(ledger, job_id, attempt)
    return JobBundle.load(row["path"], verify=True) if verify else bundle_at(row["path"], row["bundle_hash"])


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


class Attempts:
    """Each attempt's bundle and provider for one pass over many attempts (a sensor tick): the
    bundle rows of every job in flight in one query, each provider made once. Callable like
    `bundle_and_provider` without its first two arguments, from several threads."""

    def __init__(self, settings: Settings, ledger: Ledger):
        self.settings, self.ledger = settings, ledger
        self._rows: dict[str, list[dict]] = {}
        for row in ledger.rows(
                """SELECT b.job_id, b.attempt, b.path, b.bundle_hash FROM bundles b JOIN jobs j ON j.job_id = b.job_id
                   WHERE j.state IN ('DISPATCHING', 'RUNNING', 'CANCELLED', 'LOST') ORDER BY b.attempt DESC"""):
            self._rows.setdefault(row["job_id"], []).append(row)
        self._providers: dict[str, Provider] = {}
        self._lock = threading.Lock()

    def __call__(self, job_id: str, attempt: int) -> tuple[JobBundle, Provider]:
        # As R.bundle_for: the newest bundle up to this attempt (a retry may rebuild it).
        row = next((r for r in self._rows.get(job_id, []) if int(r["attempt"]) <= attempt), None) \
            or R.bundle_for(self.ledger, job_id, attempt)
        bundle = bundle_at(row["path"], row["bundle_hash"])
        key = bundle.spec.execution_request.backend_key
        with self._lock:
            if key not in self._providers:
                self._providers[key] = provider_for(self.settings, key)
            return bundle, self._providers[key]


def concurrently(fn: Callable[[T], U], items: Iterable[T], workers: int = 8) -> list[U]:
    """`fn` over `items` on a few threads, results in order: for provider calls that wait on
    I/O (a host's metadata endpoint, a state file, an API), one per attempt in a tick."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


class Reporter(Protocol):
    def checkpoints(self, rows: list[dict]) -> None: ...

    def log(self, message: str) -> None: ...


class NullReporter:
    def checkpoints(self, rows: list[dict]) -> None:
        pass

    def log(self, message: str) -> None:
        pass
