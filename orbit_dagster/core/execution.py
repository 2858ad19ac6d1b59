"""ExecutionRequest: where and how a bundle runs. The backend is chosen by its key, never by env."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints

from .config_schema import FiniteFloat, refused

# Each placement is served by a provider (control/providers.py REGISTRY, keyed
# f"{placement}_{launch_mode}"); a name no provider serves is not a choice.
Placement = Literal["sim", "ssh_rental", "aws_spot"]
LaunchMode = Literal["host_process", "docker_image"]

EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
EnvValue = Annotated[str, StringConstraints(max_length=4096)]
# Instances one job may hold at once. A gang is rented all or none and stops whole on any
# member's reclaim, so its interval policy's reclaim rate scales with it (policy.checkpointing).
MAX_NODES = 64


class Resources(BaseModel):
    """What the task needs from a host."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field("any", min_length=1, max_length=64,
                     description="GPU model name (H100, A100-80G, L4, ...) or 'any'")
    gpu_count: StrictInt = Field(1, ge=0, le=1024)
    gpu_memory_gb: FiniteFloat = Field(0, ge=0, le=100_000, description="minimum memory per GPU")
    cpu_threads: StrictInt = Field(1, ge=1, le=1024, description="torch threads, pinned for determinism")
    processes: StrictInt = Field(1, ge=1, le=256, description="processes of a command workload on its instance: "
                                 "more than 1 starts it under torchrun (one rank each)")
    nodes: StrictInt = Field(1, ge=1, le=MAX_NODES, description="instances the task holds at once, rented all or "
                             "none in one zone: more than 1 starts a command workload under torchrun on each, "
                             "with a c10d rendezvous on node 0's host (docs/multi-node.md)")


class Elastic(BaseModel):
    """How many nodes a multi-node job may run on after one of its nodes is reclaimed: it goes on
    with the survivors while they are at least `min_nodes` (its checkpoint resharded onto the new
    world size, the global batch kept), else a replacement is rented; never more than `max_nodes`
    (docs/multi-node.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_nodes: StrictInt = Field(ge=1, le=MAX_NODES)
    max_nodes: StrictInt = Field(ge=1, le=MAX_NODES)


def check_group(resources: Resources, *, command: object, kind: object) -> None:
    """A template's group of nodes (its validator's): a command workload that trains."""
    if resources.nodes > 1 and command is None:
        raise refused(f"asks for {resources.nodes} nodes: a group of instances runs a command workload under "
                      "torchrun (`command:`), an SDK entrypoint one process", field="resources.nodes",
                      value=resources.nodes, fix="set resources.nodes: 1, or give the template a `command:`")
    if resources.nodes > 1 and kind != "train":
        raise refused(f"asks for {resources.nodes} nodes for a {kind} task: a group of instances trains",
                      field="resources.nodes", value=resources.nodes, fix="set resources.nodes: 1, or kind: train")


def check_elastic(elastic: Elastic | None, nodes: int) -> None:
    """`min_nodes <= resources.nodes <= max_nodes` (the template's validator's)."""
    if elastic is not None and not elastic.min_nodes <= nodes <= elastic.max_nodes:
        raise refused(f"needs min_nodes <= resources.nodes <= max_nodes, and {elastic.min_nodes} <= {nodes} <= "
                      f"{elastic.max_nodes} does not hold", field="elastic", value=elastic.model_dump(),
                      fix=f"set elastic.min_nodes to at most {nodes} and elastic.max_nodes to at least {nodes} "
                          "(or change resources.nodes)")


class ExecutionRequest(BaseModel):
    """Placement x launch mode x resources x env, frozen into the bundle."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    placement: Placement = "sim"
    launch_mode: LaunchMode = "host_process"
    resources: Resources = Resources()
    # Plain settings only. Secrets are never frozen into a bundle: `secret_env` names
    # variables the provider forwards from the control plane's environment at launch.
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    secret_env: tuple[EnvName, ...] = ()
    image: str | None = Field(None, max_length=512)
    max_price_per_gpu_hour: FiniteFloat | None = Field(None, gt=0)
    region: str | None = Field(None, max_length=64)

    @property
    def backend_key(self) -> str:
        return f"{self.placement}_{self.launch_mode}"
