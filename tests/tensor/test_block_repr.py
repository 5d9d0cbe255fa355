"""One representation for every granularity: the block shape, its scale shape, layout ops.

Every layout op is checked against the same op applied to the dequantized tensor
(bit for bit: dequantization is elementwise per block), and flatten/unflatten against
the original (bit for bit, equal metadata).
"""

from __future__ import annotations

import pytest
import torch

from f8tensor import BLOCK_1x128, BLOCK_128x128, BlockGranularity, Float8Tensor, Granularity, MX_1x32
from f8tensor.quant.specs import layout_block, spec_block
from tests.helpers import assert_bitwise_equal_f8, assert_consistent

E8M0 = torch.float8_e8m0fnu

# (granularity spelling, shape, expected block, expected scale shape, scale dtype)
CASES = {
    "tensorwise": ("tensorwise", (5, 300), (0, 0), (), torch.float32),
    "rowwise": ("rowwise", (5, 300), (1, 0), (5, 1), torch.float32),
    "1x128": (BLOCK_1x128, (5, 300), (1, 128), (5, 3), torch.float32),
    "1x128_tuple": ((1, 128), (5, 256), (1, 128), (5, 2), torch.float32),
    "128x128": (BLOCK_128x128, (200, 300), (128, 128), (2, 3), torch.float32),
    "mx_1x32": (MX_1x32, (5, 70), (1, 32), (5, 3), E8M0),
    "1x128_3d": (BLOCK_1x128, (2, 3, 256), (1, 1, 128), (2, 3, 2), torch.float32),
    "per_expert_rowwise": ("rowwise", (4, 6, 32), (1, 1, 0), (4, 6, 1), torch.float32),
}


