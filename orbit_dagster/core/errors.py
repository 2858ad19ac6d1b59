"""Error types a person sees: each names the field, the value and the fix."""
from __future__ import annotations

MAX_MESSAGE_CHARS = 1500  # an error is a line a person reads: a message quoting a huge value is cut here too
MAX_FIX_CHARS = 1000


def _cut(text: str, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class OrbitError(Exception):
    """A user-facing error. The CLI prints `str(err)` on one line, no traceback.

    `value` is kept as given (for code that inspects it), never formatted here; messages
    quote values through `config_schema.show`, which cuts them before formatting."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None, fix: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        parts = [_cut(message, MAX_MESSAGE_CHARS)]
        if fix:
            parts.append(f"fix: {_cut(fix, MAX_FIX_CHARS)}")
        super().__init__("; ".join(parts))


class TemplateError(OrbitError):
    """A template is missing or does not validate."""


class OverrideNotAllowed(OrbitError):
    """A submission tried to change a field outside the template's `allow_overrides`."""


class InvalidOverride(OrbitError):
    """An override names an allowed field but its value does not validate."""


class InvalidTransition(OrbitError):
    """A job state change that the lifecycle table does not allow."""


class NotFound(OrbitError):
    """A job, run, checkpoint or experiment that the ledger does not know."""


class BundleIntegrityError(OrbitError):
    """A bundle's files no longer match its manifest."""


class CheckpointIntegrityError(OrbitError):
    """A checkpoint is incomplete or its files do not match its manifest."""


class ProviderError(OrbitError):
    """A vendor error normalised: `retryable` says whether trying again can help."""

    retryable: bool = False

    def __init__(self, message: str, *, provider: str = "", retryable: bool | None = None, **kw):
        self.provider = provider
        if retryable is not None:
            self.retryable = retryable
        super().__init__(message, **kw)


class AuthError(ProviderError):
    retryable = False


class QuotaExceeded(ProviderError):
    retryable = False


class NoCapacity(ProviderError):
    retryable = True


class Throttled(ProviderError):
    retryable = True


class ResourceNotFound(ProviderError):
    retryable = False


class NetworkError(ProviderError):
    retryable = True


class HostKeyMismatch(ProviderError):
    """An SSH host presented a key that is not the one the user trusts."""

    retryable = False
