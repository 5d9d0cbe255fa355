"""Matrix products through torch._scaled_mm: accuracy, output dtypes, alignment, refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    E4M3_DTYPES,
    E5M2_DTYPES,
    GRANULARITIES,
    HP_DTYPES,
    HP_GRAD_MIN_DB,
    MATMUL_E5M2_MIN_DB,
    MATMUL_MIN_DB,
    assert_consistent,
    assert_sqnr,
    dtype_name,
    matmul_min_db,
)
from torch.utils._python_dispatch import TorchDispatchMode

from f8tensor import FLOAT8_DTYPES, FORMATS, Float8Tensor, GemmConfig, float8_mm, sqnr
from f8tensor.quant.specs import CastSpec
from f8tensor.tensor import product_ops, to_float8
from f8tensor.tensor.fp4 import Float4Tensor

aten = torch.ops.aten

K, N = 64, 32  # multiples of 16, as torch._scaled_mm requires


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    out = x.float() @ w.float().t()
    return out if b is None else out + b.float()


class _OpLog(TorchDispatchMode):
    """Records (op, args) of every aten call, to check which path a product took."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- plain x FP8 weight


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("x_shape", [(16, K), (4, 8, K), (2, 3, 8, K)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
def test_matmul_plain_x_fp8_weight(x_shape, granularity, hp_dtype):
    x = torch.randn(x_shape, dtype=hp_dtype)
    w = torch.randn(N, K, dtype=hp_dtype)
    w8 = Float8Tensor.from_hp(w, granularity=granularity)
    y = x @ w8.t()
    assert type(y) is torch.Tensor
    assert y.shape == (*x_shape[:-1], N) and y.dtype == hp_dtype
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)


@pytest.mark.device_param
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("x_shape", [(16, K), (4, 8, K)], ids=["2d", "3d"])
def test_linear(x_shape, granularity, with_bias):
    x = torch.randn(x_shape, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    b = torch.randn(N, dtype=torch.bfloat16) * 4 if with_bias else None
    w8 = Float8Tensor.from_hp(w, granularity=granularity)
    y = F.linear(x, w8, b)
    assert y.shape == (*x_shape[:-1], N) and y.dtype == torch.bfloat16
    assert_sqnr(_ref(x, w, b), y, MATMUL_MIN_DB)
    if with_bias:
        # The bias is added exactly once: y - F.linear(x, w8) is b, up to bf16 rounding.
        # The bias, recovered to the output's rounding: measured 45.7-46.5 dB.
        assert_sqnr(b.expand_as(y), y - F.linear(x, w8), 42.0)


@pytest.mark.device_param
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_addmm_both_fp8(granularity, bias_dtype):
    x = torch.randn(16, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    b = torch.randn(N, dtype=bias_dtype)
    x8 = Float8Tensor.from_hp(x, granularity=granularity)
    w8 = Float8Tensor.from_hp(w, granularity=granularity)
    y = torch.addmm(b, x8, w8.t())
    assert type(y) is torch.Tensor and y.dtype == torch.bfloat16
    assert_sqnr(_ref(x, w, b), y, MATMUL_MIN_DB)


def test_addmm_alpha_beta():
    x = torch.randn(16, K)
    w = torch.randn(N, K)
    b = torch.randn(N)
    y = torch.addmm(b, x, Float8Tensor.from_hp(w).t(), beta=0.5, alpha=2.0)
    assert_sqnr(torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0), y, MATMUL_MIN_DB)


def test_addmm_beta_zero_ignores_nan_input():
    x = torch.randn(16, K)
    w = torch.randn(N, K)
    b = torch.full((N,), float("nan"))
    y = torch.addmm(b, x, Float8Tensor.from_hp(w).t(), beta=0)
    assert not y.isnan().any()
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
def test_mm_both_fp8(granularity, hp_dtype):
    x = torch.randn(16, K, dtype=hp_dtype)
    w = torch.randn(N, K, dtype=hp_dtype)
    y = torch.mm(Float8Tensor.from_hp(x, granularity=granularity), Float8Tensor.from_hp(w, granularity=granularity).t())
    assert y.dtype == hp_dtype
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)


@pytest.mark.parametrize("x_gran, w_gran", [("rowwise", "tensorwise"), ("tensorwise", "rowwise")])
def test_mixed_granularities(x_gran, w_gran):
    x = torch.randn(16, K, dtype=torch.bfloat16) * torch.logspace(-2, 2, 16, dtype=torch.bfloat16).unsqueeze(1)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    x8 = Float8Tensor.from_hp(x, granularity=x_gran)
    w8 = Float8Tensor.from_hp(w, granularity=w_gran)
    assert_sqnr(_ref(x, w), torch.mm(x8, w8.t()), MATMUL_MIN_DB)


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("x_dtype, w_dtype", [(E4M3_DTYPES[0], E5M2_DTYPES[0]), (E5M2_DTYPES[0], E4M3_DTYPES[0])])
def test_e4m3_times_e5m2(x_dtype, w_dtype, granularity):
    x = torch.randn(16, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    x8 = Float8Tensor.from_hp(x, x_dtype, granularity=granularity)
    w8 = Float8Tensor.from_hp(w, w_dtype, granularity=granularity)
    assert (x8.float8_dtype, w8.float8_dtype) == (x_dtype, w_dtype)
    # Measured 24.65-24.75 (tensorwise), 25.22-25.27 (rowwise) dB.
    assert_sqnr(_ref(x, w), torch.mm(x8, w8.t()), MATMUL_E5M2_MIN_DB)


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_plain_x_with_each_weight_format(float8_dtype):
    x = torch.randn(16, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    # Measured: e4m3fn weights 28.54 dB, e5m2 weights 24.75-24.80 dB.
    assert_sqnr(_ref(x, w), x @ Float8Tensor.from_hp(w, float8_dtype).t(), matmul_min_db(float8_dtype))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_non_contiguous_3d_activation_goes_through_bmm(granularity):
    x = torch.randn(8, 4, K, dtype=torch.bfloat16).transpose(0, 1)  # (4, 8, K), not contiguous
    assert not x.is_contiguous()
    w = torch.randn(N, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(w, granularity=granularity)
    with _OpLog() as log:
        y = x @ w8.t()
    bmm_calls = [args for func, args in log.calls if func is aten.bmm.default]
    assert len(bmm_calls) == 1, [func for func, _ in log.calls]
    b = bmm_calls[0][1]
    assert isinstance(b, Float8Tensor) and b.shape == (4, K, N) and b.stride(0) == 0  # an expanded weight
    assert y.shape == (4, 8, N) and y.dtype == torch.bfloat16
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)
    assert_sqnr(_ref(x, w), F.linear(x, w8), MATMUL_MIN_DB)


def test_bmm_with_a_batch_of_one_at_stride_0():
    """A batch of one laid out with stride 0 (as_strided of a tensorwise weight): the
    expanded-weight path with its only entry."""
    a, _, w = _structured_batch(1)
    a8 = to_float8(a[:1], CastSpec(torch.float8_e4m3fn, (1, 1, 0)))
    wt8 = to_float8(w, CastSpec(torch.float8_e4m3fn)).t()
    b8 = torch.ops.aten.as_strided.default(wt8, (1, _BMM_K, _BMM_N), (0, 1, _BMM_K))
    assert b8.stride(0) == 0
    y = torch.bmm(a8, b8)
    assert_sqnr(_dequantized(a8) @ _dequantized(wt8), y.double(), _BMM_MIN_DB[torch.float32])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_matmul_and_linear_in_inference_mode(granularity):
    """Under inference mode ``matmul`` and ``linear`` reach the table whole: PyTorch's own
    decomposition runs them, the same numbers as with autograd on."""
    x = torch.randn(2, 8, K)
    w8 = Float8Tensor.from_hp(torch.randn(N, K), granularity=granularity)
    bias = torch.randn(N)
    expected = (x @ w8.t(), F.linear(x, w8, bias))
    with torch.inference_mode():
        got = (torch.matmul(x, w8.t()), F.linear(x, w8, bias))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_contiguous_3d_activation_goes_through_mm():
    x = torch.randn(4, 8, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(torch.randn(N, K, dtype=torch.bfloat16))
    with _OpLog() as log:
        x @ w8.t()
    ops = [func for func, _ in log.calls]
    assert aten.mm.default in ops and aten.bmm.default not in ops


# ----------------------------------------------------------------------------- batched products
#
# torch.bmm(a, b) with FP8 operands of every granularity, against the product of the
# operands' dequantized values (data / scale per block, written out here) in float64. A
# kernel reads only some scales: an operand whose scale the product cannot read is first
# cast again from its dequantized fp32 values with one scale per index of its other dims
# (constant along K, the contracted dim); the reference does the same, from that
# definition, for exactly the operands the contract says:
#
# - a scale shared over the batch (block 0 at dim 0: one scale per element of an entry) is
#   always re-derived;
# - one output dtype, bf16, runs one batched grouped kernel, which reads fp32 scales
#   constant along K only: every other operand is re-derived;
# - fp32 and fp16 outputs run one product per batch entry: a true block on either side
#   takes the block-scaled path, which reads any scales; otherwise an operand whose scale
#   varies along K is re-derived;
# - a weight expanded over the batch makes one 2D product of the flattened batch: an
#   axiswise ``a`` whose scale varies along K is re-derived before it is flattened (its
#   scales do not survive the flattening), true blocks are flattened as they are; then as
#   for one entry.
#
# So every case is exact up to the product's own rounding (its output dtype); a scale of the
# wrong entry, block or axis, or a re-derivation along the wrong dim, costs tens of dB.

_BMM_B, _BMM_M, _BMM_K, _BMM_N = 3, 16, 64, 32
# Blocks of a (B, M, K) and b (B, K, N); "columns" of b is its kernel layout (one scale per
# output column, constant along K), "rows" of a likewise.
_A_BLOCKS = {"tensorwise": (), "rows": (1, 1, 0), "columns": (1, 0, 1), "batch": (0, 1, 1), "1x32": (1, 1, 32)}
_B_BLOCKS = {"tensorwise": (), "columns": (1, 0, 1), "rows": (1, 1, 0), "batch": (0, 1, 1), "32x32": (1, 32, 32)}
# Lowest SQNR (dB) over the cases, measured on CPU: fp32 out 135.9 (the products' own fp32
# rounding), fp16 out 72.8, bf16 out 54.8. Against the plain dequantized operands (no
# re-derivation: what a missing or misplaced one is compared with) they measured 29-34 dB.
_BMM_MIN_DB = {torch.float32: 120.0, torch.float16: 65.0, torch.bfloat16: 50.0}
# Block shapes no GPU kernel multiplies (1x32 with fp32 scales, 32x32) run on the reference
# path, as a GPU run of them would be asked to.
_EMULATE = GemmConfig(emulate=True)


def _structured_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a (B, M, K), b (B, K, N) and a weight w (N, K) whose magnitudes differ by powers of
    two per batch entry, row, column and K index: every scale of them is its own."""
    gen = torch.Generator().manual_seed(seed)
    B, M, K, N = _BMM_B, _BMM_M, _BMM_K, _BMM_N
    pow2 = lambda n, m, shape: (2.0 ** (torch.arange(n) % m)).reshape(shape)
    a = torch.randn(B, M, K, generator=gen) * pow2(B, 3, (B, 1, 1)) * pow2(M, 4, (1, M, 1)) * pow2(K, 3, (1, 1, K))
    b = torch.randn(B, K, N, generator=gen) / pow2(B, 3, (B, 1, 1)) * pow2(N, 5, (1, 1, N)) * pow2(K, 4, (1, K, 1))
    w = torch.randn(N, K, generator=gen) * pow2(N, 5, (N, 1)) * pow2(K, 4, (1, K))
    return a, b, w


def _dequantized(x8: Float8Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """data / scale, each scale repeated over its block (a partial edge block cut)."""
    scale = x8._scale.float()
    if scale.dim():
        for d, b in enumerate(x8._block):
            if b > 1:
                scale = scale.repeat_interleave(b, dim=d).narrow(d, 0, x8.shape[d])
    return x8._data.to(dtype) / scale.to(dtype)


def _rederived(x8: Float8Tensor, k: int) -> torch.Tensor:
    """``x8`` cast again from its dequantized fp32 values with one e4m3 scale per index of
    its other dims (448 / amax along ``k``, float64 quotient rounded to fp32), dequantized."""
    x32 = _dequantized(x8, torch.float32)
    scale = (448.0 / x32.abs().amax(k, keepdim=True).double()).float()
    data = (x32 * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data.double() / scale.double()


def _varies_along_k(block: tuple[int, ...], k: int) -> bool:
    return bool(block) and block[k] != 0


def _is_block(block: tuple[int, ...]) -> bool:
    return any(b > 1 for b in block)


def _bmm_reference(a8: Float8Tensor, b8: Float8Tensor, out_dtype: torch.dtype, flattened: bool = False) -> torch.Tensor:
    """The product of the operands the kernel reads, by the rules above, in float64."""
    a_block, b_block = a8._block if a8._scale.dim() else (), b8._block if b8._scale.dim() else ()
    batched_kernel = out_dtype == torch.bfloat16
    redo_a = (a_block[:1] == (0,) and len(set(a_block)) > 1) or (
        _varies_along_k(a_block, 2)
        and (batched_kernel or (flattened and not _is_block(a_block)) or not (_is_block(a_block) or _is_block(b_block)))
    )
    redo_b = (b_block[:1] == (0,) and len(set(b_block)) > 1) or (
        _varies_along_k(b_block, 1) and (batched_kernel or not (_is_block(a_block) or _is_block(b_block)))
    )
    a = _rederived(a8, 2) if redo_a else _dequantized(a8)
    b = _rederived(b8, 1) if redo_b else _dequantized(b8)
    return a @ b


@pytest.fixture
def consistent_operands(monkeypatch):
    """Every Float8Tensor that bmm hands to a 2D product keeps the container's invariants
    (a 0-dim scale with an all-0 block, one scale per block otherwise); the operands seen."""
    seen = []
    real = product_ops.matmul

    def spy(a, b, **kwargs):
        for t in (a, b):
            if isinstance(t, Float8Tensor):
                assert_consistent(t)
        seen.append((a, b))
        return real(a, b, **kwargs)

    monkeypatch.setattr(product_ops, "matmul", spy)
    return seen


@pytest.mark.parametrize("batch", [3, 2, 1])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("b_name", list(_B_BLOCKS))
@pytest.mark.parametrize("a_name", list(_A_BLOCKS))
def test_bmm_of_fp8_operands_of_every_granularity(a_name, b_name, out_dtype, batch, consistent_operands):
    a, b, _ = _structured_batch(0)
    a, b = a[:batch], b[:batch]
    a8 = to_float8(a.to(out_dtype), CastSpec(torch.float8_e4m3fn, _A_BLOCKS[a_name]), gemm=_EMULATE)
    b8 = to_float8(b.to(out_dtype), CastSpec(torch.float8_e4m3fn, _B_BLOCKS[b_name]), gemm=_EMULATE)
    y = torch.bmm(a8, b8)
    assert y.shape == (batch, _BMM_M, _BMM_N) and y.dtype == out_dtype
    assert_sqnr(_bmm_reference(a8, b8, out_dtype), y.double(), _BMM_MIN_DB[out_dtype])


@pytest.mark.parametrize("batch", [3, 2])
@pytest.mark.parametrize("w_block", [(), (1, 0), (32, 32)], ids=["tensorwise", "rowwise", "32x32"])
@pytest.mark.parametrize("a_name", list(_A_BLOCKS))
def test_bmm_with_a_weight_expanded_over_the_batch(a_name, w_block, batch, consistent_operands):
    """``bmm(a, w.t().expand(B, K, N))`` (what ``x @ w.t()`` of a non-contiguous 3D x
    becomes): one 2D product of the flattened batch; the same numbers as per entry. An
    ``a`` whose scales survive the flattening (per tensor, per row along K, true blocks) is
    flattened as it is: its bytes and scales, no re-cast."""
    a, _, w = _structured_batch(1)
    a8 = to_float8(a[:batch], CastSpec(torch.float8_e4m3fn, _A_BLOCKS[a_name]), gemm=_EMULATE)
    b8 = to_float8(w, CastSpec(torch.float8_e4m3fn, w_block), gemm=_EMULATE).t().expand(batch, _BMM_K, _BMM_N)
    assert b8.stride(0) == 0
    y = torch.bmm(a8, b8)
    assert y.shape == (batch, _BMM_M, _BMM_N) and y.dtype == torch.float32
    assert_sqnr(_bmm_reference(a8, b8, torch.float32, flattened=True), y.double(), _BMM_MIN_DB[torch.float32])
    ((a2, _),) = consistent_operands
    if a_name in ("tensorwise", "rows", "1x32"):
        assert a2._data.data_ptr() == a8._data.data_ptr()  # a view of the same bytes: no re-cast, no copy
        assert torch.equal(a2._data.view(torch.uint8), a8._data.reshape(-1, _BMM_K).view(torch.uint8))
        assert torch.equal(
            a2._scale, a8._scale if a_name == "tensorwise" else a8._scale.reshape(-1, a8._scale.shape[-1])
        )


@pytest.mark.parametrize("a_name", ["tensorwise", "rows"])
def test_bmm_with_a_batch_shared_operand_expanded_over_the_batch(a_name):
    """A b of one batch entry whose scales are shared over the batch (block (0, 1, 1): one
    per K and N index), expanded to B entries (stride 0): the one 2D product of the
    flattened batch re-derives b once, one scale per column along K (b's contracted dim),
    as the reference does: measured 136.8 dB (a per tensor) and 144.9 dB (a per row);
    deriving b along N first and then along K rounds twice: 27.1 dB."""
    a, b, _ = _structured_batch(2)
    a8 = to_float8(a[:3], CastSpec(torch.float8_e4m3fn, _A_BLOCKS[a_name]), gemm=_EMULATE)
    b8 = to_float8(b[:1], CastSpec(torch.float8_e4m3fn, (0, 1, 1)), gemm=_EMULATE).expand(3, _BMM_K, _BMM_N)
    assert b8.stride(0) == 0
    y = torch.bmm(a8, b8)
    assert y.shape == (3, _BMM_M, _BMM_N) and y.dtype == torch.float32
    assert_sqnr(_bmm_reference(a8, b8, torch.float32, flattened=True), y.double(), _BMM_MIN_DB[torch.float32])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_bmm_with_one_plain_operand(out_dtype):
    """A plain operand is cast like the FP8 one (e4m3, its scales along K): here per row of
    a / per column of b, so the product is exact up to that one cast of the plain side."""
    a, b, _ = _structured_batch(2)
    a, b = a.to(out_dtype), b.to(out_dtype)
    b8 = to_float8(b, CastSpec(torch.float8_e4m3fn, _B_BLOCKS["columns"]))
    a8 = to_float8(a, CastSpec(torch.float8_e4m3fn, _A_BLOCKS["rows"]))
    for y, ref in (
        (torch.bmm(a, b8), _dequantized(a8) @ _dequantized(b8)),
        (torch.bmm(a8, b), _dequantized(a8) @ _dequantized(b8)),
    ):
        assert y.dtype == out_dtype and y.shape == (_BMM_B, _BMM_M, _BMM_N)
        assert_sqnr(ref, y.double(), _BMM_MIN_DB[out_dtype])


def _grouped_operands():
    offs = torch.tensor([8, 8, 32], dtype=torch.int32)  # one empty group
    x = torch.randn(32, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(torch.randn(3, N, K, dtype=torch.bfloat16), granularity="rowwise")
    return x, w8.transpose(-2, -1), offs


def test_grouped_mm_output_dtype():
    """The kernel writes bf16; the result comes in ``out_dtype``, by default the first
    operand's (high-precision) dtype, whether it is plain or a Float8Tensor."""
    x, w8t, offs = _grouped_operands()
    y = torch._grouped_mm(x, w8t, offs=offs)
    assert y.dtype == torch.bfloat16 and y.shape == (32, N)
    assert_sqnr(torch._grouped_mm(x.float(), w8t.to_hp().float(), offs=offs), y.float(), MATMUL_MIN_DB)
    y32 = torch._grouped_mm(x, w8t, offs=offs, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and torch.equal(y32, y.float())
    assert torch._grouped_mm(x.float(), w8t, offs=offs).dtype == torch.float32
    x8 = Float8Tensor.from_hp(x, granularity="rowwise")
    assert torch._grouped_mm(x8, w8t, offs=offs).dtype == torch.bfloat16


def test_grouped_mm_refusals_name_what_is_supported():
    x, w8t, offs = _grouped_operands()
    with pytest.raises(
        NotImplementedError,
        match=r"^FP8 _grouped_mm with bias is not supported \(torch._scaled_grouped_mm takes none\)$",
    ):
        torch._grouped_mm(x, w8t, offs=offs, bias=torch.zeros(3, N, dtype=torch.bfloat16))
    supported = r"^Float8Tensor supports _grouped_mm as 2D x 3D with offs \(MoE tokens x experts\); got "
    with pytest.raises(NotImplementedError, match=supported + r"3D x 3D, offs=None\. Call \.to_hp\(\) first\.$"):
        torch._grouped_mm(x.reshape(2, 16, K), w8t)
    with pytest.raises(NotImplementedError, match=supported + r"2D x 3D, offs=None\. Call \.to_hp\(\) first\.$"):
        torch.ops.aten._grouped_mm.default(x, w8t)
    with pytest.raises(NotImplementedError, match=supported + r"2D x 2D, offs=given\. Call \.to_hp\(\) first\.$"):
        torch.ops.aten._grouped_mm.default(x, w8t[0], offs)


@pytest.mark.parametrize("beta, alpha", [(1, 1), (2, 1), (1, 2), (0.5, 3), (0, 1), (0, 2)])
def test_addmm_scales_the_product_and_the_bias(beta, alpha):
    """``beta * bias + alpha * (x @ w)``, in the product's dtype (bf16 here, with an fp32
    bias, as torch's addmm promotes nothing)."""
    x = torch.randn(16, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(torch.randn(N, K, dtype=torch.bfloat16))
    bias = torch.randn(N) * 8
    y = torch.addmm(bias, x, w8.t(), beta=beta, alpha=alpha)
    assert y.dtype == torch.bfloat16
    product = (x @ w8.t()).float()
    expected = alpha * product + (beta * bias if beta else 0)
    if beta == 0:  # the product alone, scaled: bit for bit
        assert torch.equal(y.float(), (alpha * product).bfloat16().float())
    else:  # measured 51.8-54.5 dB over five seeds: the bf16 rounding of the sum
        assert_sqnr(expected, y.float(), 45.0)


def test_addmm_with_an_fp4_bias_raises():
    x = torch.randn(16, K)
    w8 = Float8Tensor.from_hp(torch.randn(N, K))
    bias4 = Float4Tensor.from_hp(torch.randn(N), "nvfp4")
    with pytest.raises(
        NotImplementedError, match=r"^addmm with a Float8Tensor bias/input is not supported; pass it in high precision$"
    ):
        torch.addmm(bias4, x, w8.t())


# ----------------------------------------------------------------------------- output dtype


def test_output_dtype_defaults_to_first_operand():
    w8 = Float8Tensor.from_hp(torch.randn(N, K, dtype=torch.bfloat16))
    assert (torch.randn(16, K, dtype=torch.float16) @ w8.t()).dtype == torch.float16
    assert (torch.randn(16, K, dtype=torch.float32) @ w8.t()).dtype == torch.float32
    x8 = Float8Tensor.from_hp(torch.randn(16, K, dtype=torch.float32))
    assert torch.mm(x8, w8.t()).dtype == torch.float32


@pytest.mark.parametrize("x_shape", [(16, K), (4, 8, K)], ids=["2d", "3d"])
def test_gemm_config_out_dtype_fp32(x_shape):
    x = torch.randn(x_shape, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(w, gemm_config=GemmConfig(out_dtype=torch.float32))
    assert w8.gemm_config.out_dtype == torch.float32
    y = x @ w8.t()
    assert y.dtype == torch.float32
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)
    assert F.linear(x, w8, torch.zeros(N, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=dtype_name)
def test_float8_mm_hp_out_dtype(out_dtype, granularity):
    x = torch.randn(16, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(w, granularity=granularity)
    y = float8_mm(x, w8.t(), out_dtype=out_dtype)
    assert type(y) is torch.Tensor and y.dtype == out_dtype
    assert_sqnr(_ref(x, w), y, MATMUL_MIN_DB)
    bias = torch.randn(N, dtype=out_dtype)
    assert_sqnr(_ref(x, w, bias), float8_mm(x, w8.t(), bias=bias, out_dtype=out_dtype), MATMUL_MIN_DB)


# An FP8 output adds a third rounding: 2 dB under the measured values below.
FP8_OUT_MIN_DB = {
    torch.float8_e4m3fn: 24.5,
    torch.float8_e4m3fnuz: 24.5,
    torch.float8_e5m2: 21.5,
    torch.float8_e5m2fnuz: 21.5,
}


@pytest.mark.parametrize("out_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_float8_mm_fp8_out_dtype(out_dtype):
    x = torch.randn(16, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    ref = _ref(x, w)
    out_scale = FORMATS[out_dtype].max / ref.abs().max().item()
    y8 = float8_mm(x, Float8Tensor.from_hp(w).t(), out_dtype=out_dtype, out_scale=out_scale)
    assert type(y8) is Float8Tensor and y8.float8_dtype == out_dtype and y8.dtype == torch.bfloat16
    assert y8._scale.item() == pytest.approx(out_scale)
    # Two FP8 roundings of the inputs plus one of the output (e5m2: 2 mantissa bits).
    # Measured: e4m3 outputs 26.51-26.76 dB, e5m2 outputs 23.47 dB.
    assert_sqnr(ref, y8.to_hp(), FP8_OUT_MIN_DB[out_dtype])


@pytest.mark.parametrize("out_scale", [1.0, 2.0, torch.tensor(0.5)], ids=["1", "2", "0.5_tensor"])
@pytest.mark.parametrize("out_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_float8_mm_fp8_out_saturates(out_dtype, out_scale):
    fmax = FORMATS[out_dtype].max
    a = torch.full((16, K), 100.0, dtype=torch.bfloat16)  # every product is 100 * 100 * 64 = 640000
    b8 = Float8Tensor.from_hp(torch.full((N, K), 100.0, dtype=torch.bfloat16))
    for sign in (1.0, -1.0):
        y8 = float8_mm(sign * a, b8.t(), out_dtype=out_dtype, out_scale=out_scale)
        data = y8._data.float()
        assert torch.isfinite(data).all()
        assert (data == sign * fmax).all(), data.unique()
        assert (y8.to_hp().float() == sign * fmax / float(out_scale)).all()


def test_float8_mm_fp8_out_without_scale_raises():
    x, w8t = torch.randn(16, K), Float8Tensor.from_hp(torch.randn(N, K)).t()
    with pytest.raises(ValueError, match=r"an FP8 out_dtype \(torch.float8_e4m3fn\) needs out_scale"):
        float8_mm(x, w8t, out_dtype=torch.float8_e4m3fn)


def test_float8_mm_out_scale_without_fp8_out_raises():
    x, w8t = torch.randn(16, K), Float8Tensor.from_hp(torch.randn(N, K)).t()
    with pytest.raises(ValueError, match=r"out_scale is only meaningful with an FP8 out_dtype"):
        float8_mm(x, w8t, out_scale=1.0)


def test_float8_mm_bad_out_dtype_raises():
    x, w8t = torch.randn(16, K), Float8Tensor.from_hp(torch.randn(N, K)).t()
    with pytest.raises(TypeError, match=r"out_dtype must have a high-precision floating dtype"):
        float8_mm(x, w8t, out_dtype=torch.float64)


def test_float8_mm_plain_operands_raise():
    a, b = torch.randn(16, K), torch.randn(K, N)
    with pytest.raises(TypeError, match=r"float8_mm needs at least one Float8Tensor operand"):
        float8_mm(a, b)


def test_different_gemm_configs_raise():
    x8 = Float8Tensor.from_hp(torch.randn(16, K), gemm_config=GemmConfig(out_dtype=torch.float32))
    w8t = Float8Tensor.from_hp(torch.randn(N, K), gemm_config=GemmConfig(pad_inner_dim=True)).t()
    with pytest.raises(ValueError, match=r"operands of an FP8 matmul carry different GemmConfigs"):
        torch.mm(x8, w8t)


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("k, n", [(40, 32), (64, 24), (40, 24)])
def test_unaligned_shapes_raise(k, n):
    x = torch.randn(8, k)
    w8t = Float8Tensor.from_hp(torch.randn(n, k)).t()
    expected = rf"multiples of 16 \(torch._scaled_mm's rule\); got \(8x{k}\) @ \({k}x{n}\).*pad_inner_dim=True"
    with pytest.raises(ValueError, match=expected):
        x @ w8t


@pytest.mark.device_param
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("x_shape, n", [((8, 40), 24), ((2, 4, 40), 24), ((8, 7), 3), ((8, 64), 24), ((8, 40), 32)])
def test_pad_inner_dim(x_shape, n, granularity, with_bias):
    k = x_shape[-1]
    x = torch.randn(x_shape, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    w8 = Float8Tensor.from_hp(w, granularity=granularity, gemm_config=GemmConfig(pad_inner_dim=True))
    y = F.linear(x, w8, b)
    assert y.shape == (*x_shape[:-1], n)
    assert_sqnr(_ref(x, w, b), y, MATMUL_MIN_DB)


def test_pad_inner_dim_both_fp8_rowwise():
    cfg = GemmConfig(pad_inner_dim=True)
    x = torch.randn(8, 40)
    w = torch.randn(24, 40)
    x8 = Float8Tensor.from_hp(x, granularity="rowwise", gemm_config=cfg)
    w8 = Float8Tensor.from_hp(w, granularity="rowwise", gemm_config=cfg)
    assert_sqnr(_ref(x, w), torch.mm(x8, w8.t()), MATMUL_MIN_DB)


def test_mismatched_inner_dims_raise():
    x8, w8t = Float8Tensor.from_hp(torch.randn(16, 32)), Float8Tensor.from_hp(torch.randn(N, K)).t()
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(16x32 and 64x32\)"):
        torch.mm(x8, w8t)


# ----------------------------------------------------------------------------- refusals


UNSUPPORTED = {
    "sin": lambda t: torch.sin(t),
    "add_scalar": lambda t: t + 1,
    "mul": lambda t: t * 2.0,
    "sum": lambda t: t.sum(),
    "relu": lambda t: F.relu(t),
    "neg": lambda t: -t,
}
UNSUPPORTED_OP_NAMES = {
    "sin": "aten.sin.default",
    "add_scalar": "aten.add.Tensor",
    "mul": "aten.mul.Tensor",
    "sum": "aten.sum.default",
    "relu": "aten.relu.default",
    "neg": "aten.neg.default",
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_op_raises_naming_op_and_way_out(name):
    w8 = Float8Tensor.from_hp(torch.randn(N, K))
    op = UNSUPPORTED_OP_NAMES[name].replace(".", r"\.")
    with pytest.raises(NotImplementedError, match=rf"Float8Tensor does not support {op}\..*\.to_hp\(\)"):
        UNSUPPORTED[name](w8)


def test_addmm_with_fp8_bias_raises():
    x8 = Float8Tensor.from_hp(torch.randn(16, K))
    w8t = Float8Tensor.from_hp(torch.randn(N, K)).t()
    b8 = Float8Tensor.from_hp(torch.randn(16, N))
    with pytest.raises(NotImplementedError, match=r"addmm with a Float8Tensor bias/input is not supported"):
        torch.addmm(b8, x8, w8t)


# ----------------------------------------------------------------------------- autograd


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_matmul_gradients(hp_dtype, granularity, contiguous, device):
    x0 = torch.randn(8, 4, K, dtype=hp_dtype)
    x_base = x0.clone() if contiguous else x0.transpose(0, 1).contiguous()
    x = x_base.requires_grad_()
    w = torch.randn(N, K, dtype=hp_dtype, requires_grad=True)
    upstream = torch.randn(8, 4, N, dtype=hp_dtype)
    x_used = x if contiguous else x.transpose(0, 1)
    (x_used @ Float8Tensor.from_hp(w, granularity=granularity).t()).backward(upstream)

    x_ref = x.detach().float().requires_grad_()
    w_ref = w.detach().float().requires_grad_()
    x_ref_used = x_ref if contiguous else x_ref.transpose(0, 1)
    (x_ref_used @ w_ref.t()).backward(upstream.float())

    assert x.grad.dtype == hp_dtype and w.grad.dtype == hp_dtype
    assert_sqnr(x_ref.grad, x.grad, MATMUL_MIN_DB, "grad_x")
    # The weight gradient is upstream^T @ x in high precision (only w was cast): fp32 is the
    # reference itself (bit-identical on CPU); bf16 is it rounded to bf16, measured 55.67 dB.
    if hp_dtype == torch.float32 and device == "cpu":
        assert torch.equal(w_ref.grad, w.grad), f"grad_w: SQNR {sqnr(w_ref.grad, w.grad):.2f} dB, not bit-identical"
    else:
        assert_sqnr(w_ref.grad, w.grad, HP_GRAD_MIN_DB, "grad_w")