def _hp(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # A per-row spread of magnitudes, so that different blocks get different scales.
    rows = torch.logspace(-3, 3, shape[-2] if len(shape) > 1 else 1)
    x = torch.randn(shape, generator=g)
    return (x * rows.reshape(-1, 1)).to(torch.bfloat16) if len(shape) > 1 else x.to(torch.bfloat16)


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_and_scale_shape(case):
    gran, shape, block, scale_shape, scale_dtype = CASES[case]
    x8 = Float8Tensor.from_hp(_hp(shape), granularity=gran)
    assert x8._block == block
    assert tuple(x8._scale.shape) == scale_shape
    assert x8._scale.dtype == scale_dtype
    assert_consistent(x8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_flatten_unflatten_exact_inverse(case):
    gran, shape, *_ = CASES[case]
    x8 = Float8Tensor.from_hp(_hp(shape), granularity=gran)
    names, meta = x8.__tensor_flatten__()
    back = Float8Tensor.__tensor_unflatten__({n: getattr(x8, n) for n in names}, meta, x8.shape, x8.stride())
    assert_bitwise_equal_f8(x8, back)
    assert back.__tensor_flatten__()[1] == meta


def test_old_spellings_keep_their_meaning():
    x = _hp((8, 32))
    assert Float8Tensor.from_hp(x).granularity is Granularity.TENSORWISE
    assert Float8Tensor.from_hp(x).axiswise_dim is None
    r8 = Float8Tensor.from_hp(x, granularity="rowwise")
    assert (r8.granularity, r8.axiswise_dim, r8.t().axiswise_dim) == (Granularity.ROWWISE, 1, 0)
    # Tensorwise has one spelling, the spec's (): a Float8Tensor stores it per dim (all 0,
    # with a 0-dim scale) and reads it back through one translation.
    t8 = Float8Tensor.from_hp(x)
    assert (t8._block, t8._scale.dim(), t8._scale_block) == ((0, 0), 0, ())
    assert (layout_block((), 3), spec_block((0, 0, 0), 0), spec_block((1, 0), 2)) == ((0, 0, 0), (), (1, 0))


def test_block_tensor_has_no_axiswise_dim():
    x8 = Float8Tensor.from_hp(_hp((8, 256)), granularity=BLOCK_1x128)
    assert x8.granularity == BlockGranularity((1, 128))
    assert x8.is_blockwise
    with pytest.raises(ValueError, match=r"block-scaled Float8Tensor \(block \(1, 128\)\) has no axiswise_dim"):
        _ = x8.axiswise_dim


@pytest.mark.parametrize(
    "bad, message",
    [
        ((1, -2), r"non-empty tuple of ints in \[0, 2\*\*63\)"),
        ((1, 2, 3), r"block \(1, 2, 3\) needs a tensor with at least 3 dims"),
        (BlockGranularity((1, 32), torch.float16), r"scale_dtype must be one of"),
        (BlockGranularity((1, 32), E8M0, "round"), r"scale_mode must be one of \('rceil', 'floor'\)"),
    ],
)
def test_bad_block_spelling_raises(bad, message):
    with pytest.raises(ValueError, match=message):
        Float8Tensor.from_hp(_hp((4, 64)), granularity=bad)


def test_block_as_list_raises():
    with pytest.raises(TypeError, match=r"a block shape is a tuple, not a list"):
        Float8Tensor.from_hp(_hp((4, 64)), granularity=[1, 128])


def test_given_block_scale_shape_checked():
    with pytest.raises(ValueError, match=r"block \(1, 128\) scale for shape \(4, 300\) must have shape \(4, 3\)"):
        Float8Tensor.from_hp(_hp((4, 300)), granularity=BLOCK_1x128, scale=torch.ones(4, 2))
    with pytest.raises(TypeError, match=r"scale must be torch.float8_e8m0fnu"):
        Float8Tensor.from_hp(_hp((4, 64)), granularity=MX_1x32, scale=torch.ones(4, 2))


# ----------------------------------------------------------------------------- layout ops

BLOCKED = ["1x128", "128x128", "mx_1x32", "1x128_3d"]


def _check_like(out8: Float8Tensor, ref_hp: torch.Tensor) -> None:
    """``out8`` is consistent and dequantizes to exactly ``ref_hp``."""
    assert_consistent(out8)
    assert out8.shape == ref_hp.shape
    assert torch.equal(out8.to_hp(), ref_hp)


def _f8(case):
    gran, shape, *_ = CASES[case]
    return Float8Tensor.from_hp(_hp(shape), granularity=gran)


@pytest.mark.parametrize("case", BLOCKED)
def test_transpose_permute_round_trip(case):
    x8 = _f8(case)
    hp = x8.to_hp()
    _check_like(x8.transpose(-1, -2), hp.transpose(-1, -2))
    assert_bitwise_equal_f8(x8.transpose(-1, -2).transpose(-1, -2), x8)
    if x8.dim() == 2:
        _check_like(x8.t(), hp.t())
        assert x8.t()._block == x8._block[::-1]
    else:
        _check_like(x8.permute(2, 0, 1), hp.permute(2, 0, 1))


@pytest.mark.parametrize("case", ["1x128_3d", "mx_1x32"])
def test_view_3d_2d_activation_flattening(case):
    x8 = _f8(case)
    hp = x8.to_hp()
    if x8.dim() == 3:
        flat = x8.reshape(-1, x8.shape[-1])
        _check_like(flat, hp.reshape(-1, hp.shape[-1]))
        assert flat._block == (1, 128)
        back = flat.view(x8.shape)
        assert_bitwise_equal_f8(back, x8)
    else:
        up = x8.view(1, *x8.shape)
        _check_like(up, hp.view(1, *hp.shape))
        assert up._block == (1, 1, 32)
        _check_like(x8.unsqueeze(1), hp.unsqueeze(1))


def test_view_cutting_blocks_raises():
    w8 = Float8Tensor.from_hp(_hp((256, 256)), granularity=BLOCK_128x128)
    with pytest.raises(NotImplementedError, match=r"block \(128, 128\) to \(2, 128, 256\).*share a block"):
        w8.view(2, 128, 256)
    x8 = Float8Tensor.from_hp(_hp((4, 256)), granularity=BLOCK_1x128)
    with pytest.raises(NotImplementedError, match=r"Only reshapes that keep the last dimension"):
        x8.view(4, 2, 128)


@pytest.mark.parametrize("case", BLOCKED)
def test_slice_at_block_boundaries(case):
    x8 = _f8(case)
    hp = x8.to_hp()
    b = x8._block[-1]
    _check_like(x8[..., b:], hp[..., b:])
    _check_like(x8[..., : b + 5], hp[..., : b + 5])  # ends inside a block: a partial last block
    r = x8._block[0]
    _check_like(x8[r:], hp[r:])  # rows: from a row-block boundary
    with pytest.raises(NotImplementedError, match=rf"would cut a block along dim {x8.dim() - 1}.*multiple of {b}"):
        x8[..., 3:]


def test_slice_rows_of_128x128_cuts_blocks():
    w8 = _f8("128x128")
    _check_like(w8[128:], w8.to_hp()[128:])
    with pytest.raises(NotImplementedError, match=r"would cut a block along dim 0"):
        w8[64:]


@pytest.mark.parametrize("case", BLOCKED)
def test_split_cat_round_trip(case):
    x8 = _f8(case)
    b = x8._block[-1]
    pieces = x8.split(b, dim=-1)
    for piece, ref in zip(pieces, x8.to_hp().split(b, dim=-1)):
        _check_like(piece, ref)
    assert_bitwise_equal_f8(torch.cat(pieces, dim=-1), x8)
    rows = x8.split([1, x8.shape[0] - 1], dim=0) if x8._block[0] == 1 else x8.split(128, dim=0)
    assert_bitwise_equal_f8(torch.cat(rows, dim=0), x8)


def test_cat_of_partial_blocks_raises():
    x8 = Float8Tensor.from_hp(_hp((4, 256)), granularity=BLOCK_1x128)
    a, b = x8[:, :128], x8[:, :100]
    with pytest.raises(ValueError, match=r"every piece but the last must hold whole blocks"):
        torch.cat([b, a], dim=1)


@pytest.mark.parametrize("case", BLOCKED)
def test_select(case):
    x8 = _f8(case)
    hp = x8.to_hp()
    _check_like(x8[1], hp[1])
    _check_like(x8.select(-1, 130 % x8.shape[-1]), hp.select(-1, 130 % hp.shape[-1]))


@pytest.mark.parametrize("case", BLOCKED)
def test_detach_alias_clone_to(case):
    x8 = _f8(case)
    for out in (x8.detach(), torch.ops.aten.alias(x8), x8.clone(), x8.to("cpu"), x8.to(torch.float32)):
        assert out._block == x8._block
        assert_consistent(out)
        assert torch.equal(out._data.view(torch.uint8), x8._data.view(torch.uint8))
    assert x8.to(torch.float32).dtype == torch.float32


def test_expand_leading_dim():
    x8 = Float8Tensor.from_hp(_hp((4, 256)), granularity=BLOCK_1x128)
    e = x8.expand(3, 4, 256)
    _check_like(e, x8.to_hp().expand(3, 4, 256))
    assert e._block == (1, 1, 128)


@pytest.mark.parametrize("case", ["128x128", "mx_1x32"])
def test_compiled_function_returning_views(case):
    x8 = _f8(case)
    for fn in (lambda t: t.t(), lambda t: t.detach(), lambda t: t.transpose(0, 1)):
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x8)
        assert_bitwise_equal_f8(out, fn(x8))
