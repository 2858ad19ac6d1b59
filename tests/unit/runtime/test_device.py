"""Device and precision chosen by the runtime, and their errors (CPU host; CUDA counts injected)."""
import pytest
import torch

from orbit_dagster.runtime import device as D


@pytest.mark.parametrize("env,count,want", [
    ({}, 0, "cpu"),
    ({}, 2, "cuda:0"),
    ({"ORBIT_DEVICE": "auto"}, 1, "cuda:0"),
    ({"ORBIT_DEVICE": "cpu"}, 4, "cpu"),
    ({"ORBIT_DEVICE": " CUDA "}, 1, "cuda:0"),
    ({"ORBIT_DEVICE": "cuda:1"}, 2, "cuda:1"),
])
def test_device_is_cuda_when_present_else_cpu_and_the_env_overrides(env, count, want):
    assert str(D.select_device(env, cuda_count=count)) == want


@pytest.mark.parametrize("value,count,says", [
    ("cuda", 0, "sees no CUDA device"),
    ("cuda:2", 2, "has 2 CUDA device(s)"),
    ("tpu", 1, "not a device this runtime supports"),
    ("mps", 0, "not a device this runtime supports"),
    ("gpu", 1, "not a device this runtime supports"),
])
def test_a_device_the_host_cannot_honour_is_one_clear_error(value, count, says):
    with pytest.raises(D.DeviceError) as err:
        D.select_device({"ORBIT_DEVICE": value}, cuda_count=count)
    assert err.value.field == "ORBIT_DEVICE" and err.value.value == value and err.value.fix
    assert says in str(err.value) and "fix:" in str(err.value)


def test_precision_is_bf16_on_a_gpu_that_supports_it_and_fp32_elsewhere():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert D.select_precision(cpu, {}) is None
    assert D.select_precision(gpu, {}, bf16_supported=True) is torch.bfloat16
    assert D.select_precision(gpu, {}, bf16_supported=False) is None
    assert D.select_precision(gpu, {"ORBIT_PRECISION": "fp32"}, bf16_supported=True) is None
    assert D.select_precision(cpu, {"ORBIT_PRECISION": "bf16"}) is torch.bfloat16
    with pytest.raises(D.DeviceError) as err:
        D.select_precision(cpu, {"ORBIT_PRECISION": "fp16"})
    assert err.value.field == "ORBIT_PRECISION" and err.value.value == "fp16"


def test_plan_on_this_host_and_autocast_really_changes_the_dtype(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA; the CPU plan is what is checked here")
    monkeypatch.delenv("ORBIT_DEVICE", raising=False)
    monkeypatch.delenv("ORBIT_PRECISION", raising=False)
    plan = D.plan()
    assert plan.describe() == {"device": "cpu", "device_name": "cpu", "precision": "fp32"}
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with D.autocast(plan):
        assert (a @ b).dtype == torch.float32
    monkeypatch.setenv("ORBIT_PRECISION", "bf16")
    with D.autocast(D.plan()):
        assert (a @ b).dtype == torch.bfloat16


def test_make_deterministic_pins_threads_and_algorithms():
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    try:
        D.make_deterministic(torch.device("cpu"), 1)
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])
