"""The rule for recipes with no CPU kernel (blockwise, mxfp8, nvfp4, mxfp4): with
``emulate=False`` their products run emulated on a CPU and say so once per process and kind
(a UserWarning naming ``emulate=True``); ``emulate=True`` asks for that and is silent. The
recipes with CPU kernels (tensorwise, rowwise) never warn."""

from __future__ import annotations

import warnings

import pytest
import torch

from f8tensor import Float8Linear, Float8LinearConfig
from f8tensor.gemm import blocks

KINDS = {"blockwise": "block-scaled FP8", "mxfp8": "MXFP8", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def _step(recipe: str, **overrides) -> None:
    layer = Float8Linear.from_float(torch.nn.Linear(64, 64), Float8LinearConfig.from_recipe(recipe, **overrides))
    layer(torch.randn(32, 64, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("recipe", sorted(KINDS))
def test_no_cpu_kernel_warns_once_per_kind(recipe, monkeypatch):
    monkeypatch.setattr(blocks, "_WARNED_EMULATED", set())
    with pytest.warns(
        UserWarning, match=rf"{KINDS[recipe]}.* products have no cpu kernel; they run emulated .* emulate=True"
    ):
        _step(recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(recipe)  # once per process and kind


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [(r, {"emulate": True}) for r in sorted(KINDS)]
    + [
        ("tensorwise", {}),
        ("rowwise", {}),
    ],
)
def test_emulate_true_and_cpu_kernels_are_silent(recipe, overrides, monkeypatch):
    monkeypatch.setattr(blocks, "_WARNED_EMULATED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(recipe, **overrides)
