"""Layout ops on Float8Tensor: exact, bit for bit on the FP8 bytes and the scale."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    GRANULARITIES,
    assert_bitwise_equal_f8,
    assert_consistent,
    bits,
    dequantized,
    dtype_name,
    float_bits,
)

from f8tensor import FLOAT8_DTYPES, Float8Tensor, GemmConfig
from f8tensor.quant.specs import CastSpec
from f8tensor.tensor import ops, to_float8

# A non-default config and dtype, so that dropped metadata shows.
GEMM = GemmConfig(out_dtype=torch.float32, pad_inner_dim=True)


def _f8(shape=(4, 6, 32), granularity="tensorwise", float8_dtype=torch.float8_e4m3fn) -> Float8Tensor:
    hp = torch.randn(shape, dtype=torch.bfloat16) * torch.rand(shape[:-1] + (1,), dtype=torch.bfloat16) * 10
    return Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity, gemm_config=GEMM)


def _same_values(a: Float8Tensor, expected_hp: torch.Tensor) -> None:
    """``a`` dequantizes to exactly ``expected_hp`` (itself an exact dequantization)."""
    assert_consistent(a)
    assert torch.equal(a.to_hp(), expected_hp)


def _keeps_meta(view: Float8Tensor, base: Float8Tensor) -> None:
    assert type(view) is Float8Tensor
    assert view._data.dtype == base._data.dtype
    assert view._orig_dtype == base._orig_dtype and view.dtype == base.dtype
    assert view._gemm == base._gemm


def _shares_storage(a: Float8Tensor, b: Float8Tensor) -> bool:
    return a._data.untyped_storage().data_ptr() == b._data.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- transposes


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_t_twice_is_identity(granularity):
    x8 = _f8((16, 32), granularity)
    xt = x8.t()
    _keeps_meta(xt, x8)
    assert xt.shape == (32, 16) and xt._is_view() and _shares_storage(xt, x8)
    assert xt._axiswise_dim == (None if granularity == "tensorwise" else 0)
    _same_values(xt, x8.to_hp().t())
    assert_bitwise_equal_f8(xt.t(), x8)
    assert xt.t().stride() == x8.stride()


@pytest.mark.parametrize("dims", [(0, 1), (0, 2), (1, 2), (-1, -2)])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_transpose(granularity, dims):
    x8 = _f8((4, 6, 32), granularity)
    y = x8.transpose(*dims)
    _keeps_meta(y, x8)
    assert y._is_view() and _shares_storage(y, x8)
    _same_values(y, x8.to_hp().transpose(*dims))
    assert_bitwise_equal_f8(y.transpose(*dims), x8)


@pytest.mark.parametrize("perm", [(2, 0, 1), (1, 2, 0), (0, 2, 1), (-1, 0, 1)])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_permute(granularity, perm):
    x8 = _f8((4, 6, 32), granularity)
    y = x8.permute(perm)
    _keeps_meta(y, x8)
    assert y._is_view() and _shares_storage(y, x8)
    _same_values(y, x8.to_hp().permute(perm))
    inverse = [0] * 3
    for i, p in enumerate(perm):
        inverse[p % 3] = i
    assert_bitwise_equal_f8(y.permute(inverse), x8)


# ----------------------------------------------------------------------------- view / reshape


@pytest.mark.parametrize("op", ["view", "reshape"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_view_3d_2d_3d(granularity, op):
    x8 = _f8((4, 6, 32), granularity)
    flat = getattr(x8, op)(-1, 32)
    _keeps_meta(flat, x8)
    assert flat.shape == (24, 32) and flat._is_view() and _shares_storage(flat, x8)
    _same_values(flat, x8.to_hp().reshape(24, 32))
    back = getattr(flat, op)(4, 6, 32)
    assert_bitwise_equal_f8(back, x8)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_reshape_non_contiguous_keeps_rows(granularity):
    x8 = _f8((4, 6, 32), granularity).transpose(0, 1)  # (6, 4, 32), rows still along the last dim
    flat = x8.reshape(24, 32)
    _same_values(flat, x8.to_hp().reshape(24, 32))


def test_tensorwise_reshape_may_change_last_dim():
    x8 = _f8((4, 6, 32), "tensorwise")
    y = x8.reshape(4, 192)
    _same_values(y, x8.to_hp().reshape(4, 192))
    assert_bitwise_equal_f8(y.reshape(4, 6, 32), x8)


@pytest.mark.parametrize("new_shape", [(4, 192), (24, 16, 2), (768,)])
def test_rowwise_reshape_changing_last_dim_raises(new_shape):
    x8 = _f8((4, 6, 32), "rowwise")
    with pytest.raises(NotImplementedError, match=r"cannot reshape a Float8Tensor of shape \(4, 6, 32\).*\.to_hp\(\)"):
        x8.reshape(new_shape)


def test_rowwise_view_changing_last_dim_raises():
    x8 = _f8((4, 6, 32), "rowwise")
    with pytest.raises(NotImplementedError, match=r"Only reshapes that keep the last dimension are supported"):
        x8.view(4, 6, 2, 16)


# ----------------------------------------------------------------------------- split / cat / slice


@pytest.mark.parametrize("sizes", [2, 1, [1, 3], [3, 1]], ids=["even", "ones", "1_3", "3_1"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_split_then_cat_2d(granularity, dim, sizes):
    x8 = _f8((4, 32), granularity)
    if dim != 0:
        sizes = [s * 8 for s in sizes] if isinstance(sizes, list) else sizes * 8
    pieces = x8.split(sizes, dim)
    assert len(pieces) >= 2
    expected = x8.to_hp().split(sizes, dim)
    for piece, ref in zip(pieces, expected):
        _keeps_meta(piece, x8)
        assert piece._is_view() and _shares_storage(piece, x8)
        _same_values(piece, ref)
    assert_bitwise_equal_f8(torch.cat(pieces, dim), x8)


@pytest.mark.parametrize("dim", [0, 1])
def test_split_then_cat_rowwise_along_dim0(dim):
    # A transposed rowwise tensor is scaled along dim 0 (one scale per column).
    x8 = _f8((32, 16), "rowwise").t()
    assert x8._axiswise_dim == 0 and x8._scale.shape == (1, 32)
    pieces = x8.split([4, 12], dim) if dim == 0 else x8.split([1, 15, 16], dim)
    for piece, ref in zip(pieces, x8.to_hp().split([p.shape[dim] for p in pieces], dim)):
        _same_values(piece, ref)
    assert_bitwise_equal_f8(torch.cat(pieces, dim), x8)


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_split_then_cat_3d(granularity, dim):
    x8 = _f8((4, 6, 32), granularity)
    pieces = x8.split(2, dim)
    for piece, ref in zip(pieces, x8.to_hp().split(2, dim)):
        _same_values(piece, ref)
    assert_bitwise_equal_f8(torch.cat(pieces, dim), x8)


def test_cat_of_pieces_in_another_order():
    x8 = _f8((4, 32), "rowwise")
    a, b = x8.split([1, 3], 0)
    swapped = torch.cat([b, a], 0)
    _same_values(swapped, torch.cat([x8.to_hp()[1:], x8.to_hp()[:1]], 0))


def test_cat_of_different_tensorwise_scales_raises():
    a = Float8Tensor.from_hp(torch.randn(4, 32))
    b = Float8Tensor.from_hp(torch.randn(4, 32) * 100)
    with pytest.raises(ValueError, match=r"different scales along the cat dimension.*\.to_hp\(\)"):
        torch.cat([a, b], 0)


def test_cat_with_plain_tensor_raises():
    a = Float8Tensor.from_hp(torch.randn(4, 32))
    b = torch.randn(4, 32)
    with pytest.raises(TypeError, match=r"cat of Float8Tensors with plain tensors is not supported"):
        torch.cat([a, b], 0)


def test_cat_of_different_formats_raises():
    a = Float8Tensor.from_hp(torch.randn(4, 32), torch.float8_e4m3fn)
    b = Float8Tensor.from_hp(torch.randn(4, 32), torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"cat needs Float8Tensors of one float8 dtype"):
        torch.cat([a, b], 0)


@pytest.mark.parametrize(
    "index",
    [
        (slice(1, 3),),
        (slice(None), slice(2, 5)),
        (slice(None), slice(None), slice(8, 24)),
        (slice(None, None, 2),),
        (slice(None), slice(None), slice(1, None, 3)),
    ],
    ids=["dim0", "dim1", "dim2", "dim0_step", "dim2_step"],
)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_slice(granularity, index):
    x8 = _f8((4, 6, 32), granularity)
    y = x8[index]
    _keeps_meta(y, x8)
    assert y._is_view() and _shares_storage(y, x8)
    _same_values(y, x8.to_hp()[index])
    assert torch.equal(bits(y._data), bits(x8._data[index]))


# ----------------------------------------------------------------------------- copies and conversions


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_detach(granularity):
    hp = torch.randn(8, 32, requires_grad=True)
    x8 = Float8Tensor.from_hp(hp, granularity=granularity, gemm_config=GEMM)
    d = x8.detach()
    assert x8.requires_grad and not d.requires_grad
    assert _shares_storage(d, x8)
    assert_bitwise_equal_f8(d, x8.detach())
    assert_bitwise_equal_f8(d, Float8Tensor.from_hp(hp.detach(), granularity=granularity, gemm_config=GEMM))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_clone(granularity):
    x8 = _f8((8, 32), granularity)
    c = x8.clone()
    assert_bitwise_equal_f8(c, x8)
    assert not _shares_storage(c, x8)
    assert c._scale.data_ptr() != x8._scale.data_ptr()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_contiguous_of_transposed(granularity):
    x8 = _f8((4, 6, 32), granularity).transpose(0, 1)
    c = x8.contiguous()
    assert c.is_contiguous() and c._data.is_contiguous()
    _same_values(c, x8.to_hp())


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_to_cpu(granularity):
    x8 = _f8((8, 32), granularity)
    assert_bitwise_equal_f8(x8.to("cpu"), x8)
    assert_bitwise_equal_f8(x8.to(torch.device("cpu"), copy=True), x8)


@pytest.mark.parametrize("new_dtype", [torch.float16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_to_hp_dtype_changes_outer_dtype_keeps_bytes(granularity, new_dtype):
    x8 = _f8((8, 32), granularity)
    y = x8.to(new_dtype)
    assert type(y) is Float8Tensor and y.dtype == new_dtype and y._orig_dtype == new_dtype
    assert torch.equal(bits(y._data), bits(x8._data))
    assert torch.equal(float_bits(y._scale), float_bits(x8._scale))
    assert (y._axiswise_dim, y._gemm) == (x8._axiswise_dim, x8._gemm)
    assert y.to_hp().dtype == new_dtype
    assert torch.equal(y.to_hp(), (x8._data.float() / x8._scale).to(new_dtype))


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_to_fp8_dtype_raises(float8_dtype):
    x8 = _f8((8, 32), "tensorwise", torch.float8_e4m3fn if float8_dtype != torch.float8_e4m3fn else torch.float8_e5m2)
    with pytest.raises(TypeError, match=rf"Float8Tensor.to\({float8_dtype}\) is ambiguous.*\.to_hp\(\)"):
        x8.to(float8_dtype)


def test_to_float64_raises():
    x8 = _f8((8, 32))
    with pytest.raises(TypeError, match=r"Float8Tensor.to dtype must have a high-precision floating dtype"):
        x8.to(torch.float64)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_copy_from_float8tensor(granularity):
    src = _f8((8, 32), granularity)
    dst = torch.empty_like(src)
    out = dst.copy_(src)
    assert out is dst
    assert_bitwise_equal_f8(dst, src)


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_copy_from_plain_recasts(granularity, float8_dtype):
    dst = _f8((8, 32), granularity, float8_dtype)
    src = torch.randn(8, 32, dtype=torch.bfloat16) * 7
    dst.copy_(src)
    fresh = Float8Tensor.from_hp(src, float8_dtype, granularity=granularity, gemm_config=GEMM)
    assert_bitwise_equal_f8(dst, fresh)


def test_copy_plain_into_row_slice_of_rowwise():
    x8 = _f8((8, 32), "rowwise")
    before = x8.clone()
    src = torch.randn(2, 32, dtype=torch.bfloat16) * 50
    x8[2:4].copy_(src)
    # The two rows own their scales: they are re-cast, and every other row is untouched.
    fresh = Float8Tensor.from_hp(src, granularity="rowwise", gemm_config=GEMM)
    assert_bitwise_equal_f8(x8[2:4].clone(), fresh)
    others = [0, 1, 4, 5, 6, 7]
    assert torch.equal(bits(x8._data[others]), bits(before._data[others]))
    assert torch.equal(float_bits(x8._scale[others]), float_bits(before._scale[others]))


def test_copy_between_views_sharing_one_scale():
    x8 = _f8((8, 32), "tensorwise")
    x8[0:2].copy_(x8[4:6])
    assert torch.equal(bits(x8._data[0:2]), bits(x8._data[4:6]))


@pytest.mark.parametrize(
    "granularity, index",
    [("tensorwise", (slice(0, 2),)), ("rowwise", (slice(None), slice(0, 16)))],
    ids=["tensorwise_rows", "rowwise_columns"],
)
def test_copy_plain_into_view_sharing_its_scale_raises(granularity, index):
    # A fresh scale for the view would silently rescale the elements outside it.
    x8 = _f8((8, 32), granularity)
    view = x8[index]
    src = torch.randn(view.shape, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"would change the scale it shares with elements outside the view"):
        view.copy_(src)


def test_copy_from_float8tensor_of_other_format_raises():
    dst = _f8((8, 32), float8_dtype=torch.float8_e4m3fn)
    src = _f8((8, 32), float8_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"copy_ between Float8Tensors needs one float8 dtype and one granularity"):
        dst.copy_(src)


def test_copy_into_plain_dequantizes():
    src = _f8((8, 32), "rowwise")
    dst = torch.empty(8, 32, dtype=torch.float32)
    dst.copy_(src)
    assert torch.equal(dst, src._data.float() / src._scale)


def test_copy_shape_mismatch_raises():
    dst = _f8((8, 32))
    src = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match=r"copy_ between shapes \(4, 32\) and \(8, 32\)"):
        dst.copy_(src)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_empty_like(granularity):
    x8 = _f8((4, 6, 32), granularity)
    e = torch.empty_like(x8)
    _keeps_meta(e, x8)
    assert_consistent(e)
    assert e.shape == x8.shape and e._axiswise_dim == x8._axiswise_dim
    assert not _shares_storage(e, x8)


def test_is_same_size():
    x8 = _f8((4, 6, 32))
    assert x8.is_same_size(_f8((4, 6, 32), "rowwise"))
    assert x8.is_same_size(torch.empty(4, 6, 32))
    assert not x8.is_same_size(_f8((4, 6, 16)))


# ----------------------------------------------------------------------------- views keep the subclass


VIEW_OPS = {
    "t": lambda x: x.t(),
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(1, 0),
    "view": lambda x: x.view(2, 8, 32),
    "reshape": lambda x: x.reshape(4, 4, 32),
    "slice": lambda x: x[2:10],
    "split": lambda x: x.split(4)[1],
    "expand": lambda x: x[:1].expand(3, 32),
    "detach": lambda x: x.detach(),
    "alias": lambda x: torch.ops.aten.alias.default(x),
}


@pytest.mark.parametrize("op", sorted(VIEW_OPS))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_views_keep_subclass_and_metadata(granularity, op):
    x8 = _f8((16, 32), granularity, torch.float8_e5m2fnuz)
    y = VIEW_OPS[op](x8)
    _keeps_meta(y, x8)
    assert_consistent(y)
    assert _shares_storage(y, x8)
    _same_values(y, VIEW_OPS[op](x8.to_hp()))


# ----------------------------------------------------------------------------- as_strided


def test_as_strided_tensorwise_any_layout():
    x8 = _f8((16, 32), "tensorwise")
    y = x8.as_strided((8, 16), (64, 2), 3)
    _keeps_meta(y, x8)
    assert _shares_storage(y, x8)
    assert torch.equal(bits(y._data), bits(x8._data.as_strided((8, 16), (64, 2), 3)))
    assert torch.equal(float_bits(y._scale), float_bits(x8._scale))


def test_as_strided_tensorwise_to_another_rank():
    """One scale for every byte: any layout, of any rank (the block follows the rank)."""
    x8 = _f8((4, 6, 32), "tensorwise")
    y = torch.ops.aten.as_strided.default(x8, (24, 16), (32, 2), 1)
    assert_consistent(y)
    assert torch.equal(bits(y._data), bits(x8._data.as_strided((24, 16), (32, 2), 1)))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_as_strided_as_a_permutation(granularity):
    x8 = _f8((4, 6, 32), granularity)
    target = x8.permute(2, 0, 1)
    y = x8.as_strided(target.shape, target.stride(), x8.storage_offset())
    assert_bitwise_equal_f8(y, target)
    assert_bitwise_equal_f8(x8.as_strided(x8.shape, x8.stride()), x8)


def test_as_strided_rowwise_other_layout_raises():
    x8 = _f8((16, 32), "rowwise")
    with pytest.raises(NotImplementedError, match=r"as_strided of a Float8Tensor scaled along dim 1 is only supported"):
        x8.as_strided((8, 32), (32, 1), 64)


# ----------------------------------------------------------------------------- every granularity
#
# A layout op moves elements, never values: on a Float8Tensor of any granularity,
# dequantizing after the op gives, bit for bit, the op applied to the dequantized tensor.
# The dequantization here is written from the block definition (data / scale, each scale
# repeated over its block, a partial edge block cut), not with the library's. The blocks
# are applied to a (4, 6, 72) tensor: 72 is two 32-blocks and a partial one of 8, and the
# magnitudes differ per index of every dim, so every scale is its own.

_BLOCKS = {
    "tensorwise": ((), torch.float32),
    "rows": ((1, 1, 0), torch.float32),
    "dim1": ((1, 0, 1), torch.float32),
    "dim0": ((0, 1, 1), torch.float32),
    "columns": ((0, 0, 1), torch.float32),
    "1x32": ((1, 1, 32), torch.float32),
    "2x3x16": ((2, 3, 16), torch.float32),
    "mx": ((1, 1, 32), torch.float8_e8m0fnu),
}


def _block_f8(name: str, shape=(4, 6, 72)) -> Float8Tensor:
    block, scale_dtype = _BLOCKS[name]
    gen = torch.Generator().manual_seed(7)
    hp = torch.randn(shape, generator=gen)
    for d, n in enumerate(shape):
        hp = hp * (2.0 ** (torch.arange(n) % 5 - 2)).reshape([n if i == d else 1 for i in range(len(shape))])
    return to_float8(hp.to(torch.bfloat16), CastSpec(torch.float8_e4m3fn, block, scale_dtype), gemm=GEMM)


def _moves_elements(y: Float8Tensor, expected: torch.Tensor, base: Float8Tensor) -> None:
    """``y`` dequantizes to ``expected`` bit for bit, and is a consistent Float8Tensor with
    ``base``'s format, dtypes and GemmConfig."""
    _keeps_meta(y, base)
    assert_consistent(y)
    assert y._scale.dtype == base._scale.dtype
    assert y.shape == expected.shape
    assert torch.equal(float_bits(dequantized(y)), float_bits(expected))


