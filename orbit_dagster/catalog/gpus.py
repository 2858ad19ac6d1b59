"""GPU model names and specs.

Vendors name the same GPU differently (GCE `a100-80gb`, AWS `p4de`, torch
"NVIDIA A100-SXM4-80GB", Epoch "NVIDIA A100 SXM4 80 GB"). Everything in the catalog
speaks one canonical name per model (`H100`, `A100-80G`, ...), and specs come from one
row of the Epoch AI "Machine Learning Hardware" table per canonical name.

Units: `bf16_tflops` is dense tensor FP16/BF16 TFLOP/s per GPU (Epoch's
"Tensor-FP16/BF16 performance" column / 1e12: the dense figure, not the 2:4-sparse one);
memory in GB (1e9 bytes); bandwidth in GB/s (1e9 bytes/s).
"""
from __future__ import annotations

import csv
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from orbit_dagster.catalog import CatalogError, shipped_file

EPOCH_FILE = "epoch_gpu_specs.csv"

# Epoch columns we read; the shipped subset keeps these exact headers so one parser reads both.
EPOCH_COLUMNS = {
    "name": "Hardware name",
    "manufacturer": "Manufacturer",
    "type": "Type",
    "release_date": "Release date",
    "bf16_flops": "Tensor-FP16/BF16 performance (FLOP/s)",
    "fp8_flops": "FP8 performance (FLOP/s)",
    "fp16_flops": "FP16 (half precision) performance (FLOP/s)",
    "fp32_flops": "FP32 (single precision) performance (FLOP/s)",
    "memory_bytes": "Memory (bytes)",
    "bandwidth_bytes_per_s": "Memory bandwidth (byte/s)",
    "tdp_w": "TDP (W)",
}

# canonical name -> (Epoch row or None when Epoch lacks the model, vendor aliases).
# Which Epoch row: the form factor the clouds rent (SXM for H100/A100/V100 8-GPU boxes).
# `None` means no spec in the data: the offer ranks last until the probe measures it.
GPU_MODELS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "H100": ("NVIDIA H100 SXM5 80GB", ("h100-80gb", "h100-80gb-mega", "H100 SXM", "H100 80GB HBM3")),
    "H100-PCIE": ("NVIDIA H100 PCIe", ("H100 PCIe 80GB",)),
    "H200": ("NVIDIA H200 SXM", ("H200 141GB",)),
    # GCE's `a100` accelerator is the 40 GB part; `a100-80gb` the 80 GB one.
    "A100-40G": ("NVIDIA A100 SXM4 40 GB", ("a100", "a100-40gb", "A100-SXM4-40GB")),
    "A100-80G": ("NVIDIA A100 SXM4 80 GB", ("a100-80gb", "A100-SXM4-80GB", "A100 80GB PCIe")),
    # Epoch's "V100 SXM2 16 GB" row lacks the memory figure; the plain "SXM2" row has it.
    "V100": ("NVIDIA Tesla V100 SXM2", ("v100-16gb", "V100-SXM2-16GB")),
    "V100-32G": ("NVIDIA Tesla V100 SXM2 32 GB", ("v100-32gb", "V100-SXM2-32GB")),
    "A10G": ("NVIDIA A10G", ()),
    "A10": ("NVIDIA A10 PCIe", ()),
    "L4": ("NVIDIA L4", ()),
    "L40S": (None, ()),
    "T4": ("NVIDIA Tesla T4", ()),
    "T4G": (None, ()),
    "K80": ("NVIDIA Tesla K80", ()),
    "M60": ("NVIDIA TESLA M60", ()),
    # Cyclenerd's GCE pricing key for the g4 family is `rtx6000`; it is the RTX PRO 6000
    # (Blackwell), not the Turing Quadro RTX 6000. Epoch has no row for it.
    "RTX-PRO-6000": (None, ("rtx6000", "nvidia-rtx-pro-6000", "RTX PRO 6000 Blackwell Server Edition")),
    "V520": (None, ("Radeon Pro V520",)),  # AMD, in AWS g4ad
}


class UnknownGpu(CatalogError):
    """A GPU name that no alias table knows."""


@dataclass(frozen=True)
class EpochRow:
    """One accelerator of the Epoch table, in its own units (FLOP/s, bytes, bytes/s)."""

    name: str
    manufacturer: str
    type: str
    release_date: str
    bf16_flops: float | None
    fp8_flops: float | None
    fp16_flops: float | None
    fp32_flops: float | None
    memory_bytes: float | None
    bandwidth_bytes_per_s: float | None
    tdp_w: float | None


@dataclass(frozen=True)
class GpuSpec:
    """Per-GPU spec in catalog units. Fields are None where Epoch has no figure."""

    name: str
    epoch_name: str | None
    bf16_tflops: float | None
    memory_gb: float | None
    memory_bandwidth_gbps: float | None  # GB/s, 1e9 bytes per second

    @property
    def source(self) -> str:
        return f"Epoch AI: {self.epoch_name}" if self.epoch_name else "no row in the Epoch data"


