"""The `aws` provider: EC2 spot instances rented through boto3, the workload run by a host transport.

Real on any endpoint (AWS or moto): every EC2 call (run_instances with spot market options
or request_spot_instances, tags, describe, terminate), pagination, the spot-request status
mapping, spot price history ingestion, describe_instance_types joined with the catalog,
billing times from LaunchTime and the observed stop. What runs on the machine is the host
transport's business (see local_host.py): under moto it is played on this machine.

Credentials: only boto3's standard chain (or a `session` the resource layer built from an
EnvVar); this module never reads or logs a secret. A played host gets credential *names*
to forward (LaunchSpec.secret_env); a real instance uses its instance role.
"""
from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from ..catalog import as_utc
from ..catalog.aws import AWS_GPU_FAMILIES, SpotPrice, aws_offers, is_gpu_instance_type
from ..core.errors import NoCapacity, ProviderError, ResourceNotFound
from ..core.execution import Resources
from ..core.offers import Offer
from .aws_errors import END_STATES, aws_errors, notice_from_spot_request, request_status_error, spot_status, \
    transition_time
from .base import InstanceHandle, InstanceTimes, LaunchSpec, Notice, PriceTick, RunHandle, RunStatus
from .local_host import HostTransport, LocalHostTransport
from .common import offer_fits
from .jsonfiles import read_json as _read_json
from .jsonfiles import write_json

# Names (never values) a played host may forward from this process's environment.
CREDENTIAL_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
SPOT_LAUNCHED = datetime(2009, 11, 30, tzinfo=timezone.utc)  # no real spot price predates EC2 spot
PRODUCTS = ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]
TYPES_TTL_S = 3600.0


def is_aws_endpoint(url: str | None) -> bool:
    """True for AWS itself (no override, or an *.amazonaws.com / *.api.aws host); False for moto & co."""
    if not url:
        return True
    host = urlparse(url).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn", ".api.aws"))


