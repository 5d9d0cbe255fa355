"""GPU variants of the key matmul tests: real CUDA torch._scaled_mm on FP8 tensor cores.

Every test here is marked ``gpu`` and skipped without a CUDA device of compute capability
>= 8.9 (see conftest.py). The CPU versions of the same checks live in core/test_ops_matmul.py
and core/test_compile_tensor.py and always run.

On NVIDIA GPUs only the OCP formats (e4m3fn, e5m2) exist, rowwise scaling needs a bf16
output, and e5m2 x e5m2 products are refused by cuBLASLt, so these tests stick to those.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from helpers import (
    GRANULARITIES,
    MATMUL_MIN_DB,
    assert_bitwise_equal_f8,
    assert_sqnr,
    check_compiled_linear,
    matmul_min_db,
)

from f8tensor import FORMATS, Float8Tensor, GemmConfig, float8_mm

pytestmark = pytest.mark.gpu

CUDA = "cuda"
K, N = 256, 128


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    out = x.float() @ w.float().t()
    return out if b is None else out + b.float()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("x_shape", [(64, K), (4, 32, K)], ids=["2d", "3d"])
def test_cuda_matmul_bf16_out(x_shape, granularity):
    x = torch.randn(x_shape, dtype=torch.bfloat16, device=CUDA)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=CUDA)
    y = x @ Float8Tensor.from_hp(w, granularity=granularity).t()
    assert y.device.type == CUDA and y.dtype == torch.bfloat16 and y.shape == (*x_shape[:-1], N)
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_non_contiguous_3d_activation(granularity):
    x = torch.randn(32, 4, K, dtype=torch.bfloat16, device=CUDA).transpose(0, 1)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=CUDA)
    y = F.linear(x, Float8Tensor.from_hp(w, granularity=granularity))
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_linear_with_bias_and_both_fp8(granularity):
    x = torch.randn(64, K, dtype=torch.bfloat16, device=CUDA)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=CUDA)
    b = torch.randn(N, dtype=torch.bfloat16, device=CUDA)
    x8 = Float8Tensor.from_hp(x, granularity=granularity)
    w8 = Float8Tensor.from_hp(w, granularity=granularity)
    assert_sqnr(_ref(x, w, b), F.linear(x, w8, b), MATMUL_MIN_DB)
    assert_sqnr(_ref(x, w, b), torch.addmm(b, x8, w8.t()), MATMUL_MIN_DB)


def test_cuda_e4m3_times_e5m2():
    x = torch.randn(64, K, dtype=torch.bfloat16, device=CUDA)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=CUDA)
    x8 = Float8Tensor.from_hp(x, torch.float8_e4m3fn)
    w8 = Float8Tensor.from_hp(w, torch.float8_e5m2)
    # An e5m2 operand by design: its threshold (H100, torch 2.11+cu130: 24.68 dB, as the CPU's 24.6).
    assert_sqnr(_ref(x, w), torch.mm(x8, w8.t()), matmul_min_db(torch.float8_e4m3fn, torch.float8_e5m2))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_float8_mm_hp_out(out_dtype):
    x = torch.randn(64, K, dtype=torch.bfloat16, device=CUDA)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=CUDA)
    y = float8_mm(x, Float8Tensor.from_hp(w).t(), out_dtype=out_dtype)
    assert y.dtype == out_dtype
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)


def test_cuda_float8_mm_fp8_out_saturates():
    fmax = FORMATS[torch.float8_e4m3fn].max
    a = torch.full((64, K), 100.0, dtype=torch.bfloat16, device=CUDA)
    b8 = Float8Tensor.from_hp(torch.full((N, K), 100.0, dtype=torch.bfloat16, device=CUDA))
    y8 = float8_mm(a, b8.t(), out_dtype=torch.float8_e4m3fn, out_scale=1.0)
    assert torch.isfinite(y8._data.float()).all() and (y8._data.float() == fmax).all()


def test_cuda_pad_inner_dim():
    x = torch.randn(64, 40, dtype=torch.bfloat16, device=CUDA)
    w = torch.randn(24, 40, dtype=torch.bfloat16, device=CUDA)
    w8 = Float8Tensor.from_hp(w, gemm_config=GemmConfig(pad_inner_dim=True))
    assert_sqnr(_ref(x, w), x @ w8.t(), MATMUL_MIN_DB)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_compile_linear_forward_backward(granularity):
    check_compiled_linear(granularity, (4, 32), K, N, device=CUDA)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_cuda_compiled_cast_bitwise_equals_eager(granularity):
    def cast(x):
        return Float8Tensor.from_hp(x, granularity=granularity)

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(cast, backend=counter, fullgraph=True)
    base = torch.randn(128, 512, device=CUDA)
    wide_rows = base * torch.logspace(-8, 8, 128, device=CUDA).unsqueeze(1)
    for hp in (base, base * 1e4, base * 1e-4, torch.zeros_like(base), wide_rows):
        hp = hp.to(torch.bfloat16)
        assert_bitwise_equal_f8(compiled(hp), cast(hp))
    assert counter.frame_count == 1
