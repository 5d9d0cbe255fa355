"""The GPU tests' kernel gate (``tests.helpers.kernel_skip_reason``) follows the kernel rules
table for each device and torch build, checked on CPU with a pretend device."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import kernel_skip_reason


def _pretend(monkeypatch, sm: tuple[int, int], cuda: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: sm)
    monkeypatch.setattr(torch.version, "cuda", cuda)


@pytest.mark.parametrize(
    ("sm", "cuda", "runs"),
    [
        # blockwise: the DeepSeek kernels need sm90 and CUDA >= 12.9 (gemm/rules/block_scaled.py).
        ((9, 0), "13.0", {"tensorwise", "rowwise", "blockwise"}),
        ((9, 0), "12.8", {"tensorwise", "rowwise"}),
        ((9, 0), "12.6", {"tensorwise", "rowwise"}),
        ((8, 9), "13.0", {"tensorwise", "rowwise"}),
        # MXFP8: sm100 and CUDA >= 12.8; no DeepSeek kernel there (max sm90).
        ((10, 0), "12.8", {"tensorwise", "rowwise", "mxfp8", "mxfp4", "nvfp4"}),
        ((12, 0), "13.0", {"tensorwise", "rowwise", "mxfp8", "nvfp4"}),
    ],
    # Stable ids (a set's repr follows string hashing, which differs between processes).
    ids=lambda v: "-".join(sorted(v)) if isinstance(v, set) else str(v),
)
def test_kernel_gate_follows_the_rules(monkeypatch, sm, cuda, runs):
    if not hasattr(torch.nn.functional, "scaled_mm"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm: every block gate is closed")
    _pretend(monkeypatch, sm, cuda)
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4"):
        why = kernel_skip_reason(recipe)
        assert (why is None) == (recipe in runs), (recipe, why)
    deepseek = kernel_skip_reason(blocks=((1, 128), (128, 128), torch.float32))
    assert (deepseek is None) == ("blockwise" in runs), deepseek


def test_kernel_gate_names_a_product_no_kernel_takes(monkeypatch):
    _pretend(monkeypatch, (9, 0), "13.0")
    why = kernel_skip_reason(blocks=((128, 1), (128, 128), torch.float32))
    assert why is not None and "no row" in why


class _Item:
    """A collected test as the gate reads it: its ``kernel`` markers and its parameters."""

    def __init__(self, params: dict, *kernel_markers: pytest.MarkDecorator) -> None:
        self.callspec = type("CallSpec", (), {"params": params})()
        self._markers = [m.mark for m in kernel_markers]

    def iter_markers(self, name: str):
        return iter(m for m in self._markers if m.name == name)


_DEEPSEEK = pytest.mark.kernel(blocks=((1, 128), (128, 128), torch.float32))


@pytest.mark.parametrize(
    ("item", "runs_on"),
    [
        # A block product named by its kernel marker (a test without a recipe parameter).
        (_Item({"device": "cuda"}, _DEEPSEEK), {"sm90 cu13.0"}),
        # A recipe parameter: in a device_param cuda variant and in any other gpu test.
        (_Item({"device": "cuda", "recipe": "blockwise"}), {"sm90 cu13.0"}),
        (_Item({"recipe": "mxfp8"}), {"sm100 cu12.8"}),
        (_Item({"recipe": "nvfp4", "bias": "no_bias"}), {"sm100 cu12.8"}),
        (_Item({"device": "cuda", "recipe": "rowwise"}), {"sm89 cu13.0", "sm90 cu12.8", "sm90 cu13.0", "sm100 cu12.8"}),
        (_Item({"device": "cuda"}, pytest.mark.kernel("mxfp8")), {"sm100 cu12.8"}),
        # A product no kernel takes: skipped everywhere.
        (_Item({"device": "cuda"}, pytest.mark.kernel(blocks=((128, 1), (128, 128), torch.float32))), set()),
    ],
    ids=["marker-blocks", "cuda-variant-blockwise", "gpu-mxfp8", "gpu-nvfp4", "rowwise", "marker-recipe", "no-kernel"],
)
def test_gpu_tests_are_gated_by_their_products(monkeypatch, item, runs_on):
    """tests/conftest.py skips a gpu test where the kernel rules give the device and build no
    kernel for the products its ``kernel`` marker or its recipe parameters name."""
    if not hasattr(torch.nn.functional, "scaled_mm"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm: every block gate is closed")
    from tests.helpers import gpu_test_skip_reason

    devices = {
        "sm89 cu13.0": ((8, 9), "13.0"),
        "sm90 cu12.8": ((9, 0), "12.8"),
        "sm90 cu13.0": ((9, 0), "13.0"),
        "sm100 cu12.8": ((10, 0), "12.8"),
    }
    for name, (sm, cuda) in devices.items():
        _pretend(monkeypatch, sm, cuda)
        why = gpu_test_skip_reason(item)
        assert (why is None) == (name in runs_on), (name, why)
