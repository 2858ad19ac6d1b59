"""bench/gpu_check.py: says plainly that nothing is measured without CUDA; its checks run (on the CPU)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_check.py"


def test_without_cuda_it_measures_and_records_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--record", str(doc)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr and "nothing recorded" in proc.stderr
    assert doc.read_text() == "# Benchmarks\n"


@pytest.mark.slow  # a minute of CPU: the GPU script run end to end on the CPU
def test_its_checks_run_on_the_cpu_and_pass():
    # Determinism (resume and rerun give the same weights) and OOM classification, on small sizes.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--json"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert result["determinism"] == {"steps": 10, "resumed_equal": True, "rerun_equal": True}
    assert result["oom"] == {"allocation": "oom", "workload": "oom"}
    assert result["save"]["bytes"] > 16e6 and result["probe"]["tflops"] > 0
