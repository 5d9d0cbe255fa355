"""Operand preparation (``gemm.operands``), one rule at a time, against its stated contract.

Every product prepares its operands here: a plain operand is cast like the FP8 one, an
operand whose scales the kernel cannot read is cast again, and the kernels' layouts and
inverse scales are made. Each expected operand is built here from the rule as the module
docstring states it (a fresh cast with the spec the rule names, or the re-derivation written
out from the dequantized values), then compared bit for bit with what ``prepare`` returns.
"""

from __future__ import annotations

import pytest
import torch
from helpers import bits, dequantized, float_bits

from f8tensor import GemmConfig
from f8tensor.gemm import operands
from f8tensor.gemm.operands import BLOCKS, DENSE, GROUPED, prepare, prepare_fp4, requantize
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.quant.specs import CastSpec
from f8tensor.tensor import Float8Tensor, to_float8
from f8tensor.tensor.float8 import with_inverse_scale
from f8tensor.tensor.fp4 import Float4Tensor, to_float4

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
GEMM = GemmConfig(out_dtype=torch.float32, pad_inner_dim=True)


def _structured(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Gaussian values times a power of two per index of every dim (each scale its own)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    for d, n in enumerate(shape):
        x = x * (2.0 ** (torch.arange(n) % 5 - 2)).reshape([n if i == d else 1 for i in range(len(shape))])
    return x


def _same_f8(got: Float8Tensor, expected: Float8Tensor) -> None:
    assert type(got) is Float8Tensor
    assert (got._data.dtype, got._block, got._scale.dtype, got._orig_dtype, got._gemm) == (
        expected._data.dtype,
        expected._block,
        expected._scale.dtype,
        expected._orig_dtype,
        expected._gemm,
    )
    assert got.shape == expected.shape and got._scale.shape == expected._scale.shape
    assert torch.equal(bits(got._data), bits(expected._data))
    assert torch.equal(got._scale.float(), expected._scale.float())


def _rederived(x8: Float8Tensor, k: int, float8_dtype: torch.dtype | None = None) -> Float8Tensor:
    """The re-derivation along ``k`` from its definition: the dequantized fp32 values cast
    with one fp32 scale per index of the other dims (max / amax along ``k``)."""
    f8 = float8_dtype or x8._data.dtype
    fmax = torch.finfo(f8).max
    x32 = dequantized(x8)
    scale = (fmax / x32.abs().amax(k, keepdim=True).double()).float()
    data = (x32 * scale).clamp(-fmax, fmax).to(f8)
    block = tuple(0 if d == k % x8.dim() else 1 for d in range(x8.dim()))
    return Float8Tensor(data, scale, x8._orig_dtype, block, x8._gemm)


# ----------------------------------------------------------------------------- plain operands

# The FP8 operand: (float8 dtype, its block as a (M, K) operand a, scale dtype).
_REFS = {
    "tensorwise": (E4M3, (), torch.float32),
    "tensorwise_e5m2": (E5M2, (), torch.float32),
    "rowwise": (E4M3, (1, 0), torch.float32),
    "rowwise_fnuz": (torch.float8_e5m2fnuz, (1, 0), torch.float32),
    "1x128": (E4M3, (1, 128), torch.float32),
    "mx": (E4M3, (1, 32), E8M0),
}
_TAKES = {"dense": DENSE, "blocks": BLOCKS, "grouped": GROUPED}


def _expected_plain_spec(ref_name: str, takes, k: int, ndim: int = 2) -> CastSpec:
    """The plain operand's spec by the rule: the e4m3 format of the FP8 operand's family;
    its granularity along K (tensorwise; else one scale per row/column constant along K,
    or for block kernels the FP8 operand's K block); its scale dtype for block kernels,
    fp32 otherwise."""
    f8, block, scale_dtype = _REFS[ref_name]
    e4m3 = torch.float8_e4m3fnuz if "fnuz" in str(f8) else E4M3
    if not block:
        return CastSpec(e4m3)
    kb = block[1] if takes.blocks and any(b > 1 for b in block) else 0
    return CastSpec(
        e4m3, tuple(kb if d == k else 1 for d in range(ndim)), scale_dtype if takes.blocks else torch.float32
    )


# The grouped kernel multiplies e4m3fn only: with an fnuz operand both are re-cast (below).
@pytest.mark.parametrize(
    "ref_name, takes_name", [(r, t) for r in _REFS for t in _TAKES if not (t == "grouped" and "fnuz" in r)]
)
def test_a_plain_operand_is_cast_like_the_fp8_one(ref_name, takes_name):
    takes = _TAKES[takes_name]
    f8, block, scale_dtype = _REFS[ref_name]
    a_hp, b_hp = _structured((32, 256), 1), _structured((256, 48), 2).bfloat16()
    a8 = to_float8(a_hp, CastSpec(f8, block, scale_dtype), gemm=GEMM)
    _, got_b = prepare(a8, b_hp, takes, a_k=1, b_k=0)
    expected_b = to_float8(b_hp, _expected_plain_spec(ref_name, takes, 0), gemm=GEMM)
    _same_f8(got_b, expected_b)
    # And the other way round, with the contracted dims counted from the end.
    w8 = to_float8(b_hp.float().t().contiguous(), CastSpec(f8, block, scale_dtype), gemm=GEMM)  # (N, K)
    got_x, _ = prepare(a_hp.bfloat16(), w8, takes, a_k=-1, b_k=-1)
    _same_f8(got_x, to_float8(a_hp.bfloat16(), _expected_plain_spec(ref_name, takes, 1), gemm=GEMM))


def test_prepare_needs_one_fp8_operand():
    with pytest.raises(TypeError, match=r"^FP8 mm needs at least one Float8Tensor operand$"):
        prepare(torch.randn(4, 16), torch.randn(16, 4), DENSE, a_k=1, b_k=0)


def test_a_plain_operand_of_another_dtype_is_refused_by_name():
    a8 = to_float8(torch.randn(4, 16), CastSpec(E4M3))
    with pytest.raises(
        TypeError, match=r"^the plain operand of an FP8 matmul must have a high-precision floating dtype"
    ):
        prepare(a8, torch.randn(16, 4, dtype=torch.float64), DENSE, a_k=1, b_k=0)


def test_operands_on_two_devices_are_refused_by_name():
    a8 = to_float8(torch.randn(4, 16), CastSpec(E4M3))
    with pytest.raises(ValueError, match=r"^FP8 matmul operands must be on one device; got a on cpu, b on meta$"):
        prepare(a8, torch.randn(16, 4, device="meta"), DENSE, a_k=1, b_k=0)


# ----------------------------------------------------------------------------- fitting an operand


def test_a_scale_that_varies_along_k_is_rederived_for_dense_and_grouped_kernels():
    """Per-column scales of an (M, K) operand vary along K: the dense and grouped kernels
    get it cast again per row; the block kernels read it as it is."""
    x8 = to_float8(_structured((32, 64)).bfloat16(), CastSpec(E4M3, (0, 1)), gemm=GEMM)
    expected = _rederived(x8, 1)
    for takes in (DENSE, GROUPED):
        got, _ = prepare(x8, torch.randn(64, 16), takes, a_k=1, b_k=0)
        _same_f8(got, expected)
    got, _ = prepare(x8, torch.randn(64, 16), BLOCKS, a_k=1, b_k=0)
    assert got is x8


@pytest.mark.parametrize("block", [(0, 0), (1, 0)], ids=["one_scale", "rowwise"])
def test_e8m0_scales_constant_along_k_are_read_as_fp32(block):
    """Power-of-two (e8m0) scales that are constant along K: exact in fp32, so the dense and
    grouped kernels get the same bytes with the scales as fp32 (no second rounding)."""
    x8 = to_float8(_structured((32, 64)), CastSpec(E4M3, block, E8M0), gemm=GEMM)
    for takes in (DENSE, GROUPED):
        got, _ = prepare(x8, torch.randn(64, 16), takes, a_k=1, b_k=0)
        assert torch.equal(bits(got._data), bits(x8._data)) and got._block == x8._block
        assert got._scale.dtype == torch.float32 and torch.equal(got._scale, x8._scale.float())


def test_mx_blocks_are_rederived_for_the_grouped_kernel():
    """1x32 e8m0 blocks vary along K: the grouped kernel gets fp32 per-row scales."""
    x8 = to_float8(_structured((32, 64)), CastSpec(E4M3, (1, 32), E8M0), gemm=GEMM)
    got, _ = prepare(x8, torch.randn(64, 16), GROUPED, a_k=1, b_k=0)
    _same_f8(got, _rederived(x8, 1))


@pytest.mark.parametrize("block", [(), (1, 0)], ids=["tensorwise", "rowwise"])
def test_the_grouped_kernel_gets_e4m3fn_operands(block):
    """An e5m2 operand is cast again to e4m3fn for the grouped kernel, from its fp32
    dequantized values, with its own granularity (dynamic scale), original dtype and
    GemmConfig; the dense kernels take it as it is."""
    # 512 rows: enough values that re-casting from bf16-rounded values instead would move
    # some bytes (9 of them here, per tensor).
    x8 = to_float8(_structured((512, 64)).bfloat16(), CastSpec(E5M2, block), gemm=GEMM)
    got, _ = prepare(x8, torch.randn(64, 16), GROUPED, a_k=1, b_k=0)
    expected = to_float8(dequantized(x8), CastSpec(E4M3, block), gemm=GEMM, orig_dtype=torch.bfloat16)
    _same_f8(got, expected)
    assert prepare(x8, torch.randn(64, 16), DENSE, a_k=1, b_k=0)[0] is x8


@pytest.mark.parametrize("k", [0, 1, -1])
def test_requantize_keeps_format_original_dtype_and_gemm_config(k):
    x8 = to_float8(_structured((4, 32, 64), 3).bfloat16(), CastSpec(E5M2, (1, 1, 32)), gemm=GEMM)
    _same_f8(requantize(x8, k), _rederived(x8, k))


# ----------------------------------------------------------------------------- FP4 operands


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4"])
def test_a_plain_operand_of_an_fp4_product_is_cast_to_its_kind_along_k(kind):
    """Blocked along K as the FP4 operand is, packed along K, with its GemmConfig."""
    gemm = GemmConfig(emulate=True)
    kb = 16 if kind == "nvfp4" else 32
    a4 = to_float4(_structured((32, 64)), FP4Spec(kind, (1, kb), 1), gemm=gemm)
    b_hp = _structured((64, 48), 5)
    got_a, got_b = prepare_fp4(a4, b_hp, a_k=1, b_k=0, kernel=False)
    expected = to_float4(b_hp, FP4Spec(kind, (kb, 1), 0), gemm=gemm)
    assert got_a is a4
    assert (got_b._kind, got_b._block, got_b._pack_dim, got_b._gemm) == (kind, (kb, 1), 0, gemm)
    assert torch.equal(got_b.codes(), expected.codes()) and torch.equal(got_b._scale.float(), expected._scale.float())
    # The plain operand first: cast along its own K.
    w4 = to_float4(b_hp.t().contiguous(), FP4Spec(kind, (1, kb), 1), gemm=gemm).t()
    got_x, got_w = prepare_fp4(_structured((32, 64)), w4, a_k=1, b_k=0, kernel=False)
    assert got_w is w4 and (got_x._block, got_x._pack_dim, got_x._gemm) == ((1, kb), 1, gemm)
    assert torch.equal(got_x.codes(), to_float4(_structured((32, 64)), FP4Spec(kind, (1, kb), 1)).codes())


def test_fp4_operand_refusals_name_the_operands():
    x, w = _structured((32, 64)), _structured((64, 48))
    with pytest.raises(TypeError, match=r"^prepare_fp4 needs at least one Float4Tensor operand$"):
        prepare_fp4(x, w, a_k=1, b_k=0, kernel=False)
    with pytest.raises(
        TypeError, match=r"^the plain operand of an FP4 matmul must have a high-precision floating dtype"
    ):
        prepare_fp4(Float4Tensor.from_hp(x), w.to(torch.float64), a_k=1, b_k=0, kernel=False)
    a4 = Float4Tensor.from_hp(x, "nvfp4")
    w8 = to_float8(w, CastSpec(E4M3, (0, 1)))
    message = r"^the sm100 FP4 kernels multiply two operands of one FP4 kind; got nvfp4 x FP8 torch.float8_e4m3fn\. Use emulate=True"
    with pytest.raises(ValueError, match=message):
        prepare_fp4(a4, w8, a_k=1, b_k=0, kernel=True)
    with pytest.raises(ValueError, match=r"; got FP8 torch.float8_e4m3fn x nvfp4\."):
        prepare_fp4(w8.t(), Float4Tensor.from_hp(w.t().contiguous(), "nvfp4").t(), a_k=1, b_k=0, kernel=True)
    with pytest.raises(ValueError, match=r"; got nvfp4 x mxfp4\."):
        prepare_fp4(a4, Float4Tensor.from_hp(w.t().contiguous(), "mxfp4").t(), a_k=1, b_k=0, kernel=True)
    # Without the kernel an FP8 operand is kept as it is.
    assert prepare_fp4(a4, w8, a_k=1, b_k=0, kernel=False)[1] is w8


def test_fp4_kernel_operands_have_one_scale_per_row_and_k_block():
    """For the sm100 kernels: both packed along K; a 16x16-blocked weight's scales repeated
    over the 16 rows (here: columns of b = w.t()) of each block, the codes unchanged."""
    x, w = _structured((32, 64)), _structured((48, 64), 6)
    a4 = to_float4(x, FP4Spec("nvfp4", (1, 16), 1))
    w4 = to_float4(w, FP4Spec("nvfp4", (16, 16), 1))
    got_a, got_b = prepare_fp4(a4, w4.t(), a_k=1, b_k=0, kernel=True)
    assert (got_a._block, got_a._pack_dim) == ((1, 16), 1) and torch.equal(got_a._scale.float(), a4._scale.float())
    assert (got_b._block, got_b._pack_dim, got_b.shape) == ((16, 1), 0, (64, 48))
    assert torch.equal(got_b.codes(), w4.codes().t())
    assert torch.equal(got_b._scale.float(), w4._scale.t().float().repeat_interleave(16, dim=1))
    assert torch.equal(got_b.dequantize(torch.float32), w4.dequantize(torch.float32).t())


# ----------------------------------------------------------------------------- layouts and scales


def _standard(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape).stride()


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "traced"])
def test_row_major_gives_what_the_kernels_check(compiling, monkeypatch):
    """The last two dims row-major as the kernels check them (unit stride along the last,
    rows at least a row apart): a copy in standard strides where they are not, also for a
    size-1 dim that ``.contiguous()`` would leave with its short stride; eager keeps a
    row-major operand. ``traced``: the path torch.compile takes, which reads no strides
    and always hands over standard strides."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    base = torch.randn(3, 16, 8).to(E4M3)
    short = torch.randn(8, 1).to(E4M3).t()  # (1, 8) with stride (1, 1): contiguous, not row-major
    assert short.is_contiguous() and short.stride() == (1, 1)
    for t, kept in ((base, True), (base[:, :1], True), (base.transpose(-2, -1), False), (short, False)):
        got = operands.row_major(t)
        assert torch.equal(bits(got), bits(t))
        if kept and not compiling:
            assert got is t
        else:
            assert got.stride() == _standard(tuple(t.shape)), (t.shape, t.stride(), got.stride())


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "traced"])
def test_col_major_gives_column_major_matrices(compiling, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    base = torch.randn(3, 16, 8).to(E4M3)
    short = torch.randn(3, 16).to(E4M3).unsqueeze(-1)  # (3, 16, 1), stride (16, 1, 1): not column-major
    assert short.stride() == (16, 1, 1)
    for t in (base, base.transpose(-2, -1), base[:, :, :1], base[:, :1], short):
        got = operands.col_major(t)
        rows, cols = t.shape[-2:]
        assert torch.equal(bits(got), bits(t))
        assert got.stride() == (rows * cols, 1, rows), (t.shape, t.stride(), got.stride())
    if not compiling:
        cm = base.transpose(-2, -1).contiguous().transpose(-2, -1)
        assert operands.col_major(cm) is cm


def test_inverse_scale_uses_a_kept_reciprocal_else_computes_it():
    x8 = to_float8(torch.randn(4, 16), CastSpec(E4M3))
    x8._inv_scale = torch.tensor(0.5)  # a marker, not the reciprocal
    assert torch.equal(float_bits(operands.inverse_scale(x8)), float_bits(torch.tensor(0.5)))
    x8._inv_scale = None
    assert torch.equal(float_bits(operands.inverse_scale(x8)), float_bits(x8._scale.reciprocal()))


def test_a_compiled_product_reads_each_input_operands_own_kept_inverse():
    """A Float8Tensor input carrying an eager inverse: read per call, never a stale constant."""
    product = torch.compile(lambda x, w8: x @ w8.t(), fullgraph=True)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    for spread in (1.0, 7.0, 0.01):
        w8 = with_inverse_scale(to_float8((torch.randn(64, 32) * spread).to(torch.bfloat16), CastSpec(E4M3)))
        assert w8._inv_scale is not None
        assert torch.equal(product(x, w8), x @ w8.t())


def test_kernel_scale_broadcasts_and_lays_out_the_inverse():
    one = torch.tensor(0.25)
    got = operands.kernel_scale(one, (2, 3, 1), (2, 3))
    assert got.shape == (2, 3) and got.is_contiguous() and torch.equal(got, torch.full((2, 3), 0.25))
    rows = torch.arange(6.0).reshape(2, 3, 1)
    got = operands.kernel_scale(rows, (2, 3, 1), (2, 3))
    assert got.is_contiguous() and torch.equal(got, rows.reshape(2, 3))
    cols = torch.arange(4.0).reshape(1, 4).t()  # a (4, 1) view with stride (1, 1)
    got = operands.kernel_scale(cols.t(), (5, 4), (5, 4))
    assert got.is_contiguous() and got.stride() == (4, 1) and torch.equal(got, torch.arange(4.0).expand(5, 4))
