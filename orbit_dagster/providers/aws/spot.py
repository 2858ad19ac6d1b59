"""Renting one spot instance and watching its spot request: the EC2 calls, nothing on the machine.

Two ways AWS offers: `run_instances` with spot `InstanceMarketOptions` (one call, tags and
metadata options at launch), or `request_spot_instances` (a request that is fulfilled,
held or closed; its status codes are the richest reclaim signal EC2 gives, see
aws_errors.py). Either way the caller gets the instance and, if any, its request id.
"""
from __future__ import annotations

import base64
import time
from typing import Any, Literal

from ...core.errors import NoCapacity, ResourceNotFound
from .ec2 import Ec2Api
from .errors import END_STATES, request_status_error, spot_status

SpotApi = Literal["run_instances", "request_spot_instances"]
# IMDSv2 only (a token per session): a server-side request forgery on the instance cannot
# read its metadata with a plain GET. Hop limit 1: the token does not leave the host.
METADATA_OPTIONS = {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1}


def launch_on_demand(api: Ec2Api, spec: dict[str, Any], tags: list[dict]) -> tuple[dict, None]:
    """Rent one on-demand instance (a deadline the spot market can no longer meet)."""
    inst = api.call("run_instances", **spec, MinCount=1, MaxCount=1, MetadataOptions=METADATA_OPTIONS,
                    TagSpecifications=[{"ResourceType": "instance", "Tags": tags},
                                       {"ResourceType": "volume", "Tags": tags}])["Instances"][0]
    return inst, None


def launch_spot(api: Ec2Api, spec: dict[str, Any], tags: list[dict], *, spot_api: SpotApi, wait_s: float,
                poll_s: float) -> tuple[dict, str | None]:
    """Rent one spot instance from `spec` (ImageId, InstanceType, UserData, ...); returns it and its request id."""
    if spot_api == "run_instances":
        market = {"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time",
                                                        "InstanceInterruptionBehavior": "terminate"}}
        inst = api.call("run_instances", **spec, MinCount=1, MaxCount=1, InstanceMarketOptions=market,
                        MetadataOptions=METADATA_OPTIONS, TagSpecifications=[
                            {"ResourceType": "instance", "Tags": tags},
                            {"ResourceType": "volume", "Tags": tags}])["Instances"][0]
        return inst, inst.get("SpotInstanceRequestId")
    return _request_spot(api, spec, tags, wait_s=wait_s, poll_s=poll_s)


def _request_spot(api: Ec2Api, spec: dict[str, Any], tags: list[dict], *, wait_s: float,
                  poll_s: float) -> tuple[dict, str | None]:
    launch = dict(spec)
    if "UserData" in launch:  # run_instances base64-encodes for us; a spot launch specification does not
        launch["UserData"] = base64.b64encode(launch["UserData"].encode()).decode()
    req = api.call("request_spot_instances", InstanceCount=1, Type="one-time", LaunchSpecification=launch,
                   TagSpecifications=[{"ResourceType": "spot-instances-request", "Tags": tags}])[
        "SpotInstanceRequests"][0]
    rid, deadline = req["SpotInstanceRequestId"], time.time() + min(wait_s, 120)
    while not req.get("InstanceId"):
        status = req.get("Status") or {}
        if spot_status(status.get("Code", "")).kind in ("holding", "closed") or time.time() > deadline:
            api.call("cancel_spot_instance_requests", SpotInstanceRequestIds=[rid])
            raise request_status_error(status.get("Code", "timeout"), status.get("Message", ""),
                                       operation="request_spot_instances")
        time.sleep(min(2.0, max(poll_s, 0.05)))
        req = api.call("describe_spot_instance_requests", SpotInstanceRequestIds=[rid])["SpotInstanceRequests"][0]
    iid = req["InstanceId"]
    api.call("create_tags", Resources=[iid], Tags=tags)  # spot requests do not pass their tags on
    # A launch specification has no MetadataOptions: require IMDSv2 right after fulfilment.
    api.call("modify_instance_metadata_options", InstanceId=iid, **METADATA_OPTIONS)
    return api.describe(iid) or {"InstanceId": iid}, rid


def wait_running(api: Ec2Api, instance_id: str, *, timeout_s: float, poll_s: float) -> dict:
    """The instance once EC2 says `running`; NoCapacity if it ends or does not get there in time."""
    # EC2 is eventually consistent: a new instance may be "not found" for a few seconds.
    deadline = time.time() + timeout_s
    while True:
        inst = api.describe(instance_id)
        state = (inst or {}).get("State", {}).get("Name")
        if state == "running":
            return inst
        if state in END_STATES or time.time() > deadline:
            reason = ((inst or {}).get("StateReason") or {}).get("Message") or f"state {state}"
            raise NoCapacity(f"aws instance {instance_id} did not start: {reason}", provider="aws",
                             fix="try another offer; capacity for this one may be gone")
        time.sleep(min(2.0, max(poll_s, 0.05)))


def spot_request(api: Ec2Api, instance_id: str, request_id: str | None) -> dict | None:
    """The instance's spot request (by id, else by instance-id filter); None without one."""
    kw = {"SpotInstanceRequestIds": [request_id]} if request_id else {
        "Filters": [{"Name": "instance-id", "Values": [instance_id]}]}
    try:
        found = api.pages("describe_spot_instance_requests", "SpotInstanceRequests", **kw)
    except ResourceNotFound:
        return None
    return found[0] if found else None