def _along(block: tuple[int, ...], dim: int) -> int:
    """The block entry along ``dim`` (0 for a tensorwise tensor: the whole dim)."""
    return block[dim] if block else 0


# (op, which blocks it applies to): every case that a block allows, as the layout contract
# states it: a slice or split piece starts on a block boundary with step 1 along a dim whose
# block is larger than 1; a reshape keeps the last dim and merges/splits leading dims whose
# blocks are all 1 or all 0 (tensorwise: anything).
_ANY = lambda block: True
_LEAD_MERGES = lambda block: not block or set(block[:2]) in ({1}, {0})
_LAYOUT_CASES = {
    "transpose_0_1": (lambda x: x.transpose(0, 1), _ANY),
    "transpose_-1_-3": (lambda x: x.transpose(-1, -3), _ANY),
    "transpose_1_1": (lambda x: x.transpose(1, 1), _ANY),
    "permute_2_0_1": (lambda x: x.permute(2, 0, 1), _ANY),
    "permute_-2_-1_-3": (lambda x: x.permute(-2, -1, -3), _ANY),
    "mT": (lambda x: x.mT, _ANY),
    "reshape_merge": (lambda x: x.reshape(24, 72), _LEAD_MERGES),
    "view_split": (lambda x: x.view(2, 2, 6, 72), lambda block: _along(block, 0) <= 1),
    "view_same": (lambda x: x.view(4, 6, 72), _ANY),
    "reshape_flat": (lambda x: x.reshape(-1), lambda block: not block),
    "unsqueeze_0": (lambda x: x.unsqueeze(0), _ANY),
    "unsqueeze_1": (lambda x: x.unsqueeze(1), _ANY),
    "unsqueeze_-1": (lambda x: x.unsqueeze(-1), _ANY),
    "unsqueeze_-2": (lambda x: x.unsqueeze(-2), _ANY),
    "unsqueeze_3": (lambda x: x.unsqueeze(3), _ANY),
    "cat_unsqueezed": (lambda x: torch.cat([x.unsqueeze(0), x.unsqueeze(0)]), _ANY),
    "reshape_size1_lead": (lambda x: x[:1].reshape(6, 72), _ANY),
    "expand_lead": (lambda x: x.expand(3, 4, 6, 72), _ANY),
    "expand_size1": (lambda x: x[:, :1].expand(2, 4, 5, 72), _ANY),
    "expand_size1_to_2": (lambda x: x[:, :1].expand(4, 2, 72), _ANY),
    "select_0_1": (lambda x: x.select(0, 1), _ANY),
    "select_0_-1": (lambda x: x.select(0, -1), _ANY),
    "select_0_-4": (lambda x: x.select(0, -4), _ANY),
    "select_1_5": (lambda x: x.select(1, 5), _ANY),
    "select_1_4": (lambda x: x.select(1, 4), _ANY),
    "select_-1_40": (lambda x: x.select(-1, 40), _ANY),
    "select_2_-3": (lambda x: x.select(2, -3), _ANY),
    "select_2_-9": (lambda x: x.select(2, -9), _ANY),
    "slice_0_1_3": (lambda x: x[1:3], lambda block: _along(block, 0) <= 1),
    "slice_0_2_": (lambda x: x[2:], lambda block: _along(block, 0) <= 2),
    "slice_0_-2_": (lambda x: x[-2:], lambda block: _along(block, 0) <= 2),
    "slice_0_step2": (lambda x: x[::2], lambda block: _along(block, 0) <= 1),
    "slice_0_past_end": (lambda x: x[3:100], lambda block: _along(block, 0) <= 1),
    "slice_0_empty": (lambda x: x[4:], lambda block: _along(block, 0) <= 1 or 4 % _along(block, 0) == 0),
    "slice_1_3_": (lambda x: x[:, 3:], lambda block: _along(block, 1) in (0, 1, 3)),
    "slice_1_1_5_2": (lambda x: x[:, 1:5:2], lambda block: _along(block, 1) <= 1),
    "slice_2_32_": (lambda x: x[..., 32:], lambda block: _along(block, 2) in (0, 1, 16, 32)),
    "slice_2_0_40": (lambda x: x[..., :40], _ANY),
    "slice_2_64_": (lambda x: x[..., 64:], lambda block: _along(block, 2) in (0, 1, 16, 32)),
    "slice_2_-8_": (lambda x: x[..., -8:], lambda block: _along(block, 2) in (0, 1, 16, 32)),
    "slice_2_-9_": (lambda x: x[..., -9:], lambda block: _along(block, 2) in (0, 1)),
    "narrow_2": (lambda x: x.narrow(2, 32, 16), lambda block: _along(block, 2) in (0, 1, 16, 32)),
    "slice_all": (lambda x: torch.ops.aten.slice.Tensor(x), _ANY),
    "slice_dim_only": (lambda x: torch.ops.aten.slice.Tensor(x, 2), _ANY),
    "slice_start_only": (
        lambda x: torch.ops.aten.slice.Tensor(x, 2, 32),
        lambda block: _along(block, 2) in (0, 1, 16, 32),
    ),
    "split_0": (lambda x: x.split(2)[1], lambda block: _along(block, 0) <= 2),
    "split_1_sizes": (lambda x: x.split([3, 3], 1)[1], lambda block: _along(block, 1) in (0, 1, 3)),
    "split_-1": (lambda x: x.split(32, -1)[2], lambda block: _along(block, 2) in (0, 1, 16, 32)),
    "split_2_last": (lambda x: x.split([64, 8], 2)[1], lambda block: _along(block, 2) in (0, 1, 16, 32)),
    "split_cat_0": (lambda x: torch.cat(x.split(2)[::-1]), lambda block: _along(block, 0) <= 2),
    "split_cat_-1": (lambda x: torch.cat(x.split(32, -1), -1), _ANY),
    "split_cat_1_three": (
        lambda x: torch.cat(x.split(3, 1)[::-1] + x.split(3, 1), 1),
        lambda block: _along(block, 1) in (0, 1, 3),
    ),
    "cat_one": (lambda x: torch.cat([x], 2), _ANY),
    "index_ids": (lambda x: x[torch.tensor([3, 0, -1, 2, -4])], _ANY),
    "index_no_ids": (lambda x: x[torch.tensor([], dtype=torch.int64)], _ANY),
    "index_ids_int32": (lambda x: x[torch.tensor([1, -3], dtype=torch.int32)], _ANY),
    "detach": (lambda x: x.detach(), _ANY),
    "alias": (lambda x: torch.ops.aten.alias.default(x), _ANY),
    "clone": (lambda x: x.clone(), _ANY),
    "contiguous_of_permuted": (lambda x: x.permute(2, 0, 1).contiguous(), _ANY),
}


