"""Test set-up: the ``gpu`` marker, a fixed seed per test, a fresh dynamo per compile test."""

from __future__ import annotations

import pytest
import torch


def _fp8_gpu_reason() -> str | None:
    """None when a CUDA device with FP8 tensor cores (capability >= 8.9) is present."""
    if not torch.cuda.is_available():
        return "needs CUDA (no CUDA device available)"
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        return f"needs compute capability >= 8.9 for FP8 matmuls; device has {capability}"
    return None


def pytest_collection_modifyitems(config, items):
    # Only tests marked `gpu` are skipped; the CPU tests always run.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _fp8_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws the same random numbers whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """Reset torch.compile's caches before and after a compile test (frame counts start at 0)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one thread, restored afterwards.

    For modules that train tiny models: their GEMMs are too small for threads to help,
    and on a shared machine extra threads make the runs several times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
