"""The `aws` provider: EC2 spot instances rented through boto3, the workload run over SSH.

provision: key pair + security group (aws_bootstrap), a host key per instance in the
user-data, one spot instance (aws_spot), its address from `describe_instances`, then SSH
to it with that host key checked (aws_host) and a lease of all its GPUs. launch / status
/ events / checkpoints / collect: the ssh_rental code path on the instance. notices: the
instance's metadata service (asked over SSH; the agent polls it too), else the spot
request status. terminate: SIGTERM + grace on the host, then `terminate_instances`; the
bill runs from EC2's LaunchTime to the stop we observed (else EC2's transition time).

Offers and prices: aws_offers. Credentials: boto3's standard chain (or a `session` the
resource layer built from an EnvVar); this module never reads or logs a secret. A real
instance reaches S3 with its instance profile; only against an endpoint that is not AWS
(moto) are the control plane's credential *names* forwarded to the host, by pipe.
"""
from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...catalog import as_utc
from ...catalog.aws import SpotPrice
from ...core.errors import NetworkError, ProviderError, ResourceNotFound
from ...core.execution import MAX_NODES, Resources
from ...core.host_contract import Checkpoint, Entry
from ...core.offers import Offer
from ..base import RENDEZVOUS_PORT, InstanceHandle, InstanceTimes, LaunchSpec, Notice, PriceTick, RunHandle, RunStatus
from ..jsonfiles import read_json, write_json
from .bootstrap import Bootstrap, new_ed25519, opens_to_everyone, user_data
from .ec2 import Ec2Api
from .ec2_catalog import AwsCatalog, is_aws_endpoint
from .errors import END_STATES, notice_from_spot_request, transition_time
from .host import IMDS_URL, SshHostTransport
from .spot import SpotApi, launch_on_demand, launch_spot, spot_request, wait_running

log = logging.getLogger(__name__)
# Names (never values) forwarded to a host only under a non-AWS endpoint, which has no instance role.
CREDENTIAL_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
RETIRE_AFTER_S = 86400.0  # an instance stopped this long ago leaves the SSH inventory