@pytest.mark.parametrize("case", list(_LAYOUT_CASES))
@pytest.mark.parametrize("name", list(_BLOCKS))
def test_layout_ops_move_elements_of_every_granularity(name, case):
    op, applies = _LAYOUT_CASES[case]
    x8 = _block_f8(name)
    if not applies(_BLOCKS[name][0]):
        with pytest.raises(NotImplementedError, match=r"call \.to_hp\(\)"):
            op(x8)
        return
    _moves_elements(op(x8), op(dequantized(x8)), x8)


def test_layout_of_a_0_dim_and_a_1_dim_tensor():
    """Negative dims count from the end of the tensor's own rank (0 and 1 here); ``t`` of
    fewer than two dims is the tensor itself."""
    x0 = Float8Tensor.from_hp(torch.tensor(3.0), gemm_config=GEMM)
    _moves_elements(x0.transpose(-1, -1), dequantized(x0).transpose(-1, -1), x0)
    _moves_elements(x0.unsqueeze(-1), dequantized(x0).unsqueeze(-1), x0)
    _moves_elements(x0.t(), dequantized(x0), x0)
    for granularity in ("tensorwise", (32,)):
        x1 = Float8Tensor.from_hp(
            torch.randn(72) * 2.0 ** (torch.arange(72) % 5), granularity=granularity, gemm_config=GEMM
        )
        _moves_elements(x1.transpose(0, -1), dequantized(x1), x1)
        _moves_elements(x1.t(), dequantized(x1), x1)
        _moves_elements(x1.unsqueeze(-1), dequantized(x1).unsqueeze(-1), x1)
        _moves_elements(x1.unsqueeze(-2), dequantized(x1).unsqueeze(-2), x1)


