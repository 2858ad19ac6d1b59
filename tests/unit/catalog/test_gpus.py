"""GPU name normalisation and Epoch specs, checked on real rows of the Epoch file."""
from __future__ import annotations

import csv

import pytest

from orbit_dagster.catalog import shipped_file
from orbit_dagster.catalog.gpus import (
    EPOCH_COLUMNS,
    EPOCH_FILE,
    GPU_MODELS,
    UnknownGpu,
    gpu_family,
    gpu_spec,
    known_gpu_names,
    normalise_gpu_name,
    read_epoch_csv,
    spec_from_epoch,
)
from orbit_dagster.core.errors import OrbitError


@pytest.mark.parametrize("name, canonical", [
    # GCE accelerator keys
    ("a100", "A100-40G"), ("a100-80gb", "A100-80G"), ("h100-80gb", "H100"), ("h100-80gb-mega", "H100"),
    ("l4", "L4"), ("rtx6000", "RTX-PRO-6000"),
    # torch.cuda.get_device_name() spellings
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-40GB", "A100-40G"), ("NVIDIA A100-SXM4-80GB", "A100-80G"),
    ("Tesla V100-SXM2-16GB", "V100"), ("Tesla V100-SXM2-32GB", "V100-32G"), ("NVIDIA A10G", "A10G"),
    ("Tesla T4", "T4"), ("NVIDIA L4", "L4"), ("NVIDIA H200", "H200"), ("NVIDIA H100 PCIe", "H100-PCIE"),
    # Epoch names
    ("NVIDIA H100 SXM5 80GB", "H100"), ("NVIDIA A100 SXM4 80 GB", "A100-80G"), ("NVIDIA TESLA M60", "M60"),
    # canonical names in any case
    ("a100-80g", "A100-80G"), ("h100", "H100"),
])
def test_vendor_spellings_normalise(name, canonical):
    assert normalise_gpu_name(name) == canonical


def test_a10_and_a10g_stay_apart():
    assert normalise_gpu_name("A10") != normalise_gpu_name("A10G")


@pytest.mark.parametrize("bad", ["B9000", "", "   ", "H1000"])
def test_unknown_gpu_lists_known_names(bad):
    with pytest.raises(UnknownGpu) as e:
        normalise_gpu_name(bad)
    assert isinstance(e.value, OrbitError) and e.value.field == "gpu"
    for name in known_gpu_names():
        assert name in str(e.value)


def test_family_query_selects_all_sizes():
    assert gpu_family("A100") == ["A100-40G", "A100-80G"]
    assert gpu_family("V100") == ["V100", "V100-32G"]
    assert gpu_family("a100-80gb") == ["A100-80G"]
    assert gpu_family("L4") == ["L4"]  # not L40S
    with pytest.raises(UnknownGpu):
        gpu_family("Z99")


def test_every_epoch_name_in_the_table_exists_in_the_raw_file(hardware_dir):
    raw = read_epoch_csv(hardware_dir / "epoch_ml_hardware.csv")
    for canonical, (epoch_name, _) in GPU_MODELS.items():
        if epoch_name is not None:
            assert epoch_name in raw, canonical
        assert normalise_gpu_name(epoch_name or canonical) == canonical


def test_specs_convert_raw_epoch_rows_to_catalog_units(hardware_dir):
    path = hardware_dir / "epoch_ml_hardware.csv"
    with open(path, newline="", encoding="utf-8") as f:
        raw_rows = {r["Hardware name"]: r for r in csv.DictReader(f)}
    epoch = read_epoch_csv(path)
    checked = 0
    for canonical, (epoch_name, _) in GPU_MODELS.items():
        if epoch_name is None:
            assert spec_from_epoch(canonical, epoch).bf16_tflops is None
            continue
        raw, spec = raw_rows[epoch_name], spec_from_epoch(canonical, epoch)
        for text, value, unit in ((raw[EPOCH_COLUMNS["bf16_flops"]], spec.bf16_tflops, 1e12),
                                  (raw[EPOCH_COLUMNS["memory_bytes"]], spec.memory_gb, 1e9),
                                  (raw[EPOCH_COLUMNS["bandwidth_bytes_per_s"]], spec.memory_bandwidth_gbps, 1e9)):
            assert value == (pytest.approx(float(text) / unit) if text else None), (canonical, text)
        checked += 1
    assert checked >= 10


def test_h100_spec_matches_the_datasheet_from_the_shipped_table():
    """Real-world anchor: H100 SXM5 is 989.4 dense BF16 TFLOPS, 80 GB, 3.35 TB/s."""
    spec = gpu_spec("NVIDIA H100 80GB HBM3")
    assert (spec.bf16_tflops, spec.memory_gb, spec.memory_bandwidth_gbps) == (989.4, 80.0, 3350.0)
    assert spec_from_epoch("A100-40G", read_epoch_csv(shipped_file(EPOCH_FILE))).memory_gb == 40.0


def test_shipped_epoch_subset_equals_the_raw_file(hardware_dir):
    assert read_epoch_csv(shipped_file(EPOCH_FILE)) == read_epoch_csv(hardware_dir / "epoch_ml_hardware.csv")


def test_a_file_without_epoch_columns_is_refused(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("name,flops\nfoo,1\n")
    with pytest.raises(OrbitError, match="Epoch columns"):
        read_epoch_csv(p)
