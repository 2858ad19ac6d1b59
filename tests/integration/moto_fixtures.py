"""moto's HTTP server as the only AWS there is: real boto3 calls over real HTTP, on loopback.

Import the fixtures into a test module (`from tests.integration.moto_fixtures import ...`);
they are not in a conftest on purpose. The server is started once per module that imports
it (session scope, but each importing module holds its own fixture object) and is shared
by the module's tests, so every test names its own bucket, tags and ids.

moto runs no machine. `ec2_host` stands in for what EC2 and cloud-init do on a real
network: for the instance orbit launched, a real sshd on loopback with the host key from
that instance's user-data and the key pair's public key as EC2 reports it, up while EC2
says the instance runs; and an instance metadata service (IMDSv2, a notice on demand).
"""
from __future__ import annotations

import getpass
import json
import logging
import socket
import sys
import threading
import urllib.request
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
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


class MetadataStandIn:
    """The instance metadata service on loopback, IMDSv2 only (as orbit launches instances):
    a GET without a token from `PUT /latest/api/token` gets 401; the spot notice and the
    rebalance recommendation on demand (404 until set)."""

    def __init__(self):
        self.notice: dict | None = None
        self.rebalance: dict | None = None
        self.tokens: set[str] = set()
        self.refused = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):  # noqa: N802 - http.server's name
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._reply(400, b"")
                token = uuid.uuid4().hex
                stand_in.tokens.add(token)
                self._reply(200, token.encode())

            def do_GET(self):  # noqa: N802
                if self.headers.get("X-aws-ec2-metadata-token") not in stand_in.tokens:
                    stand_in.refused += 1
                    return self._reply(401, b"Unauthorized")
                body = {"/latest/meta-data/spot/instance-action": stand_in.notice,
                        "/latest/meta-data/events/recommendations/rebalance": stand_in.rebalance}.get(self.path)
                self._reply(200, json.dumps(body).encode()) if body else self._reply(404, b"Not Found")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def at(seconds: float) -> str:
        """IMDS's time format, `seconds` from now."""
        from datetime import datetime, timedelta, timezone

        return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def schedule(self, *, in_seconds: float = 120, action: str = "terminate") -> dict:
        self.notice = {"action": action, "time": self.at(in_seconds)}
        return self.notice

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Ec2HostStandIn:
    """Serves the newest running instance orbit launched (tag orbit/managed-by) on one loopback
    port: an sshd with the host key from its user-data and the key pair's public key, as
    cloud-init installs them; stopped when EC2 says the instance no longer runs. A new
    instance comes up with no notice on its metadata service. `impostor=True`: the sshd
    presents another host key (a man in the middle)."""

    def __init__(self, url: str, root: Path, metadata: MetadataStandIn, workdir: Path):
        from tests.integration.sshd import free_port

        self.url, self.root, self.metadata, self.workdir = url, root, metadata, workdir
        self.port = free_port()
        self.impostor = False
        self.served: list[str] = []
        self.errors: list[str] = []
        self._current: tuple[str, object] | None = None
        self._stop = threading.Event()
        self._ec2 = client("ec2", url)
        self._thread = threading.Thread(target=self._run, name="ec2-host-stand-in", daemon=True)
        self._thread.start()

    @property
    def provider_kwargs(self) -> dict:
        """What an operator would configure, pointed at the stand-in (for AwsSpotProvider(...))."""
        return {"ssh_endpoint": f"127.0.0.1:{self.port}", "ssh_user": getpass.getuser(), "python": sys.executable,
                "workdir": str(self.workdir), "ssh_cidrs": ("127.0.0.1/32",), "metadata_url": self.metadata.url,
                "terminate_grace_s": 10.0, "boot_timeout_s": 60.0}

    def environment(self) -> dict[str, str]:
        """The same, as the ORBIT_AWS_* variables `Settings.from_env` reads."""
        k = self.provider_kwargs
        return {"ORBIT_AWS_SSH_ENDPOINT": k["ssh_endpoint"], "ORBIT_AWS_SSH_USER": k["ssh_user"],
                "ORBIT_AWS_PYTHON": k["python"], "ORBIT_AWS_WORKDIR": k["workdir"],
                "ORBIT_AWS_SSH_CIDR": "127.0.0.1/32", "ORBIT_AWS_METADATA_URL": k["metadata_url"],
                "ORBIT_AWS_TERMINATE_GRACE_S": "10", "ORBIT_AWS_BOOT_TIMEOUT_S": "60"}

    @property
    def serving(self) -> str | None:
        return self._current[0] if self._current else None

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - reported by the tests through `errors`
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        reservations = self._ec2.describe_instances(Filters=[
            {"Name": "tag:orbit/managed-by", "Values": ["orbit-dagster"]},
            {"Name": "instance-state-name", "Values": ["running"]}])["Reservations"]
        running = sorted((i for r in reservations for i in r["Instances"]), key=lambda i: (i["LaunchTime"], i["InstanceId"]))
        newest = running[-1]["InstanceId"] if running else None
        if self._current and self._current[0] != newest:
            self._current[1].stop()  # the machine went with its instance
            self._current = None
        if newest and self._current is None:
            self._current = (newest, self._boot(running[-1]))
            self.served.append(newest)

    def _boot(self, inst: dict):
        import base64

        from orbit_dagster.providers.aws.bootstrap import host_key_from_user_data, new_ed25519
        from tests.integration.sshd import start_sshd

        data = self._ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")
        host_key = host_key_from_user_data(base64.b64decode(data["UserData"]["Value"]).decode())
        if self.impostor:
            host_key = new_ed25519("impostor")
        pair = self._ec2.describe_key_pairs(KeyNames=[inst["KeyName"]], IncludePublicKey=True)["KeyPairs"][0]
        self.metadata.notice = None
        return start_sshd(self.root / inst["InstanceId"], host_key=host_key.private_openssh,
                          authorized_key=pair["PublicKey"], port=self.port)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._current:
            self._current[1].stop()
            self._current = None


@pytest.fixture
def ec2_host(aws_env, tmp_path) -> Iterator[Ec2HostStandIn]:
    """The stand-in machine (sshd + metadata service) for the instances a test launches."""
    from tests.integration.conftest import kill_workloads_under
    from tests.integration.sshd import sshd_missing_reason

    reason = sshd_missing_reason()
    if reason:
        pytest.skip(reason)
    metadata = MetadataStandIn()
    host = Ec2HostStandIn(aws_env, tmp_path / "ec2-hosts", metadata, tmp_path / "instance-disk")
    try:
        yield host
    finally:
        host.close()
        metadata.close()
        kill_workloads_under(host.workdir)