@pytest.mark.parametrize("made_in_inference_mode", [False, True], ids=["normal", "inference"])
@pytest.mark.parametrize("name", ["tensorwise", "rows", "1x32"])
def test_views_in_inference_mode_are_tensors_like_their_base(name, made_in_inference_mode):
    """Under ``torch.inference_mode()`` a view of a normal Float8Tensor is a normal tensor
    (it shares its base's version counter) and a view of an inference tensor an inference
    tensor, as for plain tensors; one view or a list of them, the same elements."""
    if made_in_inference_mode:
        with torch.inference_mode():
            x8 = _block_f8(name)
    else:
        x8 = _block_f8(name)
    with torch.inference_mode():
        views = [x8.transpose(0, 1), x8[1:3], x8.view(2, 2, 6, 72)]
        pieces = x8.split(2)
    for y, expected in zip(
        views, (dequantized(x8).transpose(0, 1), dequantized(x8)[1:3], dequantized(x8).view(2, 2, 6, 72))
    ):
        assert y.is_inference() is made_in_inference_mode
        _moves_elements(y, expected, x8)
    for y, expected in zip(pieces, dequantized(x8).split(2)):
        assert y.is_inference() is made_in_inference_mode
        _moves_elements(y, expected, x8)


# ----------------------------------------------------------------------------- refusals name the problem