def _squash(name: str) -> str:
    """Compare names on letters and digits only, without the brand words vendors prepend."""
    s = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in ("nvidia", "tesla", "amd"):
        if s.startswith(prefix) and len(s) > len(prefix):
            s = s[len(prefix):]
    return s


@functools.lru_cache(maxsize=1)
def _alias_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for canonical, (epoch_name, aliases) in GPU_MODELS.items():
        for alias in (canonical, *aliases, *([epoch_name] if epoch_name else [])):
            key = _squash(alias)
            if index.setdefault(key, canonical) != canonical:
                raise CatalogError(f"alias {alias!r} maps to both {index[key]} and {canonical}",
                                   field="GPU_MODELS", value=alias, fix="make the alias tables disjoint")
    return index


def known_gpu_names() -> list[str]:
    """Canonical names, sorted: what errors list and what `--gpu` accepts (plus aliases)."""
    return sorted(GPU_MODELS)


def normalise_gpu_name(name: str) -> str:
    """Canonical model name for any vendor spelling; UnknownGpu listing the known names."""
    if not isinstance(name, str) or not name.strip():
        raise UnknownGpu("GPU name is empty", field="gpu", value=name,
                         fix=f"use one of {', '.join(known_gpu_names())}")
    canonical = _alias_index().get(_squash(name))
    if canonical is None:
        raise UnknownGpu(f"unknown GPU name {name!r}", field="gpu", value=name,
                         fix=f"use one of {', '.join(known_gpu_names())} (or a vendor alias of one)")
    return canonical


def gpu_family(query: str) -> list[str]:
    """Canonical names a user query means: `A100` -> both A100 sizes; `a100-80gb` -> A100-80G.

    A bare family name that is a prefix of several canonical names (A100, V100, H100)
    selects all of them; anything else is normalised to exactly one model.
    """
    key = _squash(query)
    family = sorted(c for c in GPU_MODELS if _squash(c) == key or _squash(c.split("-")[0]) == key)
    return family if len(family) > 1 else [normalise_gpu_name(query)]


def _float(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def read_epoch_csv(path: Path) -> dict[str, EpochRow]:
    """Parse the Epoch hardware CSV (the raw file or the shipped subset) keyed by hardware name."""
    rows: dict[str, EpochRow] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in EPOCH_COLUMNS.values() if c not in (reader.fieldnames or [])]
        if missing:
            raise CatalogError(f"{path.name} lacks Epoch columns {missing}", field="columns", value=missing,
                               fix="pass the Epoch 'Machine Learning Hardware' CSV")
        for line in reader:
            values = {k: line[c] for k, c in EPOCH_COLUMNS.items()}
            numeric = {k: _float(v) for k, v in values.items() if k.endswith(("_flops", "_bytes", "_per_s", "_w"))}
            rows[values["name"]] = EpochRow(name=values["name"], manufacturer=values["manufacturer"],
                                            type=values["type"], release_date=values["release_date"], **numeric)
    return rows


@functools.lru_cache(maxsize=1)
def _shipped_epoch() -> dict[str, EpochRow]:
    return read_epoch_csv(shipped_file(EPOCH_FILE))


def spec_from_epoch(canonical: str, epoch: dict[str, EpochRow]) -> GpuSpec:
    """Convert one canonical model's Epoch row to catalog units."""
    epoch_name = GPU_MODELS[canonical][0]
    if epoch_name is None:
        return GpuSpec(canonical, None, None, None, None)
    row = epoch.get(epoch_name)
    if row is None:
        raise CatalogError(f"Epoch table has no row {epoch_name!r} for {canonical}", field="Hardware name",
                           value=epoch_name, fix="rebuild the shipped data or fix GPU_MODELS")

    def scaled(v: float | None, unit: float) -> float | None:
        return None if v is None else round(v / unit, 6)

    return GpuSpec(canonical, epoch_name, scaled(row.bf16_flops, 1e12), scaled(row.memory_bytes, 1e9),
                   scaled(row.bandwidth_bytes_per_s, 1e9))


def gpu_spec(name: str) -> GpuSpec:
    """Spec of a GPU by any of its names, from the shipped Epoch subset."""
    return spec_from_epoch(normalise_gpu_name(name), _shipped_epoch())


def offer_spec_fields(gpu: str) -> dict:
    """The spec fields of an `Offer` for one canonical GPU (memory 0.0 = unknown, as Offer defaults)."""
    spec = gpu_spec(gpu)
    return {"gpu_memory_gb": spec.memory_gb or 0.0, "spec_tflops_bf16": spec.bf16_tflops,
            "memory_bandwidth_gbps": spec.memory_bandwidth_gbps}
