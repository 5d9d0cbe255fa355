"""Operand preparation, once for every product kind (dense, block-scaled, grouped).

:func:`prepare` turns any pair of operands (at least one a Float8Tensor) into one the
kernel kind reads (:class:`Takes`): a plain operand is cast like the other (its e4m3
format and granularity along K); an operand whose scale varies along K is re-quantized
along the other axis; another format is re-cast to e4m3fn where the kernel takes only
that. :func:`prepare_fp4` does the same for FP4 operands. Also the layouts the kernels
read (:func:`row_major`, :func:`col_major`) and their scales (:func:`inverse_scale`,
:func:`kernel_scale`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from f8tensor.gemm.check import is_col_major, is_row_major
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.kernels.layouts import to_column_major
from f8tensor.quant.formats import E8M0, check_hp_dtype, e4m3_like
from f8tensor.quant.scaling import inverse_scale_of
from f8tensor.quant.specs import CastSpec, axiswise_block, is_tensorwise
from f8tensor.tensor.float8 import Float8Tensor, dequantize, to_float8
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
    """What a kind of kernel reads: block scales, fp32 scales only, e4m3fn operands only."""

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
    """Both operands of ``a @ b`` as Float8Tensors a kernel of kind ``takes`` reads.

    Args:
        a, b: the operands, at least one a Float8Tensor.
        takes: the kernel kind.
        a_k, b_k: the dims each contracts over.
    Raises:
        TypeError: neither operand is a Float8Tensor.
        ValueError: the operands are on different devices.
    """
    check_devices(a, b)
    ref, ref_k = (a, a_k) if isinstance(a, Float8Tensor) else (b, b_k)
    if not isinstance(ref, Float8Tensor):
        raise TypeError("FP8 mm needs at least one Float8Tensor operand")
    if not isinstance(a, Float8Tensor):
        a = _cast_like(a, a_k, ref, ref_k, takes)
    if not isinstance(b, Float8Tensor):
        b = _cast_like(b, b_k, ref, ref_k, takes)
    return _fit(a, a_k, takes), _fit(b, b_k, takes)


def prepare_fp4(
    a: torch.Tensor, b: torch.Tensor, *, a_k: int, b_k: int, kernel: bool
) -> tuple[Float4Tensor | Float8Tensor, Float4Tensor | Float8Tensor]:
    """Both operands of ``a @ b`` (at least one a Float4Tensor), a plain one cast to the FP4 kind.

    With ``kernel``: both FP4 of one kind, packed along K, one scale per row and K-block
    (what the sm100 kernels read), else a ``ValueError``.
    """
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
    """``x`` packed along ``k`` with one scale per row and K-block (block scales repeated: lossless)."""
    x = x.repacked(k)
    other = 1 - k % 2
    rows = x._block[other]
    if rows == 1:
        return x
    scale = x._scale.repeat_interleave(rows, dim=other)
    block = tuple(1 if d == other else b for d, b in enumerate(x._block))
    return x._replace(scale=scale, block=block)


def check_devices(a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse operands on two devices (metadata only, before anything runs).

    Raises:
        ValueError: ``a`` and ``b`` are on different devices (both named).
    """
    if a.device != b.device:
        raise ValueError(f"FP8 matmul operands must be on one device; got a on {a.device}, b on {b.device}")


def _cast_like(x: torch.Tensor, k: int, ref: Float8Tensor, ref_k: int, takes: Takes) -> Float8Tensor:
    """A plain operand cast dynamically in ``ref``'s e4m3 format with ``ref``'s granularity along K."""
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
    """``x`` re-quantized where its scale varies along K, or its scales or format are unread."""
    # A 0-dim scale is constant along every dim; else constant_along's rule, inlined (twice
    # per product; a Float8Tensor's block is never empty).
    block = x._block
    along_k = x._scale.dim() == 0 or (block[k] == 0 and block.count(0) + block.count(1) == len(block))
    if not takes.blocks and x._scale.dtype == E8M0 and along_k:
        # A tensorwise/axiswise e8m0 scale is exact in fp32: no re-rounding of the data.
        x = x._replace(scale=x._scale.to(torch.float32))
    fits = along_k and (not takes.fp32_scales or x._scale.dtype == torch.float32)
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

    Deliberate upcast to fp32 between the two roundings, not to the original dtype.
    """
    spec = CastSpec(x._data.dtype, axiswise_block(k, x.dim()))
    return to_float8(dequantize(x, torch.float32), spec, gemm=x._gemm, orig_dtype=x._orig_dtype)


def row_major(t: torch.Tensor, compiling: bool | None = None) -> torch.Tensor:
    """``t`` with its last two dims in standard row-major strides (an FP8 copy only if needed).

    ``compiling``: ``torch.compiler.is_compiling()`` where the caller read it already.
    """
    if torch.compiler.is_compiling() if compiling is None else compiling:
        # Symbolic strides are unreadable under dynamo; inductor uses standard strides. A
        # size-1 dim may keep a short stride through .contiguous() (the grouped kernel refuses it).
        if t.shape[-2] == 1:
            return t.clone(memory_format=torch.contiguous_format)
        return t.contiguous()
    return t if is_row_major(t) else t.clone(memory_format=torch.contiguous_format)


def col_major(t: torch.Tensor, compiling: bool | None = None) -> torch.Tensor:
    """``t`` with its last two dims column-major (an FP8 copy only if needed); ``compiling``: as :func:`row_major`."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        tt = t.transpose(-2, -1)  # see row_major
        if t.shape[-1] == 1:
            return tt.clone(memory_format=torch.contiguous_format).transpose(-2, -1)
        # No stride read here: dynamo cannot read them in a dynamic-shape backward.
        return tt.contiguous().transpose(-2, -1)
    if is_col_major(t):
        return t
    return to_column_major(t)


def inverse_scale(x: Float8Tensor) -> torch.Tensor:
    """``1 / x._scale`` in the scale's dtype (exact for e8m0), the cast's own where it kept one
    (an eager cast's, a weight cast once per step's)."""
    inv = x._inv_scale
    if inv is not None:
        return inv
    # inverse_scale_of's fp32 case, inlined: twice per product.
    return x._scale.reciprocal() if x._scale.dtype == torch.float32 else inverse_scale_of(x._scale)


def kernel_scale(inverse: torch.Tensor, expand_to: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """An inverse scale broadcast over ``expand_to``, viewed as ``shape``, contiguous."""
    return inverse.expand(expand_to).reshape(shape).contiguous()
