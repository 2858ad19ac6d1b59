"""The provider protocol: every source of GPUs looks the same to the control plane.

Handles are plain serialisable models, stored in the ledger, so that any process (a later
Dagster run, the daemon after a restart) can re-attach to a running workload instead of
launching it again.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ..core.execution import Resources
from ..core.host_contract import Checkpoint, Entry
from ..core.offers import Offer

RENDEZVOUS_PORT = 29400  # torchrun's own default for c10d: a rented instance's port is ours to take


class InstanceHandle(BaseModel):
    model_config = ConfigDict(frozen=True)

    provider: str
    instance_id: str
    offer: Offer
    started_at: datetime
    address: dict[str, Any] = Field(default_factory=dict)  # how to reach it (dir, host, port, ...)
    gpu_slots: tuple[int, ...] = ()


class LaunchSpec(BaseModel):
    """What one attempt (or one evaluation) needs beyond the bundle."""

    model_config = ConfigDict(frozen=True)

    task: Literal["train", "eval"] = "train"
    attempt: int = 1
    store_uri: str
    resume_from: str | None = None
    resume_sha256: str | None = None  # what the ledger recorded: the host refuses other bytes
    eval_checkpoint: str | None = None
    eval_sha256: str | None = None
    # More (checkpoint uri, sha256) pairs the same agent evaluates after eval_checkpoint.
    eval_more: tuple[tuple[str, str], ...] = ()
    checkpoint_every: int | None = None
    # What the agent re-asks after each durable save (runtime/checkpoint_schedule.py, PLAN_FIELDS).
    interval_plan: dict[str, Any] | None = None
    memory_every: int | None = None
    probe: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: tuple[str, ...] = ()  # names forwarded from the control plane's environment
    extra_args: tuple[str, ...] = ()
    # A group of nodes (resources.nodes > 1): this node's rank, the group's size, and the c10d
    # rendezvous torchrun meets the others at (node 0's host, a port there; docs/multi-node.md).
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None


class RunHandle(BaseModel):
    model_config = ConfigDict(frozen=True)

    provider: str
    instance: InstanceHandle
    run_ref: str  # provider-specific id of the launched workload (a dir, a pid, ...)
    task: str = "train"
    attempt: int = 1
    launched_at: datetime
    # A group's other nodes, node rank 1.. in order (this handle is node 0's). Left out of the
    # stored JSON when empty: a single instance's handle reads as it always did.
    nodes: tuple["RunHandle", ...] = ()

    @model_serializer(mode="wrap")
    def _without_an_empty_group(self, handler):
        data = handler(self)
        if isinstance(data, dict) and not data.get("nodes"):
            data.pop("nodes", None)
        return data

    @property
    def members(self) -> tuple["RunHandle", ...]:
        """Every node's handle, node 0 (this one, its group left out) first."""
        return (self.model_copy(update={"nodes": ()}), *self.nodes) if self.nodes else (self,)


class RunStatus(BaseModel):
    state: Literal["starting", "running", "exited", "lost"]
    exit_code: int | None = None
    failure_class: str | None = None
    reason: str = ""
    last_step: int | None = None


class Notice(BaseModel):
    instance_id: str
    action: str = "terminate"
    deadline: datetime | None = None
    received_at: datetime
    source: str = "metadata"


class PriceTick(BaseModel):
    offer_id: str
    ts: datetime
    usd_per_hour_spot: float | None = None
    usd_per_hour_on_demand: float | None = None
    source: str = ""


class InstanceTimes(BaseModel):
    """Billing truth from the provider: when the meter started and stopped."""

    started_at: datetime
    stopped_at: datetime | None = None
    reason: str | None = None


@runtime_checkable
class Provider(Protocol):
    name: str
    # Seconds between a reclaim notice and the reclaim (AWS 120, GCP 30, none for a rental box).
    notice_seconds: float
    # Whether an instance takes another workload once its last one ended: a group's surviving
    # nodes then go on into the next attempt (control/group_recovery.py); else it is rented anew.
    relaunch: bool

    def list_offers(self, resources: Resources | None = None) -> list[Offer]: ...

    def provision(self, offer: Offer, *, tags: dict[str, str]) -> InstanceHandle: ...

    # What to rent for a group of `count` nodes starting with `offer`: one offer per node, all of
    # `offer`'s shape in its zone (one interconnect); fewer when the provider has fewer there.
    def group_offers(self, offer: Offer, count: int) -> list[Offer]: ...

    def launch(self, instance: InstanceHandle, bundle_dir: Path, spec: LaunchSpec) -> RunHandle: ...

    # `host:port` where a group's other nodes reach the c10d rendezvous torchrun hosts on this
    # instance, its node 0: an address they reach it at and a port free there.
    def rendezvous_endpoint(self, instance: InstanceHandle) -> str: ...

    def status(self, run: RunHandle) -> RunStatus: ...

    # The host contract's records (and refusals, core/host_contract.py) of the whole lines after
    # byte `offset` of the attempt's event file, and the offset after them.
    def read_events(self, run: RunHandle, offset: int) -> tuple[list[Entry], int]: ...

    def logs(self, run: RunHandle, tail_lines: int = 200) -> str: ...

    def collect(self, run: RunHandle, dest: Path) -> list[Path]: ...

    def notices(self, instance: InstanceHandle) -> list[Notice]: ...

    def instance_alive(self, instance: InstanceHandle) -> bool: ...

    def instance_times(self, instance: InstanceHandle) -> InstanceTimes: ...

    def terminate(self, instance: InstanceHandle, reason: str) -> InstanceTimes: ...

    def price_feed(self, since: datetime | None = None, offer_ids: list[str] | None = None) -> list[PriceTick]: ...

    def reattach(self, run: RunHandle) -> RunHandle | None: ...

    # Checkpoints cross between the host and the control plane's store here. A provider
    # whose hosts write straight into the control plane's store (sim; any host with S3)
    # returns its arguments unchanged; one whose hosts write to their own disk (an SSH box
    # with the `fs` store) copies the files across, verifying every sha256.
    def localize_checkpoint(self, run: RunHandle, event: Checkpoint, store_uri: str) -> Checkpoint: ...

    def stage_checkpoint(self, instance: InstanceHandle, uri: str) -> str: ...

    def host_store_uri(self, instance: InstanceHandle, store_uri: str) -> str: ...
