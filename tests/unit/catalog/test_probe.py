"""The effective-TFLOPS probe on CPU (tiny sizes) and the bench's markdown recorder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from orbit_dagster.runtime.probe import measure_matmul_tflops

REPO = Path(__file__).resolve().parents[3]


def test_cpu_probe_reports_a_consistent_measurement():
    r = measure_matmul_tflops(device="cpu", seconds=0.05, size=64)
    assert r["dtype"] == "float32" and r["device"] == "cpu" and r["size"] == 64
    assert r["iterations"] >= 1 and r["seconds"] >= 0.05
    assert r["tflops"] == pytest.approx(2 * 64 ** 3 * r["iterations"] / r["seconds"] / 1e12)
    assert isinstance(r["device_name"], str) and r["device_name"]


@pytest.mark.parametrize("kw", [{"seconds": 0}, {"seconds": -1}, {"size": 0}, {"size": 2.5}, {"device": "tpu"},
                                {"device": "not a device"}])
def test_bad_arguments_name_the_fix(kw):
    with pytest.raises(ValueError, match="fix"):
        measure_matmul_tflops(**{"device": "cpu", "seconds": 0.01, "size": 8, **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="no CUDA"):
        measure_matmul_tflops(device="cuda", seconds=0.01, size=8)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tflops", REPO / "bench" / "tflops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_looks_up_gpu_specs_and_has_none_for_cpus():
    bench = _bench()
    assert bench.spec_for({"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"})[0] == 989.4
    assert bench.spec_for({"device": "cuda:0", "device_name": "Mystery GPU"})[0] is None
    assert bench.spec_for({"device": "cpu", "device_name": "Intel"}) [0] is None


def test_bench_records_its_section_and_keeps_the_rest(tmp_path):
    bench = _bench()
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Ledger\n\nkeep me\n")
    cpu = {"device": "cpu", "device_name": "Test CPU", "dtype": "float32", "size": 64, "iterations": 3,
           "seconds": 0.1, "tflops": 0.01}
    bench.record(doc, cpu, None)
    bench.record(doc, {**cpu, "tflops": 0.02}, None)  # rerun replaces the row
    gpu = {**cpu, "device": "cuda:0", "device_name": "NVIDIA H200", "dtype": "bfloat16", "tflops": 700.0}
    bench.record(doc, gpu, 989.5)
    text = doc.read_text()
    assert "keep me" in text and text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    section = text.split(bench.BEGIN)[1].split(bench.END)[0]
    assert "| Test CPU | float32 |" in section and "| 0.02 |" in section and "| 0.01 |" not in section
    assert "| 0.71 |" in section  # measured/spec for the GPU row
    fresh = tmp_path / "new.md"
    bench.record(fresh, cpu, None)
    assert fresh.read_text().startswith("# Benchmarks")
