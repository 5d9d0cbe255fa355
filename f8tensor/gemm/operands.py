"""Operand preparation, once for every product kind (dense, block-scaled, grouped).

A kernel takes FP8 operands whose scales it can read (:class:`Takes`): the dense kernels
one scale per tensor or per row/column (constant along K), the block-scaled kernels blocks,
the grouped kernel fp32 per-row scales of e4m3fn operands. :func:`prepare` turns any pair
of operands (at least one a Float8Tensor) into such a pair:

1. a plain operand is cast like the other one (its e4m3 format, its granularity along K);
2. an operand whose scale varies along K is re-quantized along the other axis (one extra
   rounding, and the product stays in FP8);
3. an operand of another format is re-cast to e4m3fn where the kernel multiplies nothing else.

Products with an FP4 operand (:class:`~f8tensor.tensor.fp4.Float4Tensor`) are prepared by
:func:`prepare_fp4`: a plain operand is cast to the FP4 operand's format with its K block;
for the sm100 kernels both operands are FP4 of one kind, packed along K, with per-row
(1x16 / 1x32) scales: 2D weight blocks are expanded to rows, which is lossless.

And the layouts the kernels read: :func:`row_major`, :func:`col_major` (FP8 copies only
where needed), :func:`inverse_scale` (the dequantization factor ``1 / scale``) and
:func:`kernel_scale` (that factor broadcast and laid out as a kernel reads it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from f8tensor.gemm.check import is_col_major, is_row_major
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.kernels.layouts import to_column_major
from f8tensor.quant.formats import E8M0, check_hp_dtype, e4m3_like
from f8tensor.quant.scaling import inverse_scale_of
from f8tensor.quant.specs import CastSpec, axiswise_block, constant_along, is_tensorwise
from f8tensor.tensor.float8 import Float8Tensor, dequantize, is_float8, to_float8
from f8tensor.tensor.fp4 import Float4Tensor, is_float4, to_float4

__all__ = [
    "BLOCKS",
    "DENSE",
    "GROUPED",
    "Takes",
    "check_devices",
    "col_major",
    "inverse_scale",
    "kernel_scale",
    "prepare",
    "prepare_fp4",
    "requantize",
    "row_major",
]


class Takes(NamedTuple):
    """What a kind of kernel reads: ``blocks`` (block scales along K; otherwise only one
    scale per tensor or per row/column, constant along K), ``fp32_scales`` (fp32 scales
    only), ``e4m3fn`` (e4m3fn operands only)."""

    blocks: bool = False
    fp32_scales: bool = False
    e4m3fn: bool = False


#: ``torch._scaled_mm``: tensorwise and rowwise scales, e4m3/e5m2 operands (``rules.scaled_mm``).
DENSE = Takes()
#: ``torch.nn.functional.scaled_mm``'s block-scaled kernels (and the reference path).
BLOCKS = Takes(blocks=True)
#: ``torch._scaled_grouped_mm``: fp32 scales per row/column, e4m3fn operands.
GROUPED = Takes(fp32_scales=True, e4m3fn=True)


def prepare(a: torch.Tensor, b: torch.Tensor, takes: Takes, *, a_k: int, b_k: int) -> tuple[Float8Tensor, Float8Tensor]:
    """Both operands of ``a @ b`` as Float8Tensors a kernel of kind ``takes`` reads; ``a_k``
    and ``b_k`` are the dims each contracts over. At least one must be a Float8Tensor."""
    check_devices(a, b)
    ref, ref_k = (a, a_k) if is_float8(a) else (b, b_k)
    if not is_float8(ref):
        raise TypeError("FP8 mm needs at least one Float8Tensor operand")
    if not is_float8(a):
        a = _cast_like(a, a_k, ref, ref_k, takes)
    if not is_float8(b):
        b = _cast_like(b, b_k, ref, ref_k, takes)
    return _fit(a, a_k, takes), _fit(b, b_k, takes)


def prepare_fp4(
    a: torch.Tensor, b: torch.Tensor, *, a_k: int, b_k: int, kernel: bool
) -> tuple[Float4Tensor | Float8Tensor, Float4Tensor | Float8Tensor]:
    """Both operands of ``a @ b`` (at least one a Float4Tensor): a plain one cast to the FP4
    operand's kind with its block along K (packed along K); a Float8Tensor kept (the
    reference path dequantizes each operand per block). With ``kernel``: both FP4 of one
    kind, packed along K, one scale per row and K-block (what the sm100 kernels read)."""
    check_devices(a, b)
    ref, ref_k = (a, a_k) if is_float4(a) else (b, b_k)
    if not is_float4(ref):
        raise TypeError("prepare_fp4 needs at least one Float4Tensor operand")
    if not isinstance(a, (Float4Tensor, Float8Tensor)):
        a = _cast_like_fp4(a, a_k, ref, ref_k)
    if not isinstance(b, (Float4Tensor, Float8Tensor)):
        b = _cast_like_fp4(b, b_k, ref, ref_k)
    if not kernel:
        return a, b
    if not (is_float4(a) and is_float4(b)) or a._kind != b._kind:
        raise ValueError(
            f"the sm100 FP4 kernels multiply two operands of one FP4 kind; got {_format_name(a)} x "
            f"{_format_name(b)}. Use emulate=True for the reference path."
        )
    return _fp4_rows(a, a_k), _fp4_rows(b, b_k)


def _format_name(x: Float4Tensor | Float8Tensor) -> str:
    return x._kind if is_float4(x) else f"FP8 {x._data.dtype}"


def _cast_like_fp4(x: torch.Tensor, k: int, ref: Float4Tensor, ref_k: int) -> Float4Tensor:
    check_hp_dtype(x.dtype, "the plain operand of an FP4 matmul")
    k = k % x.dim()
    block = tuple(ref._block[ref_k] if d == k else 1 for d in range(x.dim()))
    return to_float4(x, FP4Spec(ref._kind, block, k), gemm=ref._gemm)


def _fp4_rows(x: Float4Tensor, k: int) -> Float4Tensor:
    """``x`` packed along ``k`` with one scale per row and K-block (a 16x16 block's scale
    repeated over its 16 rows: the same values, as the kernels read them)."""
    x = x.repacked(k)
    other = 1 - k % 2
    rows = x._block[other]
    if rows == 1:
        return x
    scale = x._scale.repeat_interleave(rows, dim=other)
    block = tuple(1 if d == other else b for d, b in enumerate(x._block))
    return x._replace(scale=scale, block=block)


def check_devices(a: torch.Tensor, b: torch.Tensor) -> None:
    """Both operands of a product on one device, else an error naming both. Metadata only
    (no sync); checked before anything runs: a CPU kernel handed a meta operand returns
    uninitialised memory, and a plain operand is cast on its own device."""
    if a.device != b.device:
        raise ValueError(f"FP8 matmul operands must be on one device; got a on {a.device}, b on {b.device}")


def _cast_like(x: torch.Tensor, k: int, ref: Float8Tensor, ref_k: int, takes: Takes) -> Float8Tensor:
    """A plain operand cast with a dynamic scale, in the e4m3 format of ``ref``'s family
    (cuBLASLt refuses e5m2 x e5m2) and with ``ref``'s granularity along K: tensorwise, or one
    scale per row/column constant along K, or (for block kernels) ``ref``'s K block."""
    check_hp_dtype(x.dtype, "the plain operand of an FP8 matmul")
    block: tuple[int, ...]
    if is_tensorwise(ref._scale_block):
        block = ()
    else:
        kb = ref._block[ref_k] if takes.blocks and ref.is_blockwise else 0
        k = k % x.dim()
        block = tuple(kb if d == k else 1 for d in range(x.dim()))
    scale_dtype = ref._scale.dtype if takes.blocks else torch.float32
    return to_float8(x, CastSpec(e4m3_like(ref._data.dtype), block, scale_dtype), gemm=ref._gemm)


