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
