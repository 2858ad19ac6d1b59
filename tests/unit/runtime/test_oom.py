"""OOM classification: real allocator failures (and CUDA's messages) are class `oom`, nothing else is."""
import pytest
import torch

from orbit_dagster.runtime.agent import EXIT_OOM, EXIT_USER_ERROR, classify_exception, is_out_of_memory


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("expected an exception")


def test_a_real_cpu_allocation_failure_is_oom():
    exc = _raised(lambda: torch.empty(1 << 60, dtype=torch.uint8))
    assert type(exc) is RuntimeError  # torch does not give it its own type on the CPU
    assert classify_exception(exc)[0] == EXIT_OOM


@pytest.mark.parametrize("exc", [
    # The caching allocator's own exception, with the message CUDA builds of torch produce.
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                           "139.72 GiB of which 1.25 GiB is free."),
    # Allocations outside the caching allocator arrive as RuntimeError.
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    MemoryError(),
])
def test_cuda_out_of_memory_in_its_forms_is_oom(exc):
    assert classify_exception(exc)[0] == EXIT_OOM


def test_an_oom_wrapped_by_the_workload_is_still_oom():
    def wrapped():
        try:
            torch.empty(1 << 60, dtype=torch.uint8)
        except RuntimeError as inner:
            raise ValueError("data loader worker failed") from inner

    assert is_out_of_memory(_raised(wrapped))


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    ValueError("learning rate must be positive"),
    KeyError("model"),
])
def test_other_errors_are_user_errors(exc):
    assert classify_exception(exc)[0] == EXIT_USER_ERROR
