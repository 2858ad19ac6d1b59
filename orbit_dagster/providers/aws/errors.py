"""AWS vendor codes -> orbit meaning: errors to orbit error types, spot statuses to notices.

Errors: one table, used by the EC2 provider and (through `translate`) for the S3
checkpoint store's errors: the control plane decides to retry, fail or move on from the
orbit type and its `retryable` flag alone, never from a vendor string. Messages name the
operation, the AWS code and the fix; they carry AWS's own message (never a request, a
header or a credential).

Spot request status codes (`describe_spot_instance_requests` -> Status.Code, AWS's
"Spot request status" table): `marked-for-*` is the two-minute reclaim warning (a Notice),
`instance-terminated-by-price` & co. mean the machine was taken (lost), capacity codes
mean the request waits without an instance.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Iterator

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProxyConnectionError,
    ReadTimeoutError,
)

from ...core.errors import AuthError, NetworkError, NoCapacity, ProviderError, QuotaExceeded, ResourceNotFound, Throttled
from ..base import Notice

# code -> (orbit type, fix). The code is `Error.Code` of a ClientError (EC2, S3, STS), or a
# spot request status code (those in lower case), which `request_status_error` maps too.
_AUTH_FIX = ("check the credentials the standard AWS chain finds (env, profile, instance role) "
             "and that their IAM policy allows this action")
_CODES: dict[str, tuple[type[ProviderError], str]] = {}


def _add(cls: type[ProviderError], fix: str, *codes: str) -> None:
    for code in codes:
        _CODES[code] = (cls, fix)


_add(AuthError, _AUTH_FIX, "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "AccessDenied",
     "AccessDeniedException", "SignatureDoesNotMatch", "InvalidAccessKeyId", "UnrecognizedClientException",
     "OptInRequired", "MissingAuthenticationToken", "AuthorizationError")
_add(AuthError, "refresh the session credentials (aws sso login, or a new role session)",
     "ExpiredToken", "ExpiredTokenException", "RequestExpired")
_add(NoCapacity, "try another instance type, zone or region, or retry later",
     "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
     "capacity-not-available", "capacity-oversubscribed", "instance-terminated-no-capacity",
     "instance-terminated-capacity-oversubscribed")
_add(NoCapacity, "raise the spot max price (or leave it unset: it defaults to the on-demand price)",
     "SpotMaxPriceTooLow", "price-too-low")
_add(QuotaExceeded, "request a higher EC2 quota (Service Quotas: 'All G and VT Spot Instance Requests', "
     "'All P Spot Instance Requests') or run fewer instances",
     "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded", "VcpuLimitExceeded", "SpotInstanceLimitExceeded",
     "ResourceLimitExceeded", "TooManyBuckets")
_add(Throttled, "retry with backoff; lower the polling rate (api_poll_s)",
     "RequestLimitExceeded", "Throttling", "ThrottlingException", "SlowDown", "RequestThrottled",
     "RequestThrottledException", "TooManyRequestsException", "EC2ThrottledException")
_add(ResourceNotFound, "check the id, the region and the endpoint; a terminated instance is forgotten after ~1 h",
     "InvalidInstanceID.NotFound", "InvalidSpotInstanceRequestID.NotFound", "InvalidAMIID.NotFound",
     "InvalidAMIID.Unavailable", "NoSuchKey", "NoSuchUpload", "NotFound", "404")
_add(ResourceNotFound, "create the bucket, or correct the s3:// uri of the checkpoint store", "NoSuchBucket")

# Server-side faults: AWS documents them as safe to retry.
_RETRYABLE_SERVER = {"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable",
                     "ServerInternal", "RequestTimeout", "RequestTimeoutException"}


def _network_types() -> tuple[type[BaseException], ...]:
    return (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError,
            ProxyConnectionError)


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__  # type: ignore[assignment]


def error_code(exc: BaseException) -> str:
    """The AWS code of a ClientError (`InvalidInstanceID.NotFound`, `404`, ...), else the class name."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        if code:
            return str(code)
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return type(exc).__name__


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return int(status) if status else None
    return None


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def translate(exc: BaseException, *, operation: str, provider: str = "aws") -> ProviderError:
    """The orbit error for a botocore exception (or one it caused, e.g. an S3 StoreError)."""
    if isinstance(exc, ProviderError):
        return exc
    vendor = next((e for e in _cause_chain(exc) if isinstance(e, (ClientError, BotoCoreError))), exc)
    where = f"aws {operation}"
    if isinstance(vendor, ClientError):
        code = error_code(vendor)
        message = _clip((vendor.response.get("Error") or {}).get("Message") or "")
        status = _http_status(vendor)
        head = f"{where} failed: {code}" + (f" (HTTP {status})" if status else "") + (f": {message}" if message else "")
        if code in _CODES:
            cls, fix = _CODES[code]
            return cls(head, provider=provider, fix=fix, field=operation, value=code)
        if code.endswith(".NotFound") or status == 404:
            return ResourceNotFound(head, provider=provider, field=operation, value=code,
                                    fix="check the id, the region and the endpoint")
        if code in _RETRYABLE_SERVER or (status is not None and status >= 500):
            return ProviderError(head, provider=provider, retryable=True, field=operation, value=code,
                                 fix="a fault on AWS's side: retry later")
        return ProviderError(head, provider=provider, retryable=False, field=operation, value=code,
                             fix="see AWS's message; the request itself is wrong and will fail again")
    name = type(vendor).__name__
    if isinstance(vendor, _network_types()):
        return NetworkError(f"{where} failed: {name}: {_clip(str(vendor))}", provider=provider, field=operation,
                            value=name, fix="check the endpoint URL, the network and any proxy; retry")
    if isinstance(vendor, (NoCredentialsError, PartialCredentialsError)):
        return AuthError(f"{where} failed: {name}: no usable AWS credentials were found", provider=provider,
                         field=operation, value=name,
                         fix="set them in the standard chain (AWS_PROFILE, env vars, ~/.aws, instance role) "
                             "or through the resource's EnvVar")
    if isinstance(vendor, NoRegionError):
        return ProviderError(f"{where} failed: no AWS region is configured", provider=provider, retryable=False,
                             field="region", value=None, fix="pass region= to the provider or set AWS_DEFAULT_REGION")
    return ProviderError(f"{where} failed: {name}: {_clip(str(vendor))}", provider=provider, retryable=False,
                         field=operation, value=name, fix="see the message; report it if it persists")


