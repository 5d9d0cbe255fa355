"""The Float8Tensor op table's matrix products, handed to ``gemm``'s front door."""

from __future__ import annotations

import torch

from f8tensor.gemm import GROUPED_RULES, batched_mm, grouped_mm, matmul
from f8tensor.gemm.operands import requantize
from f8tensor.gemm.rules import ALIGN
from f8tensor.quant.specs import axiswise_block, axiswise_dim, layout_block
from f8tensor.tensor.float8 import Float8Tensor, is_float8
from f8tensor.tensor.fp4 import Float4Tensor, is_float4
from f8tensor.tensor.ops import _reshaped_meta, _selected, _with_defaults

__all__ = ["transpose_2d"]

aten = torch.ops.aten
implements = Float8Tensor.implements
_is_f8 = is_float8


# ===================================================================== matrix products


def _mm(func, types, args, kwargs):
    a, b = args
    return matmul(a, b)


implements([aten.mm.default])(_mm)


def _addmm(func, types, args, kwargs):
    bias, a, b = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if _is_f8(bias) or is_float4(bias):
        raise NotImplementedError("addmm with a Float8Tensor bias/input is not supported; pass it in high precision")
    if beta == 1 and alpha == 1:
        return matmul(a, b, bias=bias)
    out = matmul(a, b)
    if alpha != 1:
        out = out * alpha
    # torch semantics: beta == 0 ignores the input, NaN included.
    return out if beta == 0 else out + beta * bias.to(out.dtype)


implements([aten.addmm.default])(_addmm)


def _composite_product(func, types, args, kwargs):
    """``matmul`` and ``linear``, which arrive whole under inference_mode and in export decompositions.

    PyTorch's own decomposition runs, so its pieces land on this table's handlers.
    """
    return func.decompose(*args, **kwargs)


implements([aten.matmul.default, aten.linear.default])(_composite_product)


for _op, _handler in ((aten.mm.default, _mm), (aten.addmm.default, _addmm)):
    Float4Tensor.implements([_op])(_handler)
Float4Tensor.implements([aten.matmul.default, aten.linear.default])(_composite_product)


def transpose_2d(x: Float8Tensor) -> Float8Tensor:
    """``x.t()`` for a 2D Float8Tensor, built directly instead of dispatched.

    torch.export's pre-dispatch trace does not dispatch ops on a subclass made inside it. Not
    an autograd view of ``x``: use it on temporaries.
    """
    # ops._permuted's rule for (1, 0), inlined: two per linear call.
    b0, b1 = x._block
    scale = x._scale if x._scale.dim() == 0 else x._scale.t()
    out = x._replace(data=x._data.t(), scale=scale, block=(b1, b0))
    inverse = x._inv_scale
    if inverse is not None and scale is x._scale:
        # Kept by _replace in eager; traced, _replace is one opaque call (a weight cast once
        # per step brings its inverse into the graph).
        out._inv_scale = inverse
    return out


def _bmm(func, types, args, kwargs):
    a, b = args
    batch = a.shape[0]
    # x @ w.t() with a non-contiguous x: one matrix for every entry folds into one 2D product.
    if b.stride(0) == 0:
        out = matmul(_flatten_batch(a), _batch_item(b, 0, 0))
        return out.view(batch, a.shape[1], b.shape[2])
    orig = a._orig_dtype if _is_f8(a) else b._orig_dtype
    if orig in GROUPED_RULES[0].out_dtypes and a.shape[2] % ALIGN == 0:
        # The batched kernel writes bf16 only; other dtypes take one product per entry.
        return batched_mm(a, b, orig)
    return torch.stack([matmul(_batch_item(a, i, 1), _batch_item(b, i, 0)) for i in range(batch)])


implements([aten.bmm.default])(_bmm)


def _grouped_mm(func, types, args, kwargs):
    """``torch._grouped_mm(a, b, offs)`` in FP8: a (M, K) tokens sorted by group, b (G, K, N).

    A scale of ``b`` that varies along K is re-derived along N; the result is in ``out_dtype``.
    """
    a, b, offs, bias, out_dtype = _with_defaults(args, (None, None, None, None, None))
    if a.dim() != 2 or b.dim() != 3 or offs is None:
        raise NotImplementedError(
            f"Float8Tensor supports _grouped_mm as 2D x 3D with offs (MoE tokens x experts); got "
            f"{a.dim()}D x {b.dim()}D, offs={'None' if offs is None else 'given'}. Call .to_hp() first."
        )
    if bias is not None:
        raise NotImplementedError("FP8 _grouped_mm with bias is not supported (torch._scaled_grouped_mm takes none)")
    return grouped_mm(a, b, offs, out_dtype or a.dtype)


implements([aten._grouped_mm.default])(_grouped_mm)


def _flatten_batch(x: torch.Tensor) -> torch.Tensor:
    """(B, M, K) -> (B*M, K), copying only when the layout demands it."""
    if not _is_f8(x):
        return x.reshape(-1, x.shape[-1])
    if x.is_blockwise:
        data = x._data.reshape(-1, x.shape[-1])
        scale, block = _reshaped_meta(x, data.shape)
        return x._replace(data=data, scale=scale, block=block)
    axis = axiswise_dim(x._scale_block)
    if axis not in (None, 2):
        x, axis = requantize(x, 2), 2
    data = x._data.reshape(-1, x.shape[-1])
    scale = x._scale if axis is None else x._scale.reshape(-1, 1)
    return x._replace(data=data, scale=scale, block=layout_block(() if axis is None else axiswise_block(1, 2), 2))


def _batch_item(x: torch.Tensor, i: int, k: int) -> torch.Tensor:
    """Entry ``i`` of a (B, rows, cols) operand; ``k``: the dim it contracts over."""
    if not _is_f8(x):
        return x[i]
    if x.is_blockwise:
        return _selected(x, 0, i)
    axis = axiswise_dim(x._scale_block)
    if axis is None:
        return x._replace(data=x._data[i], block=layout_block((), x.dim() - 1))
    if axis == 0:
        # A scale reduced over the batch dim: re-derive it constant along K.
        return requantize(x._replace(data=x._data[i], scale=x._scale[0], block=x._block[1:]), k)
    return x._replace(data=x._data[i], scale=x._scale[i], block=axiswise_block(axis - 1, x.dim() - 1))
