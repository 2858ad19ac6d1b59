"""The config schema of the paced workload (see train.py)."""
from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictInt

Float = Annotated[float, Strict(), AllowInfNan(False)]


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: StrictInt = Field(1000, ge=1, le=10_000_000, description="optimizer steps of the whole run")
    step_seconds: Float = Field(0.02, gt=0, le=60, description="wall seconds per step (the pace)")
    seed: StrictInt = Field(7, ge=0, le=2**31 - 1)
    tail_seconds: Float = Field(0.0, ge=0, le=600, description="wall seconds of work after the last step "
                                "(a user's export or upload) before the script returns")
