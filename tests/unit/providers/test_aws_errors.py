"""Every AWS error class becomes the orbit error with the right `retryable` flag.

Provoked for real against moto's server where moto can (not found, auth, no credentials,
connection refused, read timeout); built as botocore would raise them otherwise
(capacity, quota, throttling: moto never refuses for those).
"""
from __future__ import annotations

import socket
import threading
from datetime import datetime, timezone

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ConnectTimeoutError, ReadTimeoutError

from orbit_dagster.core.errors import (
    AuthError,
    NetworkError,
    NoCapacity,
    ProviderError,
    QuotaExceeded,
    ResourceNotFound,
    Throttled,
)
from orbit_dagster.core.offers import Offer
from orbit_dagster.providers.aws.errors import aws_errors, request_status_error, translate
from orbit_dagster.providers.aws.provider import AwsSpotProvider
from orbit_dagster.providers.base import InstanceHandle
from orbit_dagster.storage import open_store
from orbit_dagster.storage.s3 import S3StoreError
from tests.integration.moto_fixtures import REGION, aws_env, client, closed_port, moto_auth, moto_server, s3_bucket  # noqa: F401

TABLE = [
    *[(c, AuthError, False) for c in ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "ExpiredToken",
                                      "AccessDenied")],
    *[(c, NoCapacity, True) for c in ("InsufficientInstanceCapacity", "SpotMaxPriceTooLow")],
    *[(c, QuotaExceeded, False) for c in ("MaxSpotInstanceCountExceeded", "InstanceLimitExceeded",
                                          "VcpuLimitExceeded")],
    *[(c, Throttled, True) for c in ("RequestLimitExceeded", "Throttling", "ThrottlingException", "SlowDown")],
    *[(c, ResourceNotFound, False) for c in ("InvalidInstanceID.NotFound", "NoSuchBucket", "NoSuchKey", "404",
                                             "InvalidVolume.NotFound")],
]


def client_error(code: str, status: int = 400, operation: str = "RunInstances") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"AWS says {code}"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, operation)


@pytest.mark.parametrize(("code", "cls", "retryable"), TABLE)
def test_each_vendor_code_maps_to_its_orbit_error(code, cls, retryable):
    err = translate(client_error(code), operation="run_instances")
    assert type(err) is cls and err.retryable is retryable and err.provider == "aws"
    assert "aws run_instances failed" in str(err) and code in str(err) and "fix: " in str(err)


def test_server_faults_retry_and_unknown_client_errors_do_not():
    assert translate(client_error("InternalError", 500), operation="x").retryable is True
    assert translate(client_error("Unavailable", 503), operation="x").retryable is True
    unknown = translate(client_error("InvalidParameterValue", 400), operation="run_instances")
    assert type(unknown) is ProviderError and unknown.retryable is False and "InvalidParameterValue" in str(unknown)


@pytest.mark.parametrize(("code", "cls", "retryable"), [
    ("capacity-not-available", NoCapacity, True), ("price-too-low", NoCapacity, True),
    ("bad-parameters", ProviderError, False), ("az-group-constraint", ProviderError, False)])
def test_an_unfulfilled_spot_request_status_maps_too(code, cls, retryable):
    err = request_status_error(code, "no luck", operation="request_spot_instances")
    assert type(err) is cls and err.retryable is retryable and code in str(err)


def test_a_connect_timeout_is_a_retryable_network_error():
    err = translate(ConnectTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com/"), operation="describe")
    assert type(err) is NetworkError and err.retryable is True and "ConnectTimeoutError" in str(err)


# ---- provoked for real -------------------------------------------------------------------

def _handle(instance_id: str) -> InstanceHandle:
    offer = Offer(offer_id="aws:g6.xlarge:use1-az1", provider="aws", instance_type="g6.xlarge", gpu="L4",
                  gpu_count=1, region=REGION, zone="use1-az1")
    return InstanceHandle(provider="aws", instance_id=instance_id, offer=offer,
                          started_at=datetime.now(timezone.utc))


def test_an_unknown_instance_is_resource_not_found(aws_env, tmp_path):
    p = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path)
    with pytest.raises(ResourceNotFound) as err:
        p.terminate(_handle("i-0123456789abcdef0"), "cleanup")
    assert err.value.retryable is False
    assert "terminate_instances" in str(err.value) and "InvalidInstanceID.NotFound" in str(err.value)
    assert isinstance(err.value.__cause__, ClientError)  # the vendor error is kept for the log
    with pytest.raises(ResourceNotFound):
        p.instance_times(_handle("i-0123456789abcdef0"))


def test_missing_buckets_and_keys_are_resource_not_found(aws_env, s3_bucket):
    s3 = client("s3", aws_env)
    for call, code in ((lambda: s3.get_object(Bucket="orbit-never-made", Key="k"), "NoSuchBucket"),
                       (lambda: s3.get_object(Bucket=s3_bucket, Key="nope"), "NoSuchKey"),
                       (lambda: s3.head_object(Bucket=s3_bucket, Key="nope"), "404")):
        with pytest.raises(ResourceNotFound) as err, aws_errors("s3 read"):
            call()
        assert err.value.retryable is False and code in str(err.value)
    # The checkpoint store raises StoreError (it travels to hosts without this module);
    # its cause translates the same way.
    with pytest.raises(S3StoreError) as store_err:
        list(open_store("s3://orbit-never-made/x").list("job"))
    assert store_err.value.code == "NoSuchBucket"
    assert type(translate(store_err.value, operation="list checkpoints")) is ResourceNotFound


def test_unknown_credentials_are_an_auth_error(aws_env, s3_bucket, tmp_path):
    p = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path, max_attempts=1)
    with moto_auth(aws_env):
        with pytest.raises(AuthError) as err:
            p.list_offers()
        with pytest.raises(S3StoreError) as store_err:
            list(open_store(f"s3://{s3_bucket}/x").list("job"))
    assert err.value.retryable is False and "AuthFailure" in str(err.value)
    assert "describe_instance_types" in str(err.value) and "standard AWS chain" in str(err.value)
    assert "testing" not in str(err.value)  # never the secret (nor the key id) in a message
    s3_err = translate(store_err.value, operation="list checkpoints")
    assert type(s3_err) is AuthError and "InvalidAccessKeyId" in str(s3_err)


def test_no_credentials_at_all_is_an_auth_error(aws_env, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    p = AwsSpotProvider(region=REGION, endpoint_url=aws_env, state_dir=tmp_path, max_attempts=1)
    with pytest.raises(AuthError) as err:
        p.price_feed()
    assert err.value.retryable is False and "NoCredentialsError" in str(err.value)


def test_a_closed_port_is_a_retryable_network_error(aws_env, tmp_path):
    p = AwsSpotProvider(region=REGION, endpoint_url=f"http://127.0.0.1:{closed_port()}", state_dir=tmp_path,
                        max_attempts=1)
    with pytest.raises(NetworkError) as err:
        p.list_offers()
    assert err.value.retryable is True
    assert "EndpointConnectionError" in str(err.value) and "describe_instance_types" in str(err.value)


def test_a_silent_server_is_a_retryable_read_timeout(aws_env):
    import boto3

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    ec2 = boto3.session.Session().client(
        "ec2", region_name=REGION, endpoint_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
        config=Config(read_timeout=0.3, connect_timeout=1, retries={"mode": "standard", "max_attempts": 1}))
    try:
        with pytest.raises(NetworkError) as err, aws_errors("describe_instances"):
            ec2.describe_instances()
    finally:
        listener.close()
    assert err.value.retryable is True and isinstance(err.value.__cause__, ReadTimeoutError)