@pytest.mark.parametrize("name", ["tensorwise", "rows", "dim0", "2x3x16"])
def test_select_out_of_range_names_the_allowed_range(name):
    x8 = _block_f8(name)
    with pytest.raises(IndexError, match=r"^index 4 is out of range for dim 0 of size 4: allowed \[-4, 4\)$"):
        x8.select(0, 4)
    with pytest.raises(IndexError, match=r"^index -7 is out of range for dim 1 of size 6: allowed \[-6, 6\)$"):
        x8.select(-2, -7)


@pytest.mark.parametrize("name", ["tensorwise", "rows", "1x32"])
def test_index_out_of_range_names_the_offending_index(name):
    x8 = _block_f8(name)
    with pytest.raises(IndexError, match=r"^index 4 is out of range for dim 0 of size 4: allowed \[-4, 4\)$"):
        x8[torch.tensor([0, 4, 1])]
    with pytest.raises(IndexError, match=r"^index -5 is out of range for dim 0 of size 4: allowed \[-4, 4\)$"):
        x8[torch.tensor([-5, 1])]
    # Both ends out of range: the low one is named; -size itself is in range.
    with pytest.raises(IndexError, match=r"^index -6 is out of range"):
        x8[torch.tensor([7, -6])]
    with pytest.raises(IndexError, match=r"^index 4 is out of range"):
        x8[torch.tensor([-4, 4])]


