"""One EC2 client for the aws provider: paging, zone names, a short describe cache, tagged look-ups.

Every call goes through `aws_errors`, so what leaves this module is an orbit error (the
botocore error as its `__cause__`). Credentials: boto3's standard chain, or the `session`
the resource layer built from an EnvVar; nothing here reads or logs a secret.
"""
from __future__ import annotations

import time
from typing import Any

import boto3
from botocore.config import Config

from ...core.errors import ResourceNotFound
from .errors import aws_errors


class Ec2Api:
    def __init__(self, *, region: str, endpoint_url: str | None, session: Any = None, max_attempts: int = 5,
                 page_size: int | None = None):
        self.region, self.endpoint_url = region, endpoint_url
        self.max_attempts, self.page_size = max_attempts, page_size
        self._session, self._client = session, None
        self._zones: dict[str, str] | None = None
        self._seen: dict[str, tuple[float, dict | None]] = {}

    @property
    def client(self) -> Any:
        if self._client is None:
            session = self._session or boto3.session.Session()
            config = Config(retries={"mode": "standard", "max_attempts": self.max_attempts}, connect_timeout=10,
                            read_timeout=60, user_agent_extra="orbit-dagster")
            self._client = session.client("ec2", region_name=self.region, endpoint_url=self.endpoint_url,
                                          config=config)
        return self._client

    def call(self, operation: str, **kw: Any) -> dict:
        """One EC2 call by its boto3 name, errors translated."""
        with aws_errors(operation):
            return getattr(self.client, operation)(**kw)

    def pages(self, operation: str, key: str, **kw: Any) -> list[dict]:
        """Every item of a paginated EC2 call (the adapter pages; callers see one list)."""
        paging = {"PageSize": self.page_size} if self.page_size else {}
        with aws_errors(operation):
            return [item for page in self.client.get_paginator(operation).paginate(**kw, PaginationConfig=paging)
                    for item in page.get(key, ())]

    def zone_names(self) -> dict[str, str]:
        """AZ id (use1-az2, the same in every account) -> zone name (us-east-1a, per account)."""
        if self._zones is None:
            zones = self.call("describe_availability_zones")["AvailabilityZones"]
            self._zones = {z["ZoneId"]: z["ZoneName"] for z in zones if z.get("ZoneId")}
        return self._zones

    def describe(self, instance_id: str, *, max_age_s: float = 0.0) -> dict | None:
        """The instance as EC2 sees it now (None once EC2 has forgotten it); cached `max_age_s`."""
        seen = self._seen.get(instance_id)
        if seen is not None and time.time() - seen[0] <= max_age_s:
            return seen[1]
        try:
            reservations = self.call("describe_instances", InstanceIds=[instance_id])["Reservations"]
            found = next((i for r in reservations for i in r["Instances"]), None)
        except ResourceNotFound:
            found = None
        self._seen[instance_id] = (time.time(), found)
        return found

    def forget(self, instance_id: str) -> None:
        self._seen.pop(instance_id, None)

    def find_instances(self, tags: dict[str, str], states: tuple[str, ...] = ("pending", "running")) -> list[dict]:
        """Instances carrying all `tags` (paginated): how a sweep finds what a crashed run rented."""
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in tags.items()]
        filters.append({"Name": "instance-state-name", "Values": list(states)})
        return [i for r in self.pages("describe_instances", "Reservations", Filters=filters) for i in r["Instances"]]
