"""ExecutionRequest: where and how a bundle runs. The backend is chosen by its key, never by env."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Placement = Literal["sim", "ssh_rental", "aws_spot", "local"]
LaunchMode = Literal["host_process", "docker_image"]


class Resources(BaseModel):
    """What the task needs from a host."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field("any", description="GPU model name (H100, A100-80G, L4, ...) or 'any'")
    gpu_count: int = Field(1, ge=0)
    gpu_memory_gb: float = Field(0, ge=0, description="minimum memory per GPU")
    cpu_threads: int = Field(1, ge=1, description="torch threads, pinned for determinism")


class ExecutionRequest(BaseModel):
    """Placement x launch mode x resources x env, frozen into the bundle."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    placement: Placement = "sim"
    launch_mode: LaunchMode = "host_process"
    resources: Resources = Resources()
    # Plain settings only. Secrets are never frozen into a bundle: `secret_env` names
    # variables the provider forwards from the control plane's environment at launch.
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: tuple[str, ...] = ()
    image: str | None = None
    max_price_per_gpu_hour: float | None = Field(None, gt=0)
    region: str | None = None

    @property
    def backend_key(self) -> str:
        return f"{self.placement}_{self.launch_mode}"