def request_status_error(code: str, message: str, *, operation: str, provider: str = "aws") -> ProviderError:
    """A spot request that did not become an instance (status `capacity-not-available`, ...)."""
    head = f"aws {operation}: spot request not fulfilled: {code}" + (f": {_clip(message)}" if message else "")
    if code in _CODES:
        cls, fix = _CODES[code]
        return cls(head, provider=provider, fix=fix, field=operation, value=code)
    return ProviderError(head, provider=provider, retryable=False, field=operation, value=code,
                         fix="see the spot request status in the EC2 console; fix the launch parameters")


@contextmanager
def aws_errors(operation: str, provider: str = "aws") -> Iterator[None]:
    """Run AWS calls; any botocore error leaves as the orbit error (vendor error as __cause__)."""
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise translate(exc, operation=operation, provider=provider) from exc


# ---- spot request status codes -------------------------------------------------------

NOTICE_LEAD_S = 120  # AWS's two-minute warning, counted from the status's UpdateTime
END_STATES = ("shutting-down", "terminated", "stopping", "stopped")


@dataclass(frozen=True)
class SpotStatus:
    code: str
    # pending: being evaluated | holding: waits, no instance (capacity, price, constraints)
    # running: has its instance | notice: reclaim scheduled | lost: AWS took the instance
    # ended: stopped or terminated by the user | closed: ended without an instance | unknown
    kind: str
    action: str | None = None  # what AWS does to the instance: terminate | stop | hibernate


_SPOT: dict[str, tuple[str, str | None]] = {
    **{c: ("pending", None) for c in ("pending-evaluation", "pending-fulfillment", "not-scheduled-yet")},
    **{c: ("holding", None) for c in (
        "capacity-not-available", "capacity-oversubscribed", "price-too-low", "az-group-constraint",
        "launch-group-constraint", "placement-group-constraint", "constraint-not-fulfillable", "limit-exceeded")},
    "fulfilled": ("running", None),
    "request-canceled-and-instance-running": ("running", None),
    "marked-for-termination": ("notice", "terminate"),
    "marked-for-stop": ("notice", "stop"),
    "marked-for-hibernation": ("notice", "hibernate"),
    "marked-for-stop-by-experiment": ("notice", "stop"),
    # AWS sets these the moment it decides to reclaim, and (per its docs) leaves the instance
    # running for the two-minute warning: while it runs, they are a notice too.
    **{c: ("lost", "terminate") for c in (
        "instance-terminated-by-price", "instance-terminated-no-capacity",
        "instance-terminated-capacity-oversubscribed", "instance-terminated-launch-group-constraint",
        "instance-terminated-by-service", "instance-terminated-by-experiment")},
    **{c: ("lost", "stop") for c in (
        "instance-stopped-by-price", "instance-stopped-no-capacity", "instance-stopped-by-experiment")},
    **{c: ("ended", None) for c in (
        "instance-terminated-by-user", "spot-instance-terminated-by-user", "instance-stopped-by-user",
        "instance-terminated-by-schedule")},
    **{c: ("closed", None) for c in (
        "bad-parameters", "schedule-expired", "canceled-before-fulfillment", "system-error")},
}


def spot_status(code: str) -> SpotStatus:
    kind, action = _SPOT.get(code, ("unknown", None))
    return SpotStatus(code, kind, action)


def notice_from_spot_request(instance_id: str, request: dict, *, instance_state: str = "running",
                             now: datetime | None = None) -> Notice | None:
    """A Notice when the request's status announces a reclaim of a still-running instance; else None.

    `marked-for-*`, and a reclaim code (`instance-terminated-no-capacity`, ...) while EC2 still
    reports the instance pending/running. The deadline is the status's UpdateTime plus
    AWS's two minutes (the metadata endpoint, when reachable, gives the exact time and wins).
    """
    status = request.get("Status") or {}
    s = spot_status(str(status.get("Code", "")))
    if s.kind != "notice" and not (s.kind == "lost" and instance_state in ("pending", "running")):
        return None
    now = now or datetime.now(timezone.utc)
    marked = status.get("UpdateTime")
    if isinstance(marked, datetime):
        marked = marked.replace(tzinfo=timezone.utc) if marked.tzinfo is None else marked.astimezone(timezone.utc)
    else:
        marked = None
    deadline = (marked or now) + timedelta(seconds=NOTICE_LEAD_S)
    return Notice(instance_id=instance_id, action=s.action or "terminate", deadline=deadline, received_at=now,
                  source=f"spot-request-status:{s.code}")


_TRANSITION = re.compile(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)")


def transition_time(text: str) -> datetime | None:
    """When EC2 says a state change happened: `User initiated (2024-05-01 12:00:00 GMT)` -> that time."""
    m = _TRANSITION.search(text or "")
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc) if m else None
