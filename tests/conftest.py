"""Test set-up: the CUDA rules check, the ``gpu`` marker, the ``device_param`` marker, a fixed
seed per test, a fresh dynamo per compile test.

CUDA rules check (on by default): every ``torch._scaled_mm`` call a test makes is checked
against the rules of every supported NVIDIA build (``f8tensor.gemm.SCALED_MM_RULES``) and
a test that made an illegal call fails. Subprocesses (tutorials, benchmarks, the demo,
FSDP workers) inherit ``F8TENSOR_CHECK_CUDA_RULES=1`` and raise at such a call. Switch it
off with ``F8TENSOR_CHECK_CUDA_RULES=0 pytest ...``.

``device_param``: a CPU test marked with it also runs on ``cuda``. It is parametrized over
the ``device`` fixture: the ``cpu`` variant is the test as written; the ``cuda`` variant is
marked ``gpu`` (so skipped without an FP8 GPU, and selected by ``pytest -m gpu``) and runs
the same body with ``torch.set_default_device("cuda")``, so every tensor and module the
test creates without naming a device lives on the GPU. (Tensors a test creates on the CPU
explicitly, and the package's own device handling, are covered by the tests written for
CUDA: kernels/test_gpu_scaled_mm.py and the GPU campaign's checks.) ``pytest -m "device_param and gpu"
--collect-only -q`` lists the re-run set.

GPU tests that need a block-scaled or FP4 kernel skip where the kernel rules say this
device and build have none (``tests.helpers.kernel_skip_reason``, the one gate): a
``gpu`` test (``cuda`` variants included) for each recipe named in its parameters and for
the products its ``kernel`` marker names, e.g. ``@pytest.mark.kernel(blocks=((1, 128), (128,
128), torch.float32))`` or ``@pytest.mark.kernel("mxfp8")``.
"""

from __future__ import annotations

import os

import pytest
import torch

_RULES_ENV = "F8TENSOR_CHECK_CUDA_RULES"


def _rules_check_on() -> bool:
    return os.environ.get(_RULES_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def pytest_configure(config):
    if _rules_check_on():
        os.environ[_RULES_ENV] = "1"  # for subprocesses
        from f8tensor import gemm

        # In this process: record, and fail the test at teardown (a raise inside the op
        # could be swallowed by a test's own pytest.raises).
        gemm.install_rules_check(raise_on_violation=False)


@pytest.fixture(autouse=True)
def _cuda_rules_check():
    """Fail a test whose ``torch._scaled_mm`` calls a supported CUDA build would refuse."""
    from f8tensor import gemm

    check = gemm.rules_check_installed()
    if check is None:
        yield None
        return
    check.take()
    yield check
    found = check.take()
    if found:
        shown = "\n  ".join(dict.fromkeys(found))
        what = f"{len(found)} torch._scaled_mm call(s) a supported CUDA build would refuse"
        pytest.fail(f"{what}:\n  {shown}", pytrace=False)


@pytest.fixture
def cuda_rules(_cuda_rules_check):
    """The installed rules check (skips the test when the check is switched off). A test
    that makes illegal calls on purpose drains them with ``cuda_rules.take()``."""
    if _cuda_rules_check is None:
        pytest.skip(f"the CUDA rules check is off ({_RULES_ENV}=0)")
    return _cuda_rules_check


def _fp8_gpu_reason() -> str | None:
    """None when a CUDA device with FP8 tensor cores (capability >= 8.9) is present."""
    if not torch.cuda.is_available():
        return "needs CUDA (no CUDA device available)"
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        return f"needs compute capability >= 8.9 for FP8 matmuls; device has {capability}"
    return None


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("device_param") is not None:
        devices = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
        metafunc.parametrize("device", devices, indirect=True)


@pytest.fixture
def device(request) -> str:
    """The device a ``device_param`` test runs on ("cpu" for every other test)."""
    return getattr(request, "param", "cpu")


@pytest.fixture(autouse=True)
def _default_device(device):
    """``cuda`` variants of ``device_param`` tests create their tensors on the GPU."""
    if device == "cpu":
        yield
        return
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def pytest_collection_modifyitems(config, items):
    # Only tests marked `gpu` are skipped; the CPU tests always run.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _fp8_gpu_reason()
    if reason is None:
        from tests.helpers import gpu_test_skip_reason

        for item in gpu_items:
            why = gpu_test_skip_reason(item)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))
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


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide ``AcceleratorState``: an ``Accelerator`` made with
    other options than an earlier test's refuses to start. Reset it around the test."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)