class AwsSpotProvider:
    name = "aws"
    relaunch = False  # a lease runs one workload: a group's survivors are rented anew
    notice_seconds = 120.0  # AWS's two-minute spot interruption warning

    def __init__(self, *, region: str, endpoint_url: str | None = None, state_dir: Path, session: Any = None,
                 image_id: str | None = None, s3_endpoint_url: str | None = None,
                 spot_api: SpotApi = "run_instances", key_name: str | None = None,
                 ssh_cidrs: tuple[str, ...] = (), security_group_ids: tuple[str, ...] = (),
                 subnet_id: str | None = None, instance_profile: str | None = None,
                 ssh_user: str = "ubuntu", python: str = "python3", workdir: str = "~/orbit",
                 address: str = "public", ssh_endpoint: str | None = None, metadata_url: str = IMDS_URL,
                 static_spot_prices: list[SpotPrice] | None = None, prices_are_real: bool | None = None,
                 api_poll_s: float = 5.0, max_attempts: int = 5, boot_timeout_s: float = 600.0,
                 terminate_grace_s: float = 60.0, page_size: int | None = None,
                 host_env: dict[str, str] | None = None):
        if not isinstance(region, str) or not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", region):
            raise ProviderError(f"region {region!r} is not an AWS region name", provider=self.name, field="region",
                                value=region, fix="e.g. us-east-1")
        if spot_api not in ("run_instances", "request_spot_instances"):
            raise ProviderError(f"spot_api {spot_api!r} is not supported", provider=self.name, field="spot_api",
                                value=spot_api, fix="run_instances or request_spot_instances")
        self.region, self.endpoint_url, self.spot_api = region, endpoint_url, spot_api
        self.state_dir = Path(state_dir).resolve()
        self.s3_endpoint_url = s3_endpoint_url or endpoint_url
        self.image_id, self.subnet_id, self.instance_profile = image_id, subnet_id, instance_profile
        self.api_poll_s, self.boot_timeout_s = api_poll_s, boot_timeout_s
        self.host_env = dict(host_env or {})  # plain settings for every host (never secrets)
        self.real_aws = is_aws_endpoint(endpoint_url)
        self.api = Ec2Api(region=region, endpoint_url=endpoint_url, session=session, max_attempts=max_attempts,
                          page_size=page_size)
        self.catalog = AwsCatalog(self.api, static_spot_prices=static_spot_prices, prices_are_real=prices_are_real)
        self.bootstrap = Bootstrap(self.api, self.state_dir, key_name=key_name, ssh_cidrs=tuple(ssh_cidrs),
                                   security_group_ids=tuple(security_group_ids), subnet_id=subnet_id)
        self.transport = SshHostTransport(self.state_dir, user=ssh_user, python=python, workdir=workdir,
                                          address=address, endpoint=ssh_endpoint, metadata_url=metadata_url,
                                          boot_timeout_s=boot_timeout_s, terminate_grace_s=terminate_grace_s)

    # ---- clients, offers, prices ----------------------------------------------------
    @property
    def ec2(self) -> Any:
        return self.api.client

    def gpu_instance_types(self) -> dict[str, tuple[int, float]]:
        return self.catalog.gpu_instance_types()

    def list_offers(self, resources: Resources | None = None) -> list[Offer]:
        return self.catalog.list_offers(resources)

    def price_feed(self, since: datetime | None = None, offer_ids: list[str] | None = None) -> list[PriceTick]:
        return self.catalog.price_feed(since, offer_ids)

    def group_offers(self, offer: Offer, count: int) -> list[Offer]:
        """A zonal offer's instances land in its zone (EC2 says at launch whether it has room); a
        regional one could land in several zones, so it holds a group of one."""
        return [offer] * min(count, MAX_NODES if offer.zone else 1)

    def find_instances(self, tags: dict[str, str], states: tuple[str, ...] = ("pending", "running")) -> list[dict]:
        return self.api.find_instances(tags, states)

    # ---- what we remember of each instance (billing when EC2 has forgotten it) ----------
    def _record_path(self, instance_id: str) -> Path:
        return self.state_dir / "instances" / f"{instance_id}.json"

    def _record(self, instance_id: str) -> dict:
        return read_json(self._record_path(instance_id)) or {}

    def _remember(self, instance_id: str, **changes: Any) -> None:
        path = self._record_path(instance_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {**self._record(instance_id), **changes})

    def _retired(self) -> tuple[str, ...]:
        """Instances stopped more than a day ago: nothing will read from them again."""
        cutoff = time.time() - RETIRE_AFTER_S
        return tuple(p.stem for p in sorted((self.state_dir / "instances").glob("i-*.json"))
                     if (read_json(p) or {}).get("stopped_at", cutoff + 1) < cutoff)

    # ---- provision -------------------------------------------------------------------
    def check(self) -> None:
        """Everything that can be refused before any API call rents anything."""
        if not self.image_id:
            raise ProviderError("no AMI to launch", provider=self.name, field="image_id", value=None,
                                fix="set ORBIT_AWS_IMAGE_ID to a GPU AMI with Python + torch (an AWS Deep Learning AMI)")
        if not self.real_aws and self.transport.endpoint is None:
            # A fake endpoint's instances are records with made-up addresses: never dial them.
            raise ProviderError(f"EC2 endpoint {self.endpoint_url} is not AWS: its instances have no machine at "
                                f"their addresses", provider=self.name, field="ssh_endpoint", value=None,
                                fix="set ORBIT_AWS_SSH_ENDPOINT to the host:port that stands in for the instance")
        self.bootstrap.check()

    def _tags(self, offer: Offer, tags: dict[str, str]) -> list[dict]:
        merged = {"orbit/managed-by": "orbit-dagster", "orbit/offer": offer.offer_id, **tags}
        merged.setdefault("Name", "orbit " + " ".join(f"{k.split('/')[-1]}={v}" for k, v in tags.items()))
        for k, v in merged.items():
            if k.lower().startswith("aws:") or not 0 < len(k) <= 128 or len(str(v)) > 256:
                raise ProviderError(f"tag {k!r}={v!r} is not a valid EC2 tag", provider=self.name, field="tags",
                                    value=k, fix="keys of 1-128 characters not starting with 'aws:'; values <= 256")
        return [{"Key": k, "Value": str(v)[:256]} for k, v in merged.items()]

    def _launch_spec(self, offer: Offer, key_name: str, groups: tuple[str, ...], data: str) -> dict:
        spec: dict[str, Any] = {"ImageId": self.image_id, "InstanceType": offer.instance_type, "KeyName": key_name,
                                "SecurityGroupIds": list(groups), "UserData": data}
        if offer.zone:
            spec["Placement"] = {"AvailabilityZone": self.api.zone_names().get(offer.zone, offer.zone)}
        if self.subnet_id:
            spec["SubnetId"] = self.subnet_id
        if self.instance_profile:
            spec["IamInstanceProfile"] = {"Name": self.instance_profile}
        return spec

    def provision(self, offer: Offer, *, tags: dict[str, str]) -> InstanceHandle:
        if offer.provider != "aws" or offer.region != self.region:
            raise ProviderError(f"offer {offer.offer_id} ({offer.provider}, {offer.region}) is not an aws offer in "
                                f"{self.region}", provider=self.name, field="offer", value=offer.offer_id,
                                fix="choose among this provider's list_offers()")
        self.check()
        tag_list = self._tags(offer, tags)
        access = self.bootstrap.ensure()
        if not self.bootstrap.security_group_ids and opens_to_everyone(self.bootstrap.ssh_cidrs):
            log.warning("aws: the instances' SSH port is open to the whole internet (ORBIT_AWS_SSH_CIDR)")
        host_key = new_ed25519(f"orbit-host {tags.get('orbit/job', '')}".strip())
        spec = self._launch_spec(offer, access.key_name, access.security_group_ids, user_data(host_key))
        inst, request_id = (launch_spot(self.api, spec, tag_list, spot_api=self.spot_api, wait_s=self.boot_timeout_s,
                                        poll_s=self.api_poll_s) if offer.spot else
                            launch_on_demand(self.api, spec, tag_list))
        iid = inst["InstanceId"]
        self._remember(iid, launched_at=as_utc(inst["LaunchTime"]).timestamp() if inst.get("LaunchTime") else None,
                       offer=offer.offer_id, spot_request_id=request_id)
        try:
            inst = wait_running(self.api, iid, timeout_s=self.boot_timeout_s, poll_s=self.api_poll_s)
            self.transport.register(inst, offer, host_key.public_line, access.key_file, retire=self._retired())
            address, slots = self.transport.boot(iid, offer, {t["Key"]: t["Value"] for t in tag_list})
        except BaseException:
            try:
                self._terminate_api(iid, "boot failed")  # never leave a billed instance behind
            except ProviderError:
                pass  # the boot error is the one to report; find_instances(tags) finds a leftover
            raise
        started = as_utc(inst["LaunchTime"])
        self._remember(iid, launched_at=started.timestamp())
        return InstanceHandle(provider=self.name, instance_id=iid, offer=offer, started_at=started, gpu_slots=slots,
                              address={**address, "region": self.region, "spot_request_id": request_id,
                                       "private_ip": inst.get("PrivateIpAddress"),
                                       "zone": (inst.get("Placement") or {}).get("AvailabilityZone", ""),
                                       "spot_api": self.spot_api, "key_name": access.key_name})

    # ---- the meter -------------------------------------------------------------------
    def _state(self, instance_id: str, max_age_s: float = 0.0) -> tuple[dict | None, str]:
        inst = self.api.describe(instance_id, max_age_s=max_age_s)
        return inst, (inst or {}).get("State", {}).get("Name", "gone")

    def _terminate_api(self, instance_id: str, reason: str) -> None:
        self.api.call("terminate_instances", InstanceIds=[instance_id])
        self.api.forget(instance_id)
        self._remember(instance_id, stopped_at=time.time(), reason=reason)

    def instance_alive(self, instance: InstanceHandle) -> bool:
        """Whether the meter runs: EC2 says pending/running (even if the host stopped answering)."""
        return self._state(instance.instance_id)[1] in ("pending", "running")

    def instance_times(self, instance: InstanceHandle) -> InstanceTimes:
        inst, rec = self.api.describe(instance.instance_id), self._record(instance.instance_id)
        if inst is None and not rec:
            raise ResourceNotFound(f"aws instance {instance.instance_id} is unknown to EC2 and to {self.state_dir}",
                                   provider=self.name, field="instance_id", value=instance.instance_id,
                                   fix="check the region and the endpoint")
        started = as_utc(inst["LaunchTime"]) if inst else datetime.fromtimestamp(rec["launched_at"], timezone.utc)
        if inst is not None and inst["State"]["Name"] in ("pending", "running"):
            return InstanceTimes(started_at=started)
        # Our own observation of the terminate call first (sub-second); else EC2's transition time.
        stopped = datetime.fromtimestamp(rec["stopped_at"], timezone.utc) if rec.get("stopped_at") else (
            transition_time((inst or {}).get("StateTransitionReason", "")))
        reason = rec.get("reason") or ((inst or {}).get("StateReason") or {}).get("Message")
        return InstanceTimes(started_at=started, stopped_at=stopped or datetime.now(timezone.utc), reason=reason)

    def terminate(self, instance: InstanceHandle, reason: str) -> InstanceTimes:
        """SIGTERM + grace on the host (the agent checkpoints), then EC2 terminates; idempotent."""
        inst, rec = self.api.describe(instance.instance_id), self._record(instance.instance_id)
        already = inst is not None and inst["State"]["Name"] in END_STATES
        if not already and not rec.get("stopped_at"):
            if self.transport.knows(instance):
                try:
                    self.transport.stop(instance, reason)
                except ProviderError as exc:  # an unreachable host must not keep the meter running
                    log.warning("aws: could not stop the workload on %s before terminating it: %s",
                                instance.instance_id, exc)
            self._terminate_api(instance.instance_id, reason)  # unknown id: ResourceNotFound
        return self.instance_times(instance)

    # ---- notices -------------------------------------------------------------------------
    def spot_request(self, instance: InstanceHandle) -> dict | None:
        rid = instance.address.get("spot_request_id") or self._record(instance.instance_id).get("spot_request_id")
        return spot_request(self.api, instance.instance_id, rid)

    def notices(self, instance: InstanceHandle) -> list[Notice]:
        """The instance's metadata service first (the exact deadline), else the spot request status."""
        _, state = self._state(instance.instance_id, self.api_poll_s)
        if state in ("pending", "running") and self.transport.knows(instance):
            found = self.transport.notices(instance)
            if found:
                return found
        request = self.spot_request(instance)
        notice = notice_from_spot_request(instance.instance_id, request, instance_state=state) if request else None
        return [notice] if notice else []

    # ---- workloads -------------------------------------------------------------------------
    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle:
        env = {**self.host_env, **spec.env, "AWS_DEFAULT_REGION": self.region,
               "ORBIT_METADATA_URL": self.transport.metadata_url}  # the agent polls it for notices
        secret = tuple(spec.secret_env)
        if not self.real_aws:  # no instance role behind a fake endpoint: the names travel, values by pipe
            secret += tuple(n for n in CREDENTIAL_NAMES if n not in secret)
            if self.s3_endpoint_url:
                env.setdefault("AWS_ENDPOINT_URL_S3", self.s3_endpoint_url)
        run = self.transport.launch(instance, bundle_dir, spec.model_copy(update={"env": env, "secret_env": secret}))
        return run.model_copy(update={"provider": self.name})

    def rendezvous_endpoint(self, instance: InstanceHandle) -> str:
        """The instance's private address (a group's nodes share its zone and VPC) and torchrun's
        default c10d port; the security group must let the group's nodes reach each other there."""
        return f"{instance.address.get('private_ip') or instance.address['hostname']}:{RENDEZVOUS_PORT}"

    def status(self, run: RunHandle) -> RunStatus:
        """The host's view while EC2 says the instance runs; `lost` once EC2 has ended it."""
        inst, state = self._state(run.instance.instance_id, self.api_poll_s)
        if state in ("pending", "running"):
            return self.transport.status(run)
        request = self.spot_request(run.instance)
        code = ((request or {}).get("Status") or {}).get("Code", "")
        why = code or ((inst or {}).get("StateReason") or {}).get("Message") or f"instance {state}"
        return RunStatus(state="lost", failure_class="reclaim", reason=f"aws instance {state}: {why}")

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[Entry], int]:
        try:
            return self.transport.read_events(run, offset)
        except NetworkError:
            if self.instance_alive(run.instance):
                raise  # out of reach for now: the follower retries
            return [], offset  # the machine is gone with its disk: nothing more will come

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str:
        return self.transport.logs(run, tail_lines)

    def collect(self, run: RunHandle, dest: Path) -> list[Path]:
        return self.transport.collect(run, dest)

    def reattach(self, run: RunHandle) -> RunHandle | None:
        if not self.transport.knows(run.instance) or not self.instance_alive(run.instance):
            return None
        return self.transport.reattach(run)

    # ---- checkpoints: S3 written by the host; an fs store's files cross over SFTP ------------
    def localize_checkpoint(self, run: RunHandle, event: Checkpoint, store_uri: str) -> Checkpoint:
        return self.transport.localize_checkpoint(run, event, store_uri)

    def stage_checkpoint(self, instance: InstanceHandle, uri: str) -> str:
        return self.transport.stage_checkpoint(instance, uri)

    def host_store_uri(self, instance: InstanceHandle, store_uri: str) -> str:
        return self.transport.host_store_uri(instance, store_uri)
