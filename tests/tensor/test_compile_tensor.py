"""torch.compile(fullgraph=True): no graph breaks, and compiled casts equal eager ones bit for bit.

Most tests use the fast ``aot_eager`` backend; a few key ones use ``inductor`` (each
compile takes seconds on a small CPU, so they are kept few).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from helpers import (
    GRANULARITIES,
    HP_GRAD_MIN_DB,
    MATMUL_MIN_DB,
    assert_bitwise_equal_f8,
    assert_sqnr,
    check_compiled_linear,
    dtype_name,
)

from f8tensor import Float8Tensor, GemmConfig

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

K, N = 64, 32
X_SHAPES = {"2d": (16, K), "3d": (2, 8, K)}


def _compile(fn, backend: str):
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def _linear_fn(granularity: str):
    def fn(x, w):
        return F.linear(x, Float8Tensor.from_hp(w, granularity=granularity))

    return fn


@pytest.mark.parametrize("x_kind", sorted(X_SHAPES))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_linear_forward_one_graph(granularity, x_kind):
    fn = _linear_fn(granularity)
    compiled, counter = _compile(fn, "aot_eager")
    x = torch.randn(X_SHAPES[x_kind], dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    y = compiled(x, w)
    assert counter.frame_count == 1
    assert torch.equal(y, fn(x, w))
    assert_sqnr(x.float() @ w.float().t(), y, MATMUL_MIN_DB)
    compiled(torch.randn_like(x), torch.randn_like(w))  # new values, same graph
    assert counter.frame_count == 1


@pytest.mark.device_param
@pytest.mark.parametrize("x_kind", sorted(X_SHAPES))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_linear_forward_backward_one_graph(granularity, x_kind):
    fn = _linear_fn(granularity)
    compiled, counter = _compile(fn, "aot_eager")
    x = torch.randn(X_SHAPES[x_kind], dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(*X_SHAPES[x_kind][:-1], N, dtype=torch.bfloat16)

    compiled(x, w).backward(upstream)
    assert counter.frame_count == 1
    grads = x.grad, w.grad

    x.grad = w.grad = None
    fn(x, w).backward(upstream)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], w.grad)

    x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (x_ref @ w_ref.t()).backward(upstream.float())
    assert_sqnr(x_ref.grad, grads[0], MATMUL_MIN_DB, "grad_x")
    # Only w was cast: its gradient is upstream^T @ x in bf16 (measured 55.7 dB vs fp32).
    assert_sqnr(w_ref.grad, grads[1], HP_GRAD_MIN_DB, "grad_w")


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_non_contiguous_3d_one_graph(granularity):
    fn = _linear_fn(granularity)
    compiled, counter = _compile(fn, "aot_eager")
    x = torch.randn(8, 2, K).transpose(0, 1)
    w = torch.randn(N, K)
    y = compiled(x, w)
    assert counter.frame_count == 1
    assert torch.equal(y, fn(x, w))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_float8tensor_input_and_output_one_graph(granularity):
    # A Float8Tensor crossing the graph boundary both ways (flatten/unflatten at work).
    def fn(w8, x):
        return x @ w8.t(), Float8Tensor.from_hp(x, granularity=granularity)

    compiled, counter = _compile(fn, "aot_eager")
    gemm = GemmConfig(out_dtype=torch.float32)
    w8 = Float8Tensor.from_hp(torch.randn(N, K), granularity=granularity, gemm_config=gemm)
    x = torch.randn(16, K, dtype=torch.bfloat16)
    y, x8 = compiled(w8, x)
    assert counter.frame_count == 1
    expected_y, expected_x8 = fn(w8, x)
    assert y.dtype == torch.float32 and torch.equal(y, expected_y)
    assert_bitwise_equal_f8(x8, expected_x8)


# Outputs that alias an input are rebuilt by torch.compile with as_strided on the input.
ALIASING_OUTPUTS = {
    "detach": (lambda w8: w8.detach(), GRANULARITIES),
    "t": (lambda w8: w8.t(), GRANULARITIES),
    "t_t": (lambda w8: w8.t().t(), GRANULARITIES),
    "slice": (lambda w8: w8[2:10], ("tensorwise",)),
    "view": (lambda w8: w8.view(2, 16, K), ("tensorwise",)),
}


@pytest.mark.parametrize(
    "name, granularity",
    [(name, g) for name, (_, grans) in sorted(ALIASING_OUTPUTS.items()) for g in grans],
)
def test_output_aliasing_an_input(name, granularity):
    view = ALIASING_OUTPUTS[name][0]
    compiled, counter = _compile(view, "aot_eager")
    w8 = Float8Tensor.from_hp(torch.randn(N, K), granularity=granularity)
    out = compiled(w8)
    assert counter.frame_count == 1
    assert_bitwise_equal_f8(out, view(w8))
    assert out.stride() == view(w8).stride()


def test_pad_inner_dim_one_graph():
    def fn(x, w):
        return F.linear(x, Float8Tensor.from_hp(w, gemm_config=GemmConfig(pad_inner_dim=True)))

    compiled, counter = _compile(fn, "aot_eager")
    x, w = torch.randn(8, 40), torch.randn(24, 40)
    y = compiled(x, w)
    assert counter.frame_count == 1
    assert torch.equal(y, fn(x, w))


# ----------------------------------------------------------------------------- inductor (few compiles)


@pytest.mark.device_param
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_inductor_cast_bitwise_equals_eager(granularity, hp_dtype):
    def cast(x):
        return Float8Tensor.from_hp(x, granularity=granularity)

    compiled, counter = _compile(cast, "inductor")
    base = torch.randn(64, 256)
    inputs = {
        "randn": base,
        "large": base * 1e4,
        "small": base * 1e-4,
        "all_zero": torch.zeros(64, 256),
        "tiny": base * 1e-30,
        "wide_rows": base * torch.logspace(-8, 8, 64).unsqueeze(1),
    }
    for name, hp in inputs.items():
        hp = hp.to(hp_dtype)
        got, expected = compiled(hp), cast(hp)
        try:
            assert_bitwise_equal_f8(got, expected)
        except AssertionError as e:
            raise AssertionError(f"compiled != eager for input {name!r}: {e}") from None
    assert counter.frame_count == 1


def test_inductor_linear_forward_backward_rowwise_3d():
    check_compiled_linear("rowwise", (2, 8), K, N)