def _fit(x: Float8Tensor, k: int, takes: Takes) -> Float8Tensor:
    """``x`` re-quantized where its scale varies along K (or its scales or format are ones
    the kernel does not read)."""
    if not takes.blocks and x._scale.dtype == E8M0 and constant_along(x._scale_block, k):
        # A tensorwise/axiswise e8m0 scale (a BlockGranularity with 0 entries): powers of two,
        # exact in fp32, which the dense and grouped kernels read. No re-rounding of the data.
        x = x._replace(scale=x._scale.to(torch.float32))
    fits = constant_along(x._scale_block, k) and (not takes.fp32_scales or x._scale.dtype == torch.float32)
    if not takes.blocks and not fits:
        x = requantize(x, k)
    if takes.e4m3fn and x._data.dtype != torch.float8_e4m3fn:
        # The grouped kernel multiplies e4m3fn only: one extra rounding.
        # Deliberate upcast to fp32 between the two roundings, not to the original dtype.
        x = to_float8(
            dequantize(x, torch.float32),
            CastSpec(torch.float8_e4m3fn, x._scale_block),
            gemm=x._gemm,
            orig_dtype=x._orig_dtype,
        )
    return x


def requantize(x: Float8Tensor, k: int) -> Float8Tensor:
    """``x`` cast again with one fp32 scale per index of its other dims, constant along ``k``.

    Deliberate upcast to fp32 between the two roundings, not to the original dtype."""
    spec = CastSpec(x._data.dtype, axiswise_block(k, x.dim()))
    return to_float8(dequantize(x, torch.float32), spec, gemm=x._gemm, orig_dtype=x._orig_dtype)


