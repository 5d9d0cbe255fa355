"""What Float8Linear keeps for backward: the input in FP8 for every FP8 recipe but
rowwise_with_gw_hp (1 byte per element instead of 2), cast once, measured with f8tensor.stats.saved_tensor_bytes (the
measure benchmarks/bench_memory.py reports)."""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from f8tensor import FLOAT8_DTYPES, Float8Linear, Float8LinearConfig
from f8tensor.stats import saved_tensor_bytes

from linear_utils import RECIPE_NAMES

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory.py"
_spec = importlib.util.spec_from_file_location("bench_memory", _BENCH)
bench_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_memory)

B, S, K, N = 4, 32, 256, 512
M = B * S
SCALE_BYTES = 4  # one fp32 scale


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Exact saved bytes for one forward of Linear(K, N) on a (B, S, K) input, parameters excluded.
EXPECTED_BF16 = {
    "nn.Linear": 2 * M * K,  # the bf16 input
    "tensorwise": M * K + SCALE_BYTES + SCALE_BYTES,  # FP8 input + its scale, the weight's scale
    # The input cast along the tokens (one fp32 scale per column), which the weight-gradient GEMM reads.
    "rowwise": M * K + K * SCALE_BYTES,
    "rowwise_with_gw_hp": 2 * M * K,  # the bf16 input, for the high-precision weight gradient
    # As tensorwise, plus the input's and the weight's amax (pushed into the histories in backward).
    "delayed": M * K + 2 * SCALE_BYTES + 2 * SCALE_BYTES,
}


def test_saved_bytes_per_recipe_bf16():
    rows = dict(bench_memory.measure(B, S, K, N, torch.bfloat16))
    assert rows == EXPECTED_BF16
    # The per-tensor recipes keep about half of what bf16 keeps, rowwise its scales more.
    for recipe in ("tensorwise", "delayed"):
        assert 0.5 <= rows[recipe] / rows["nn.Linear"] < 0.501
    assert 0.5 < rows["rowwise"] / rows["nn.Linear"] < 0.52


@pytest.mark.parametrize(("recipe", "fp32_values"), [("tensorwise", 2), ("delayed", 4)])
def test_saved_bytes_fp32_model(recipe, fp32_values):
    ref = nn.Linear(K, N)
    layer = Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig.from_recipe(recipe))
    x = torch.randn(B, S, K, requires_grad=True)
    ref_bytes, _ = saved_tensor_bytes(ref, lambda: ref(x))
    fp8_bytes, y = saved_tensor_bytes(layer, lambda: layer(x))
    assert ref_bytes == 4 * M * K
    assert fp8_bytes == M * K + fp32_values * SCALE_BYTES  # a quarter of fp32's
    y.sum().backward()  # what was saved is enough for backward
    assert layer.weight.grad is not None


def test_parameters_are_not_counted():
    # A frozen weight: autograd keeps only the weight (for grad_input), i.e. nothing new.
    layer = nn.Linear(K, N, bias=False).requires_grad_(False)
    x = torch.randn(B, S, K, requires_grad=True)
    nbytes, _ = saved_tensor_bytes(layer, lambda: layer(x))
    assert nbytes == 0
    # The input, seen through two views, counts once.
    nbytes, _ = saved_tensor_bytes(layer, lambda: (x * x)[..., :8])
    assert nbytes == 4 * M * K


class _Float8Casts(TorchDispatchMode):
    """Records the shape of every cast from a high-precision tensor to an FP8 dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and out.dtype in FLOAT8_DTYPES
            and args[0].dtype not in FLOAT8_DTYPES
        ):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_the_input_is_cast_once(recipe):
    layer = Float8Linear.from_float(nn.Linear(K, N), Float8LinearConfig.from_recipe(recipe))
    x = torch.randn(B, S, K, requires_grad=True)
    fwd, bwd = _Float8Casts(), _Float8Casts()
    with fwd:
        y = layer(x)
    with bwd:
        y.backward(torch.randn_like(y))
    # Per-tensor recipes reuse the forward's FP8 input; rowwise casts the input once more in
    # forward, along the token axis (blockwise and mxfp8: re-tiled along it, 128x1 or 32x1),
    # and keeps that cast for backward; with a high-precision weight gradient it is not cast.
    along_tokens = {"tensorwise": 0, "delayed": 0, "rowwise": 1, "rowwise_with_gw_hp": 0, "blockwise": 1, "mxfp8": 1}[
        recipe
    ]
    assert fwd.shapes == [(M, K), (N, K)] + [(M, K)] * along_tokens  # input, weight, input along the tokens
    assert bwd.shapes.count((M, K)) == 0, bwd.shapes