class AwsSpotProvider:
    name = "aws"
    notice_seconds = 120.0  # AWS's two-minute spot interruption warning

    def __init__(self, *, region: str, endpoint_url: str | None = None, state_dir: Path,
                 transport: HostTransport | None = None, session: Any = None, image_id: str | None = None,
                 s3_endpoint_url: str | None = None,
                 spot_api: Literal["run_instances", "request_spot_instances"] = "run_instances",
                 key_name: str | None = None, security_group_ids: tuple[str, ...] = (), subnet_id: str | None = None,
                 instance_profile: str | None = None, static_spot_prices: list[SpotPrice] | None = None,
                 prices_are_real: bool | None = None, api_poll_s: float = 5.0, max_attempts: int = 5,
                 boot_timeout_s: float = 600.0, page_size: int | None = None,
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
        self.image_id, self.key_name, self.subnet_id = image_id, key_name, subnet_id
        self.security_group_ids, self.instance_profile = tuple(security_group_ids), instance_profile
        self.static_spot_prices = list(static_spot_prices or [])
        self.prices_are_real = is_aws_endpoint(endpoint_url) if prices_are_real is None else prices_are_real
        self.api_poll_s, self.max_attempts, self.boot_timeout_s = api_poll_s, max_attempts, boot_timeout_s
        self.page_size = page_size
        self.host_env = dict(host_env or {})  # plain settings for every host (never secrets)
        # Under a non-AWS endpoint (moto) the machine is played here; real AWS needs a real transport.
        if transport is None and not is_aws_endpoint(endpoint_url):
            transport = LocalHostTransport(self.state_dir / "hosts")
        self.transport = transport
        self._session, self._ec2 = session, None
        self._types: tuple[float, dict[str, tuple[int, float]]] | None = None
        self._zones: dict[str, str] | None = None
        self._live_prices: dict[tuple[str, str], SpotPrice] = {}
        self._seen: dict[str, tuple[float, dict | None]] = {}

    # ---- clients ------------------------------------------------------------------
    @property
    def ec2(self) -> Any:
        if self._ec2 is None:
            import boto3
            from botocore.config import Config

            session = self._session or boto3.session.Session()
            config = Config(retries={"mode": "standard", "max_attempts": self.max_attempts}, connect_timeout=10,
                            read_timeout=60, user_agent_extra="orbit-dagster")
            self._ec2 = session.client("ec2", region_name=self.region, endpoint_url=self.endpoint_url, config=config)
        return self._ec2

    def _pages(self, operation: str, key: str, **kw: Any) -> list[dict]:
        """Every item of a paginated EC2 call (the adapter pages; callers see one list)."""
        paging = {"PageSize": self.page_size} if self.page_size else {}
        with aws_errors(operation):
            return [item for page in self.ec2.get_paginator(operation).paginate(**kw, PaginationConfig=paging)
                    for item in page.get(key, ())]

    def _zone_names(self) -> dict[str, str]:
        """AZ id (use1-az2, the same in every account) -> zone name (us-east-1a, per account)."""
        if self._zones is None:
            with aws_errors("describe_availability_zones"):
                zones = self.ec2.describe_availability_zones()["AvailabilityZones"]
            self._zones = {z["ZoneId"]: z["ZoneName"] for z in zones if z.get("ZoneId")}
        return self._zones

    # ---- offers and prices ----------------------------------------------------------
    def gpu_instance_types(self) -> dict[str, tuple[int, float]]:
        """GPU instance types EC2 reports in this region: type -> (GPUs, GiB per GPU), from GpuInfo."""
        if self._types is None or time.time() - self._types[0] > TYPES_TTL_S:
            found = {}
            patterns = sorted(f"{family}.*" for family in AWS_GPU_FAMILIES)
            for it in self._pages("describe_instance_types", "InstanceTypes",
                                  Filters=[{"Name": "instance-type", "Values": patterns}]):
                gpus = (it.get("GpuInfo") or {}).get("Gpus") or []
                if not gpus or not is_gpu_instance_type(it["InstanceType"]):
                    continue
                count = sum(int(g.get("Count", 0)) for g in gpus)
                gib = float((gpus[0].get("MemoryInfo") or {}).get("SizeInMiB", 0)) / 1024
                found[it["InstanceType"]] = (count, gib)
            self._types = (time.time(), found)
        return self._types[1]

    def list_offers(self, resources: Resources | None = None) -> list[Offer]:
        """Catalog offers (advisor bands, specs, prices) for the GPU types EC2 reports here.

        Prices: real spot price history ingested by `price_feed`, and `static_spot_prices`;
        moto's placeholder prices are never used. An unpriced offer costs 0 and ranks by id.
        """
        types = self.gpu_instance_types()
        out = []
        for offer in aws_offers(spot_prices=[*self._live_prices.values(), *self.static_spot_prices]):
            if offer.region != self.region or offer.instance_type not in types:
                continue
            offer = _join_shape(offer, *types[offer.instance_type])
            if resources is None or offer_fits(offer, resources):
                out.append(offer)
        return out

    def price_feed(self, since: datetime | None = None, offer_ids: list[str] | None = None) -> list[PriceTick]:
        """Spot price history of this region's GPU types (or of `offer_ids`) since `since` (default: 3 h).

        Ticks from a non-AWS endpoint, or dated before EC2 spot existed, are labelled
        placeholders in `source` and are not used to price offers.
        """
        start = as_utc(since) if since else datetime.now(timezone.utc) - timedelta(hours=3)
        wanted = set(offer_ids) if offer_ids is not None else None
        types = sorted(t for t in self.gpu_instance_types()
                       if wanted is None or any(o.split(":")[1:2] == [t] for o in wanted))
        if not types:
            return []
        zone_ids = {name: zid for zid, name in self._zone_names().items()}
        ticks = []
        for row in self._pages("describe_spot_price_history", "SpotPriceHistory", InstanceTypes=types,
                               ProductDescriptions=PRODUCTS, StartTime=start):
            zone_id = row.get("AvailabilityZoneId") or zone_ids.get(row.get("AvailabilityZone", ""))
            itype, ts, usd = row["InstanceType"], as_utc(row["Timestamp"]), float(row["SpotPrice"])
            offer_id = f"aws:{itype}:{zone_id}"
            if not zone_id or (wanted is not None and offer_id not in wanted and f"aws:{itype}:{self.region}"
                                                                             not in wanted):
                continue
            real = self.prices_are_real and ts >= SPOT_LAUNCHED
            source = "aws:describe_spot_price_history" if real else (
                f"placeholder:describe_spot_price_history from {self.endpoint_url} (not a real price; not used)")
            ticks.append(PriceTick(offer_id=offer_id, ts=ts, usd_per_hour_spot=usd, source=source))
            key = (zone_id, itype)
            if real and (key not in self._live_prices or self._live_prices[key].timestamp <= ts):
                self._live_prices[key] = SpotPrice(zone_id, itype, "Linux/UNIX", usd, ts)
        return ticks

    # ---- instances ------------------------------------------------------------------
    def _record_path(self, instance_id: str) -> Path:
        return self.state_dir / "instances" / f"{instance_id}.json"

    def _record(self, instance_id: str) -> dict:
        return _read_json(self._record_path(instance_id)) or {}

    def _remember(self, instance_id: str, **changes: Any) -> None:
        path = self._record_path(instance_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {**self._record(instance_id), **changes})

    def _describe(self, instance_id: str, *, max_age_s: float = 0.0) -> dict | None:
        """The instance as EC2 sees it now (None once EC2 has forgotten it); cached `max_age_s`."""
        seen = self._seen.get(instance_id)
        if seen is not None and time.time() - seen[0] <= max_age_s:
            return seen[1]
        try:
            with aws_errors("describe_instances"):
                reservations = self.ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
            found = next((i for r in reservations for i in r["Instances"]), None)
        except ResourceNotFound:
            found = None
        self._seen[instance_id] = (time.time(), found)
        return found

    def find_instances(self, tags: dict[str, str], states: tuple[str, ...] = ("pending", "running")) -> list[dict]:
        """Instances carrying all `tags` (paginated): how a sweep finds what a crashed run rented."""
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in tags.items()]
        filters.append({"Name": "instance-state-name", "Values": list(states)})
        reservations = self._pages("describe_instances", "Reservations", Filters=filters)
        return [i for r in reservations for i in r["Instances"]]

    def _require_transport(self) -> HostTransport:
        if self.transport is None:
            raise ProviderError("the aws provider has no host transport to run the workload on the instance",
                                provider=self.name, field="transport", value=None,
                                fix="pass transport= (an SSH transport for real AWS; LocalHostTransport under moto)")
        return self.transport

    def _tags(self, offer: Offer, tags: dict[str, str]) -> list[dict]:
        merged = {"orbit/managed-by": "orbit-dagster", "orbit/offer": offer.offer_id, **tags}
        merged.setdefault("Name", "orbit " + " ".join(f"{k.split('/')[-1]}={v}" for k, v in tags.items()))
        for k, v in merged.items():
            if k.lower().startswith("aws:") or not 0 < len(k) <= 128 or len(str(v)) > 256:
                raise ProviderError(f"tag {k!r}={v!r} is not a valid EC2 tag", provider=self.name, field="tags",
                                    value=k, fix="keys of 1-128 characters not starting with 'aws:'; values <= 256")
        return [{"Key": k, "Value": str(v)[:256]} for k, v in merged.items()]

    def _launch_spec(self, offer: Offer) -> dict:
        if not self.image_id:
            raise ProviderError("no AMI to launch", provider=self.name, field="image_id", value=None,
                                fix="pass image_id= (a GPU AMI with Python, e.g. an AWS Deep Learning AMI id)")
        spec: dict[str, Any] = {"ImageId": self.image_id, "InstanceType": offer.instance_type}
        if offer.zone:
            spec["Placement"] = {"AvailabilityZone": self._zone_names().get(offer.zone, offer.zone)}
        optional = {"KeyName": self.key_name, "SecurityGroupIds": list(self.security_group_ids),
                    "SubnetId": self.subnet_id,
                    "IamInstanceProfile": {"Name": self.instance_profile} if self.instance_profile else None}
        return {**spec, **{k: v for k, v in optional.items() if v}}

    def _run_instances(self, offer: Offer, tags: list[dict]) -> tuple[dict, str | None]:
        market = {"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time",
                                                        "InstanceInterruptionBehavior": "terminate"}}
        with aws_errors("run_instances"):
            inst = self.ec2.run_instances(**self._launch_spec(offer), MinCount=1, MaxCount=1,
                                          InstanceMarketOptions=market, TagSpecifications=[
                                              {"ResourceType": "instance", "Tags": tags},
                                              {"ResourceType": "volume", "Tags": tags}])["Instances"][0]
        return inst, inst.get("SpotInstanceRequestId")

    def _request_spot(self, offer: Offer, tags: list[dict]) -> tuple[dict, str | None]:
        with aws_errors("request_spot_instances"):
            req = self.ec2.request_spot_instances(
                InstanceCount=1, Type="one-time", LaunchSpecification=self._launch_spec(offer),
                TagSpecifications=[{"ResourceType": "spot-instances-request", "Tags": tags}])["SpotInstanceRequests"][0]
        rid, deadline = req["SpotInstanceRequestId"], time.time() + min(self.boot_timeout_s, 120)
        while not req.get("InstanceId"):
            status = req.get("Status") or {}
            if spot_status(status.get("Code", "")).kind in ("holding", "closed") or time.time() > deadline:
                with aws_errors("cancel_spot_instance_requests"):
                    self.ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=[rid])
                raise request_status_error(status.get("Code", "timeout"), status.get("Message", ""),
                                           operation="request_spot_instances")
            time.sleep(min(2.0, max(self.api_poll_s, 0.05)))
            with aws_errors("describe_spot_instance_requests"):
                req = self.ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[rid])["SpotInstanceRequests"][0]
        with aws_errors("create_tags"):  # spot requests do not pass their tags on to the instance
            self.ec2.create_tags(Resources=[req["InstanceId"]], Tags=tags)
        return self._describe(req["InstanceId"]) or {"InstanceId": req["InstanceId"]}, rid

    def _wait_running(self, instance_id: str) -> dict:
        # EC2 is eventually consistent: a new instance may be "not found" for a few seconds.
        deadline = time.time() + self.boot_timeout_s
        while True:
            inst = self._describe(instance_id)
            state = (inst or {}).get("State", {}).get("Name")
            if state == "running":
                return inst
            if state in END_STATES or time.time() > deadline:
                reason = ((inst or {}).get("StateReason") or {}).get("Message") or f"state {state}"
                raise NoCapacity(f"aws instance {instance_id} did not start: {reason}", provider=self.name,
                                 fix="try another offer; capacity for this one may be gone")
            time.sleep(min(2.0, max(self.api_poll_s, 0.05)))

    def provision(self, offer: Offer, *, tags: dict[str, str]) -> InstanceHandle:
        if offer.provider != "aws" or offer.region != self.region:
            raise ProviderError(f"offer {offer.offer_id} ({offer.provider}, {offer.region}) is not an aws offer in "
                                f"{self.region}", provider=self.name, field="offer", value=offer.offer_id,
                                fix="choose among this provider's list_offers()")
        transport = self._require_transport()
        tag_list = self._tags(offer, tags)
        if self.spot_api == "run_instances":
            inst, request_id = self._run_instances(offer, tag_list)
        else:
            inst, request_id = self._request_spot(offer, tag_list)
        iid = inst["InstanceId"]
        self._remember(iid, launched_at=as_utc(inst["LaunchTime"]).timestamp() if inst.get("LaunchTime") else None,
                       offer=offer.offer_id, spot_request_id=request_id)
        try:
            inst = self._wait_running(iid)
            address = transport.boot(iid, offer, {t["Key"]: t["Value"] for t in tag_list})
        except BaseException:
            try:
                self._terminate_api(iid, "boot failed")  # never leave a billed instance behind
            except ProviderError:
                pass  # the boot error is the one to report; find_instances(tags) finds a leftover
            raise
        started = as_utc(inst["LaunchTime"])
        self._remember(iid, launched_at=started.timestamp())
        return InstanceHandle(provider=self.name, instance_id=iid, offer=offer, started_at=started, address={
            **address, "region": self.region, "zone": (inst.get("Placement") or {}).get("AvailabilityZone", ""),
            "spot_request_id": request_id, "spot_api": self.spot_api})

    def _terminate_api(self, instance_id: str, reason: str) -> None:
        with aws_errors("terminate_instances"):
            self.ec2.terminate_instances(InstanceIds=[instance_id])
        self._seen.pop(instance_id, None)
        self._remember(instance_id, stopped_at=time.time(), reason=reason)

    def instance_alive(self, instance: InstanceHandle) -> bool:
        """Whether the meter runs: EC2 says pending/running (even if the host stopped answering)."""
        inst = self._describe(instance.instance_id)
        return inst is not None and inst["State"]["Name"] in ("pending", "running")

    def instance_times(self, instance: InstanceHandle) -> InstanceTimes:
        inst, rec = self._describe(instance.instance_id), self._record(instance.instance_id)
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
        inst, rec = self._describe(instance.instance_id), self._record(instance.instance_id)
        already = inst is not None and inst["State"]["Name"] in END_STATES
        if self.transport is not None and self.transport.knows(instance):
            self.transport.stop(instance, reason)  # what EC2's terminate does to the machine: SIGTERM, power off
        if not already and not rec.get("stopped_at"):
            self._terminate_api(instance.instance_id, reason)  # unknown id: ResourceNotFound
        return self.instance_times(instance)

    def spot_request(self, instance: InstanceHandle) -> dict | None:
        """The instance's spot request (by id, else by instance-id filter); None without one (moto's run_instances)."""
        rid = instance.address.get("spot_request_id") or self._record(instance.instance_id).get("spot_request_id")
        kw = {"SpotInstanceRequestIds": [rid]} if rid else {
            "Filters": [{"Name": "instance-id", "Values": [instance.instance_id]}]}
        try:
            found = self._pages("describe_spot_instance_requests", "SpotInstanceRequests", **kw)
        except ResourceNotFound:
            return None
        return found[0] if found else None

    def notices(self, instance: InstanceHandle) -> list[Notice]:
        """The host's metadata endpoint first (what the agent sees), else the spot request status."""
        if self.transport is not None and self.transport.knows(instance):
            found = self.transport.notices(instance)
            if found:
                return found
        request = self.spot_request(instance)
        if not request:
            return []
        inst = self._describe(instance.instance_id, max_age_s=self.api_poll_s)
        state = (inst or {}).get("State", {}).get("Name", "gone")
        notice = notice_from_spot_request(instance.instance_id, request, instance_state=state)
        return [notice] if notice else []

    def simulate_reclaim(self, instance: InstanceHandle, *, in_seconds: float,
                         notice_seconds: float | None = None) -> None:
        """Moto has no interruptions: a played host carries one out (notice, SIGTERM, disk wiped)."""
        transport = self._require_transport()
        if not hasattr(transport, "simulate_reclaim"):
            raise ProviderError("only a played host can be reclaimed on demand", provider=self.name,
                                field="transport", value=type(transport).__name__, fix="use LocalHostTransport")
        transport.simulate_reclaim(instance, in_seconds=in_seconds, notice_seconds=notice_seconds)

    # ---- workloads ------------------------------------------------------------------
    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle:
        transport = self._require_transport()
        env = {**self.host_env, **spec.env, "AWS_DEFAULT_REGION": self.region}
        if self.s3_endpoint_url and not is_aws_endpoint(self.s3_endpoint_url):
            env.setdefault("AWS_ENDPOINT_URL_S3", self.s3_endpoint_url)
        secret = tuple(spec.secret_env)
        if transport.forwards_local_credentials:
            secret += tuple(n for n in CREDENTIAL_NAMES if n not in secret)
        run = transport.launch(instance, bundle_dir, spec.model_copy(update={"env": env, "secret_env": secret}))
        return run.model_copy(update={"provider": self.name})

    def status(self, run: RunHandle) -> RunStatus:
        transport = self._require_transport()
        status = transport.status(run)
        if status.state in ("exited", "lost"):
            return status
        inst = self._describe(run.instance.instance_id, max_age_s=self.api_poll_s)
        state = (inst or {}).get("State", {}).get("Name", "gone")
        if state in ("pending", "running"):
            return status
        request = self.spot_request(run.instance)
        code = ((request or {}).get("Status") or {}).get("Code", "")
        why = code or ((inst or {}).get("StateReason") or {}).get("Message") or f"instance {state}"
        if transport.knows(run.instance) and transport.alive(run.instance):
            transport.stop(run.instance, why)  # EC2 ended it: the machine goes with it (a played one too)
        return RunStatus(state="lost", failure_class="reclaim", reason=f"aws instance {state}: {why}")

    def read_events(self, run: RunHandle, offset: int) -> tuple[list[dict], int]:
        return self._require_transport().read_events(run, offset)

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str:
        return self._require_transport().logs(run, tail_lines)

    def collect(self, run: RunHandle, dest: Path) -> list[Path]:
        return self._require_transport().collect(run, dest)

    def reattach(self, run: RunHandle) -> RunHandle | None:
        transport = self._require_transport()
        if not transport.knows(run.instance):
            return None
        return run if self.status(run).state in ("starting", "running", "exited") else None

    # ---- checkpoints ------------------------------------------------------------------
    # Hosts write straight into an S3 store; an fs store only works when the host sees our files.
    def _store_ok(self, uri: str, what: str) -> str:
        if uri.startswith("s3://") or (self.transport is not None and self.transport.shares_filesystem):
            return uri
        raise ProviderError(f"{what} {uri} is on this machine's disk, which an EC2 instance cannot read",
                            provider=self.name, field="checkpoint.store", value=uri,
                            fix="use an S3 checkpoint store: ORBIT_CHECKPOINT_STORE=s3://BUCKET/PREFIX")

    def localize_checkpoint(self, run: RunHandle, event: dict, store_uri: str) -> dict:  # noqa: ARG002
        return event

    def stage_checkpoint(self, instance: InstanceHandle, uri: str) -> str:  # noqa: ARG002
        return self._store_ok(uri, "checkpoint")

    def host_store_uri(self, instance: InstanceHandle, store_uri: str) -> str:  # noqa: ARG002
        return self._store_ok(store_uri, "checkpoint store")


def _join_shape(offer: Offer, gpus: int, gib_per_gpu: float) -> Offer:
    """EC2's GpuInfo is the truth about the shape; per-GPU prices follow a corrected count."""
    update: dict[str, Any] = {}
    if gib_per_gpu > 0:
        update["gpu_memory_gb"] = gib_per_gpu
    if gpus and gpus != offer.gpu_count:
        scale = offer.gpu_count / gpus
        update["gpu_count"] = gpus
        for f in ("usd_per_gpu_second_spot", "usd_per_gpu_second_on_demand"):
            if getattr(offer, f) is not None:
                update[f] = getattr(offer, f) * scale
    return offer.model_copy(update=update) if update else offer

