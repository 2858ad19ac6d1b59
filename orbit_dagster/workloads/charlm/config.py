"""The config schema of the charlm workload: every key train.py, eval.py and charlm_model.py read.

The control plane validates a template's `config:` and every `--set config.*` against this
model before anything is rented (see docs/concepts.md). It imports pydantic only, so a
workload of your own can start from a copy. Strict types on purpose: YAML reads `true` as a
bool and pydantic's lax mode would take it for 1.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictInt, ValidationInfo, field_validator

Float = Annotated[float, Strict(), AllowInfNan(False)]  # an int is fine; a bool, text, inf or nan is not
SEED_MAX = 2**31 - 1  # train.py multiplies the seed by ~1e6 per step: keep the products inside int64


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: StrictInt = Field(200, ge=1, le=10_000_000, description="optimizer steps of the whole run")
    micro_batch: StrictInt = Field(16, ge=1, le=65_536, description="sequences per forward pass")
    grad_accum: StrictInt = Field(2, ge=1, le=4_096, description="micro-batches per optimizer step")
    seq_len: StrictInt = Field(64, ge=2, le=4_096, description="characters per sequence")
    d_model: StrictInt = Field(128, ge=8, le=8_192)
    n_heads: StrictInt = Field(4, ge=1, le=256, description="must divide d_model")
    n_layers: StrictInt = Field(2, ge=1, le=256)
    dropout: Float = Field(0.1, ge=0, lt=1)
    # No upper bound: a large rate is a poor choice, not an invalid one (divergence is
    # detected and classified at run time).
    lr: Float = Field(3e-3, gt=0, description="peak learning rate (warm-up, then cosine decay)")
    weight_decay: Float = Field(0.01, ge=0, le=1)
    warmup_frac: Float = Field(0.1, ge=0, le=1)
    seed: StrictInt = Field(1234, ge=0, le=SEED_MAX)
    eval_batches: StrictInt = Field(8, ge=1, le=100_000)
    eval_seed: StrictInt = Field(12345, ge=0, le=SEED_MAX, description="the same held-out windows for every checkpoint")
    device_memory_mb: Float = Field(0, ge=0, description="simulated device memory limit in MB; 0 = none")
    trainable: Literal["all", "head"] = Field("all", description="`head`: fine-tune the output head only")
    corpus: str = Field("corpus.txt", max_length=255, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
                        description="a file of the bundle's inputs/")

    @field_validator("n_heads")
    @classmethod
    def _heads_divide_width(cls, v: int, info: ValidationInfo) -> int:
        d_model = info.data.get("d_model")
        if d_model and d_model % v:
            raise ValueError(f"must divide d_model ({d_model}): each head gets d_model / n_heads dimensions")
        return v
