"""moto's HTTP server as the only AWS there is: real boto3 calls over real HTTP, on loopback.

Import the fixtures into a test module (`from tests.integration.moto_fixtures import ...`);
they are not in a conftest on purpose. The server is started once per module that imports
it (session scope, but each importing module holds its own fixture object) and is shared
by the module's tests, so every test names its own bucket, tags and ids.
"""
from __future__ import annotations

import json
import logging
import socket
import urllib.request
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest

REGION = "us-east-1"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Start moto's server in a thread on a free loopback port; yields its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(moto_server, monkeypatch, tmp_path) -> str:
    """Dummy credentials and the endpoint, for this test only; nothing of a real account is read."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never probe a real instance role
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    return moto_server


def client(service: str, url: str):
    import boto3

    return boto3.session.Session().client(service, region_name=REGION, endpoint_url=url)


@pytest.fixture
def s3_bucket(aws_env) -> str:
    """A fresh bucket on the moto server."""
    name = f"orbit-test-{uuid.uuid4().hex[:12]}"
    client("s3", aws_env).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def moto_ami(moto_server) -> str:
    """A Deep Learning AMI id as moto knows it (it ships a snapshot of Amazon's public images)."""
    import boto3

    ec2 = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing").client(
        "ec2", region_name=REGION, endpoint_url=moto_server)
    images = ec2.describe_images(Owners=["amazon"], Filters=[{"Name": "name", "Values": ["Deep Learning AMI*"]}])
    return sorted(i["ImageId"] for i in images["Images"])[0]


@pytest.fixture
def ami(aws_env, moto_ami) -> str:
    return moto_ami


@contextmanager
def moto_auth(url: str) -> Iterator[None]:
    """Turn on moto's IAM authentication: requests signed with unknown keys are refused, as AWS does."""
    def reset(value: str) -> str:
        # text/plain: with urllib's default form type, the server parses the body away.
        req = urllib.request.Request(url + "/moto-api/reset-auth", data=value.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return str(json.loads(resp.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])

    previous = reset("0")
    try:
        yield
    finally:
        reset(previous if previous not in ("", "None") else "inf")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