# ===================================================================== layouts and scales


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims stored row-major as the kernels check it: an FP8 copy
    only if they are not (in standard strides: ``.contiguous()`` alone would keep a size-1
    dim's short stride, which the grouped kernel's stride rule refuses)."""
    if torch.compiler.is_compiling():
        # Dynamo cannot read the strides of a tensor made inside the graph when they are
        # symbolic; inductor lays out such intermediates in standard strides anyway. A size-1
        # dim (static under dynamo, which specializes 0 and 1) may keep its short stride
        # through .contiguous(): copy to standard strides then.
        if t.shape[-2] == 1:
            return t.clone(memory_format=torch.contiguous_format)
        return t.contiguous()
    return t if is_row_major(t) else t.clone(memory_format=torch.contiguous_format)


def col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims stored column-major (an FP8 copy only if they are not):
    the layout every kernel's second operand needs."""
    if torch.compiler.is_compiling():
        tt = t.transpose(-2, -1)  # see row_major
        if t.shape[-1] == 1:
            return tt.clone(memory_format=torch.contiguous_format).transpose(-2, -1)
        # .contiguous() is a no-op on a contiguous tensor; no stride is read here (see
        # scaling.materialized: dynamo cannot read them in a backward with dynamic shapes).
        return tt.contiguous().transpose(-2, -1)
    if is_col_major(t):
        return t
    # One copy into a column-major buffer (batch dims contiguous over the matrices).
    return to_column_major(t)


def inverse_scale(x: Float8Tensor) -> torch.Tensor:
    """``1 / x._scale``, the dequantization factor the kernels take, in the scale's dtype:
    exact for e8m0 (powers of two; the reciprocal is taken in fp32). The one its cast
    computed when there is one (eager: ``tensor.with_inverse_scale``), else computed here."""
    inv = None if torch.compiler.is_compiling() else x._inv_scale
    return inverse_scale_of(x._scale) if inv is None else inv


def kernel_scale(inverse: torch.Tensor, expand_to: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """An inverse scale as a kernel reads it: broadcast over ``expand_to`` (a 0-dim one
    to every entry), viewed as ``shape``, contiguous."""
    return inverse.expand(expand_to).reshape(shape).contiguous()