def test_index_ids_off_the_host_are_not_checked_there(monkeypatch):
    """Off the host (a GPU, or traced by torch.compile) the ids are normalized without a
    host read: negative ones from the end, one below ``-size`` sent to ``size`` (out of
    range for the gather, which asserts in device code) rather than wrapped twice."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = ops._normalized_ids(torch.tensor([-1, -4, -5, 0, 3, 9]), 4)
    assert got.tolist() == [3, 0, 4, 0, 3, 9]


@pytest.mark.parametrize(
    "index",
    [
        lambda x: x[torch.tensor([[0, 1]])],
        lambda x: x[torch.tensor([True, False, True, False])],
        lambda x: x[torch.tensor([0]), torch.tensor([1])],
        lambda x: x[:, torch.tensor([1])],
        lambda x: torch.ops.aten.index.Tensor(x, [None]),
    ],
    ids=["2d_ids", "mask", "two_ids", "dim1", "none"],
)
def test_index_other_than_one_1d_integer_tensor_is_refused(index):
    x8 = _block_f8("rows")
    with pytest.raises(
        NotImplementedError,
        match=r"^Float8Tensor supports indexing with one 1D integer tensor along dim 0 \(w8\[ids\]\); call \.to_hp\(\) first$",
    ):
        index(x8)


def test_cat_refusals_name_the_mismatch():
    x8 = _block_f8("tensorwise")
    with pytest.raises(
        TypeError, match=r"^cat of Float8Tensors with plain tensors is not supported; call \.to_hp\(\) first$"
    ):
        torch.cat([x8, torch.zeros(4, 6, 72, dtype=torch.bfloat16)])
    with pytest.raises(
        ValueError,
        match=r"^cat needs Float8Tensors of one float8 dtype, original dtype, block, scale dtype and GemmConfig$",
    ):
        torch.cat([x8, _block_f8("rows")])
    other = Float8Tensor.from_hp(torch.ones(4, 6, 72, dtype=torch.bfloat16), gemm_config=GEMM)
    with pytest.raises(
        ValueError,
        match=r"^cat of Float8Tensors with different scales along the cat dimension cannot be represented without re-quantizing; call \.to_hp\(\) and cast again$",
    ):
        torch.cat([x8, other])


def test_cat_of_pieces_with_equal_scales_in_different_tensors():
    """Two casts with the same (given) scale concatenate: equal scales, not one scale object."""
    a, b = torch.randn(4, 32), torch.randn(2, 32)
    scale = torch.tensor(64.0)
    a8 = Float8Tensor.from_hp(a, scale=scale.clone(), gemm_config=GEMM)
    b8 = Float8Tensor.from_hp(b, scale=scale.clone(), gemm_config=GEMM)
    assert a8._scale is not b8._scale
    _moves_elements(torch.cat([a8, b8]), torch.cat([dequantized(a8), dequantized(b8)]), a8)


@pytest.mark.parametrize("name", ["1x32", "2x3x16"])
def test_cat_pieces_must_hold_whole_blocks_but_the_last(name):
    x8 = _block_f8(name)
    block = _BLOCKS[name][0]
    dim = 2 if block[0] == 1 else 0
    cut = block[dim] // 2
    whole, part, rest = (
        x8.narrow(dim, 0, block[dim]),
        x8.narrow(dim, 0, cut),
        x8.narrow(dim, block[dim], x8.shape[dim] - block[dim]),
    )
    torch.cat([whole, part], dim)  # a partial block last: fine
    for pieces in ([part, whole], [whole, part, rest]):
        with pytest.raises(
            ValueError,
            match=rf"^cat along dim {dim} of Float8Tensors with block {re.escape(str(block))}: every piece but the last must hold whole blocks \(a multiple of {block[dim]}\); got size {cut}$",
        ):
            torch.cat(pieces, dim)


@pytest.mark.parametrize("name", ["rows", "1x32"])
def test_as_strided_other_than_a_permutation_is_refused(name):
    x8 = _block_f8(name)
    scaling = "scaled along dim 2" if name == "rows" else "with block (1, 1, 32)"
    message = rf"^as_strided of a Float8Tensor {re.escape(scaling)} is only supported as a permutation of its dims"
    rows_1_on = x8[1:]  # at storage offset 432
    cases = [
        (x8, (6, 72), (72, 1), None),  # another rank
        (x8, (4, 6, 72), (1, 4, 24), None),  # the same sizes, other strides
        (rows_1_on, (3, 6, 72), (432, 72, 1), 0),  # its own layout at another offset
    ]
    for x, size, stride, offset in cases:
        with pytest.raises(NotImplementedError, match=message):
            torch.ops.aten.as_strided.default(x, size, stride, offset)


def test_to_and_empty_like_copy_data_and_scale():
    """``to(dtype)``, ``_to_copy`` and ``empty_like`` give new FP8 bytes and a new scale
    (nothing shared with the source), on the device asked for; ``memory_format``
    describes the outer tensor, not the 0-dim scale."""
    x8 = Float8Tensor.from_hp(torch.randn(2, 3, 4, 32, dtype=torch.bfloat16), gemm_config=GEMM)
    copies = (
        x8.to(torch.float16),
        x8.to("cpu", copy=True),
        x8.to(memory_format=torch.channels_last),
        torch.ops.aten._to_copy.default(x8),
    )
    for y in copies:
        assert not _shares_storage(y, x8) and y._scale.data_ptr() != x8._scale.data_ptr()
        _moves_elements(y, dequantized(x8), x8._replace(orig_dtype=y.dtype))
    assert copies[0].dtype == torch.float16 and copies[3].dtype == torch.bfloat16
    on_meta = x8.to("meta")
    assert on_meta._data.device.type == "meta" and on_meta._scale.device.type == "meta"
    e = torch.empty_like(x8, dtype=torch.float32, memory_format=torch.channels_last)
    assert e.dtype == torch.float32 and e._orig_dtype == torch.float32 and e.shape == x8.shape
    assert not _shares_storage(e, x8) and e._scale.data_ptr() != x8._scale.data_ptr()
    assert e._scale.shape == x8._scale.shape
    assert torch.empty_like(x8).dtype == torch.bfloat16
    e_meta = torch.empty_like(x8, device="meta")
    assert e_meta._data.device.type == "meta" and e_meta._scale.device.type == "meta"


def test_empty_like_and_to_refuse_a_dtype_that_is_not_high_precision():
    x8 = _block_f8("rows")
    with pytest.raises(
        TypeError,
        match=r"^empty_like dtype must have a high-precision floating dtype \(torch.bfloat16, torch.float16, torch.float32\); got torch.float64$",
    ):
        torch.empty_like(x8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^Float8Tensor.to dtype must have a high-precision floating dtype"):
        x8.to(torch.int32)


@pytest.mark.parametrize("name", ["rows", "mx", "2x3x16"])
def test_copy_of_a_plain_tensor_casts_it_in_the_destination_format(name):
    """A plain source is cast afresh, in the destination's original dtype (bf16 here: the
    fp32 source is rounded to bf16 first, as a fresh cast of the bf16 tensor would be),
    format, block and scale dtype: the bytes and scale of that fresh cast."""
    dst = _block_f8(name)
    src = torch.randn(4, 6, 72) * (1.0 + 2.0**-12)
    dst.copy_(src)
    fresh = to_float8(src.to(torch.bfloat16), CastSpec(torch.float8_e4m3fn, _BLOCKS[name][0], _BLOCKS[name][1]))
    assert torch.equal(bits(dst._data), bits(fresh._data))
    assert dst._scale.dtype == fresh._scale.dtype
    assert torch.equal(dst._scale.float(), fresh._scale.float())


def test_copy_refusals_name_the_mismatch():
    x8 = _block_f8("rows")
    with pytest.raises(
        ValueError, match=r"^copy_ between Float8Tensors needs one float8 dtype and one granularity \(block\)$"
    ):
        x8.copy_(_block_f8("1x32"))
    # A row of a rowwise matrix selected out of it: a view of another rank, conservatively
    # treated as sharing its scale (the square shape lines its dims up with the base's).
    square = Float8Tensor.from_hp(torch.randn(16, 16), granularity="rowwise")
    with pytest.raises(
        NotImplementedError,
        match=r"^copy_ into a view of shape \(16,\) of a Float8Tensor of shape \(16, 16\) would change the scale",
    ):
        square[3].copy_(torch.randn(16))
