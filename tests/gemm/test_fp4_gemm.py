"""FP4 products: the reference path through the gemm front door, the sm100 kernel's operand
and scale layouts (checked on CPU against the layout written out from its description), and
the rule rows."""

from __future__ import annotations

import pytest
import torch

import f8tensor  # noqa: F401  (fills the op tables)
from f8tensor import Float8Tensor
from f8tensor.gemm import matmul
from f8tensor.gemm.blocks import _fp4_kernel_args, _swizzle_32_4_4
from f8tensor.gemm.operands import prepare_fp4
from f8tensor.gemm.rules import BLOCK_SCALED_MM_RULES, FP4_SCALED_MM_RULES, fp4_rule_for
from f8tensor.tensor.fp4 import Float4Tensor


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return float(10 * torch.log10(ref.square().sum() / (ref - approx).square().sum()))


def _xw(m=64, k=128, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


@pytest.mark.parametrize("kind,threshold", [("nvfp4", 16.0), ("mxfp4", 14.5)])  # measured 17.5, 15.8 dB
def test_reference_product_sqnr_and_out_dtype(kind, threshold):
    x, w = _xw()
    a, b = Float4Tensor.from_hp(x, kind), Float4Tensor.from_hp(w, kind)
    y = a @ b.t()
    assert y.dtype == torch.float32 and y.shape == (64, 96)
    assert sqnr(x.double() @ w.double().t(), y) >= threshold
    # Exactly the dequantized operands' fp32 product.
    assert torch.equal(y, a.to_hp() @ b.to_hp().t())
    y16 = matmul(a, b.t(), out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.bfloat16())


def test_bias_plain_and_mixed_operands():
    x, w = _xw()
    b = Float4Tensor.from_hp(w, "nvfp4")
    bias = torch.randn(96)
    y = torch.addmm(bias, x, b.t())
    # The plain x is cast to NVFP4 1x16 along K by the operand preparation.
    x4 = Float4Tensor.from_hp(x, "nvfp4")
    assert torch.equal(y, x4.to_hp() @ b.to_hp().t() + bias)
    y_lin = torch.nn.functional.linear(x.bfloat16(), Float4Tensor.from_hp(w.bfloat16(), "mxfp4"))
    assert y_lin.dtype == torch.bfloat16
    # FP4 x FP8 (per-GEMM formats may pair them): each dequantized per block.
    w8 = Float8Tensor.from_hp(w, granularity="rowwise")
    assert torch.equal(x4 @ w8.t(), x4.to_hp() @ w8.to_hp().t())


def test_shape_mismatch_and_kernel_kind_mismatch_raise():
    x, w = _xw()
    a = Float4Tensor.from_hp(x, "nvfp4")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        a @ Float4Tensor.from_hp(w[:, :64].contiguous(), "nvfp4")
    with pytest.raises(ValueError, match="one FP4 kind"):
        prepare_fp4(a, Float4Tensor.from_hp(w, "mxfp4").t(), a_k=1, b_k=0, kernel=True)


def spec_swizzle_index(r: int, c: int, cols: int) -> int:
    """Where scale (r, c) lies in the SWIZZLE_32_4_4 layout, written out from its description:
    the scale matrix is cut into 128-row x 4-column tiles stored one after another in row-major
    tile order (512 bytes each); inside a tile, row r is read as (r % 32, r // 32 % 4), and the
    byte offset is 16 * (r % 32) + 4 * (r // 32 % 4) + (c % 4)."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + 16 * (r % 32) + 4 * ((r // 32) % 4) + c % 4


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (200, 6), (130, 3), (1, 1), (96, 8)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_swizzle_matches_spec_index_formula(rows, cols, dtype):
    raw = (torch.arange(rows * cols) % 120 + 1).to(torch.uint8).reshape(rows, cols)
    out = _swizzle_32_4_4(raw.view(dtype))
    assert out.dtype == dtype
    assert out.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    flat = out.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            assert flat[spec_swizzle_index(r, c, cols)] == raw[r, c]
    # Padding: 0 for e4m3fn (127 there is NaN), 2**0 for e8m0.
    pad = {torch.float8_e4m3fn: 0, torch.float8_e8m0fnu: 127}[dtype]
    seen = torch.zeros_like(flat, dtype=torch.bool)
    seen[[spec_swizzle_index(r, c, cols) for r in range(rows) for c in range(cols)]] = True
    assert (flat[~seen] == pad).all()


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_kernel_operands_layout_and_scale_counts(kind):
    """What the sm100 call would get (built by the code the CUDA branch runs), on CPU."""
    m, k, n = 200, 128, 96
    x, w = _xw(m, k, n)
    wblock = (16, 16) if kind == "nvfp4" else (1, 32)
    a = Float4Tensor.from_hp(x, kind)
    b = Float4Tensor.from_hp(w, kind, block=wblock).t()
    a4, b4 = prepare_fp4(a, b, a_k=1, b_k=0, kernel=True)
    # Same numbers: repacking and expanding a 16x16 block's scale over its rows are lossless.
    assert torch.equal(a4.to_hp(), a.to_hp()) and torch.equal(b4.to_hp(), b.to_hp())
    a_data, b_data, sa, sb = _fp4_kernel_args(a4, b4)
    assert a_data.dtype == b_data.dtype == torch.float4_e2m1fn_x2
    assert a_data.shape == (m, k // 2) and a_data.stride() == (k // 2, 1)  # row-major, packed along K
    assert b_data.shape == (k // 2, n) and b_data.stride() == (1, k // 2)  # column-major, packed along K
    kb = 16 if kind == "nvfp4" else 32
    want = (-(-m // 128) * 128 * -(-(k // kb) // 4) * 4, -(-n // 128) * 128 * -(-(k // kb) // 4) * 4)
    if kind == "nvfp4":
        (sa, ga), (sb, gb) = sa, sb
        assert ga.shape == gb.shape == (1,) and ga.dtype == torch.float32
    assert (sa.numel(), sb.numel()) == want
    assert sa.dtype == fp4_rule_for(kind).scale_dtype and sa.is_contiguous()
    # Packing: element 2i of a row in the low nibble (PyTorch's pack_uint4 convention).
    codes = a4.codes()
    assert torch.equal(a_data.view(torch.uint8)[0, 0] & 0xF, codes[0, 0]) and torch.equal(
        a_data.view(torch.uint8)[0, 0] >> 4, codes[0, 1]
    )


def test_fp4_rule_rows_cite_sources():
    assert [r.name for r in FP4_SCALED_MM_RULES] == ["NVFP4 1x16 x 1x16", "MXFP4 1x32 x 1x32"]
    for rule in FP4_SCALED_MM_RULES:
        assert rule in BLOCK_SCALED_MM_RULES and rule.operand_dtypes == {torch.float4_e2m1fn_x2}
        assert "ScaledBlas.cpp" in rule.sources[0] and any("common_quantized" in s for s in rule.sources)
        assert all(s.startswith(("aten/", "torch/", "check_")) for s in rule.sources)
        assert not rule.fast_accum and rule.builds.min_sm == (10, 0) and rule.k_per_element == 2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0), reason="needs an sm100 GPU"
)
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_sm100_kernel_matches_reference(kind):  # pragma: no cover - not run: no sm100 machine
    x, w = _xw(256, 256, 128)
    a = Float4Tensor.from_hp(x.cuda().bfloat16(), kind)
    b = Float4Tensor.from_hp(w.cuda().bfloat16(), kind)
    ref = a.to_hp(torch.float32) @ b.to_hp(torch.float32).t()
    assert sqnr(ref, a @ b.t()) >= 40.0
