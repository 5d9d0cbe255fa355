"""Dense FP8 products: tensorwise and rowwise scales on ``torch._scaled_mm``.

:func:`choose_route` picks, from dtypes, granularities, output dtype and fast accumulation
(never by catching an error), a kernel legal on every supported build (:class:`Route`);
:func:`product` makes the call. The route of precise-accumulation rowwise products is a
setting of the build (:func:`use_precise_rowwise_route`).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import torch

from f8tensor.gemm.check import scaled_mm
from f8tensor.gemm.operands import col_major, inverse_scale, kernel_scale, row_major
from f8tensor.gemm.rules import ALIGN

# product() writes ALIGN as the literal 16: traced, a global read is a guard per product.
assert ALIGN == 16, ALIGN
from f8tensor.quant.specs import GemmConfig
from f8tensor.tensor.float8 import Float8Tensor

__all__ = [
    "Route",
    "choose_route",
    "precise_rowwise_route",
    "product",
    "set_precise_rowwise_route",
    "use_precise_rowwise_route",
]

_BF16, _FP16 = torch.bfloat16, torch.float16


class Route(str, enum.Enum):
    """The kernel a product runs on (see :func:`choose_route`)."""

    #: cuBLASLt with one scale per operand.
    TENSORWISE = "tensorwise"
    #: The rowwise kernel, outer scales applied in its epilogue.
    ROWWISE = "rowwise"
    #: The rowwise kernel on ``(B^T A^T)^T``: an e5m2 second operand becomes the first.
    ROWWISE_SWAPPED = "rowwise_swapped"
    #: cuBLASLt with rowwise scales set to 1 and an fp32 output, then the outer scales
    #: (+ bias, cast). Legal on every build: the route of what the rowwise kernels refuse.
    TENSORWISE_POSTSCALE = "tensorwise_postscale"


# The route of precise-accumulation rowwise products: a property of the build, not of a
# tensor or checkpoint. Module-level like torch.backends flags, not thread-local: autograd
# runs backward on its own threads; torch.compile guards on it.
_PRECISE_ROWWISE = {"route": "kernel"}
_PRECISE_ROWWISE_CHOICES = ("kernel", "postscale")


def set_precise_rowwise_route(route: str) -> str:
    """Choose the route of precise-accumulation rowwise products with a bf16/fp16 output.

    Products the rowwise kernels refuse take the post-scale route whatever is set. Set it
    before ``torch.compile`` traces (a change recompiles).

    Args:
        route: ``"kernel"`` (the rowwise kernel, default) or ``"postscale"`` (tensorwise
            kernel, fp32 output, one scaling pass after).
    Returns:
        The previous choice.
    Raises:
        ValueError: ``route`` is neither.
    """
    previous, _PRECISE_ROWWISE["route"] = _PRECISE_ROWWISE["route"], _checked_precise_route(route)
    return previous


def _checked_precise_route(route: object) -> str:
    if route not in _PRECISE_ROWWISE_CHOICES:
        raise ValueError(f"precise rowwise route must be one of {_PRECISE_ROWWISE_CHOICES}; got {route!r}")
    return route


def precise_rowwise_route() -> str:
    """The current choice (:func:`use_precise_rowwise_route`, :func:`set_precise_rowwise_route`)."""
    return _PRECISE_ROWWISE["route"]


@contextlib.contextmanager
def use_precise_rowwise_route(route: str) -> Iterator[None]:
    """Run precise-accumulation rowwise products on ``route`` inside the block, then restore.

    Args:
        route: ``"kernel"`` or ``"postscale"`` (see :func:`set_precise_rowwise_route`).
    """
    previous = set_precise_rowwise_route(route)
    try:
        yield
    finally:
        set_precise_rowwise_route(previous)


def choose_route(
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    *,
    rowwise: bool,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    m: int,
    precise_route: str | None = None,
) -> Route:
    """The kernel route for ``(M, K) @ (K, N)`` FP8 operands of these dtypes.

    Decided from the arguments alone, so the same on every device and build: tensorwise
    operands take :attr:`Route.TENSORWISE`; rowwise ones with a bf16/fp16 output (bf16 for
    fnuz) take the rowwise kernel (:attr:`Route.ROWWISE` for an e4m3 ``b``, else
    :attr:`Route.ROWWISE_SWAPPED` for an e4m3 ``a`` and ``M % 16 == 0``) unless precise
    accumulation is routed to post-scale; every other product takes
    :attr:`Route.TENSORWISE_POSTSCALE`.

    Args:
        a_dtype, b_dtype: the operands' FP8 dtypes.
        rowwise: either operand has one scale per row/column.
        out_dtype: the output dtype.
        use_fast_accum: fast accumulation.
        m: the rows of ``a``.
        precise_route: ``"kernel"`` or ``"postscale"``; None reads :func:`precise_rowwise_route`.
    """
    if not rowwise:
        return Route.TENSORWISE
    precise_route = _PRECISE_ROWWISE["route"] if precise_route is None else _checked_precise_route(precise_route)
    # Formats by name, not by global tuples: traced, each read of one is a guard.
    kernel_outs = (_BF16,) if "fnuz" in str(a_dtype) else (_BF16, _FP16)
    if (use_fast_accum or precise_route == "kernel") and out_dtype in kernel_outs:
        if "e4m3" in str(b_dtype):
            return Route.ROWWISE
        if "e4m3" in str(a_dtype) and m % ALIGN == 0:
            return Route.ROWWISE_SWAPPED
    return Route.TENSORWISE_POSTSCALE


def product(
    a8: Float8Tensor, b8: Float8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, gemm: GemmConfig
) -> torch.Tensor:
    """``a8 (M, K) @ b8 (K, N)`` (+ ``bias``) on the route :func:`choose_route` picks.

    The operands come from ``operands.prepare(..., DENSE)``: scales constant along K.
    """
    (m, k), n = a8.shape, b8.shape[1]
    compiling = torch.compiler.is_compiling()  # read once per product
    # Layouts the kernels take: A row-major, B column-major.
    a_data, b_data = row_major(a8._data, compiling), col_major(b8._data, compiling)

    pad_k, pad_n = (-k) % 16, (-n) % 16  # ALIGN
    if pad_k or pad_n:
        if not gemm.pad_inner_dim:
            raise ValueError(
                f"FP8 matmul needs the inner dimension K and the output dimension N to be multiples "
                f"of {ALIGN} (torch._scaled_mm's rule); got ({m}x{k}) @ ({k}x{n}). Use such shapes, or "
                f"ask for zero padding with GemmConfig(pad_inner_dim=True)."
            )
        a_data = _pad_bytes(a_data, 0, pad_k)
        b_data = _pad_bytes(b_data.t(), pad_n, pad_k).t()

    a_rowwise, b_rowwise = a8._scale.dim() > 0, b8._scale.dim() > 0  # 2D: a 0-dim scale is tensorwise
    route = choose_route(
        a_data.dtype,
        b_data.dtype,
        rowwise=a_rowwise or b_rowwise,
        out_dtype=out_dtype,
        use_fast_accum=gemm.use_fast_accum,
        m=m,
        precise_route=None,
    )
    a_inv, b_inv = inverse_scale(a8), inverse_scale(b8)
    if route is Route.TENSORWISE:
        return _fused_bias_mm(a_data, b_data, a_inv, b_inv, bias, out_dtype, gemm.use_fast_accum, pad_n)
    if route is Route.TENSORWISE_POSTSCALE:
        return _postscaled_mm(
            a_data,
            b_data,
            a_inv if a_rowwise else None,
            b_inv if b_rowwise else None,
            a_inv,
            b_inv,
            m,
            n,
            bias,
            out_dtype,
            gemm.use_fast_accum,
        )
    # kernel_scale's body, inlined: twice per rowwise product.
    a_vec, b_vec = a_inv.expand((m, 1)).reshape((m, 1)).contiguous(), b_inv.expand((1, n)).reshape((1, n)).contiguous()
    if pad_n:
        b_vec = torch.nn.functional.pad(b_vec, (0, pad_n), value=1.0)
    if route is Route.ROWWISE:
        return _fused_bias_mm(a_data, b_data, a_vec, b_vec, bias, out_dtype, gemm.use_fast_accum, pad_n)
    # Route.ROWWISE_SWAPPED: (A B)^T = B^T A^T, both views of the bytes we have; the bias
    # runs along the swapped product's rows, so it is added after.
    out_t = scaled_mm(
        b_data.t(),
        a_data.t(),
        b_vec.reshape(-1, 1),
        a_vec.reshape(1, -1),
        out_dtype=out_dtype,
        use_fast_accum=gemm.use_fast_accum,
    )
    out = out_t[:n].t().contiguous()
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def _fused_bias_mm(a_data, b_data, scale_a, scale_b, bias, out_dtype, use_fast_accum, pad_n):
    """One ``_scaled_mm`` call, the bias fused where the kernels take it, else added after."""
    fuse_bias = (
        bias is not None and not pad_n and bias.dim() == 1 and bias.dtype == out_dtype and out_dtype in (_BF16, _FP16)
    )
    out = scaled_mm(
        a_data,
        b_data,
        scale_a,
        scale_b,
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
    if pad_n:
        out = out[:, : out.shape[1] - pad_n].contiguous()
    if bias is not None and not fuse_bias:
        out = out + bias.to(out_dtype)
    return out


def _postscaled_mm(a_data, b_data, a_rows, b_cols, a_inv, b_inv, m, n, bias, out_dtype, use_fast_accum):
    """:attr:`Route.TENSORWISE_POSTSCALE`: the tensorwise kernel, fp32 out, outer scales after.

    A rowwise side (``a_rows``/``b_cols``, else None) passes 1 to the kernel and is applied
    after in the rowwise epilogue's order and precision (fp32), then the bias, then one cast.
    """
    one = torch.ones((), dtype=torch.float32, device=a_data.device)
    acc = scaled_mm(
        a_data,
        b_data,
        one if a_rows is not None else a_inv,
        one if b_cols is not None else b_inv,
        out_dtype=torch.float32,
        use_fast_accum=use_fast_accum,
    )
    out = acc if acc.shape[1] == n else acc[:, :n]
    # The first product allocates (the kernel output may be a padded view); the rest run in place.
    if a_rows is not None:
        out = out * kernel_scale(a_rows, (m, 1), (m, 1))
    if b_cols is not None:
        b_vec = kernel_scale(b_cols, (1, n), (1, n))
        out = out.mul_(b_vec) if a_rows is not None else out * b_vec
    if bias is not None:
        out = out.add_(bias.to(torch.float32))
    return out.to(out_dtype)


def _pad_bytes(x: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    # Through uint8: no FP8 pad kernel; byte 0 is +0.0 in all four formats (0x80 is NaN in fnuz).
    raw = torch.nn.functional.pad(x.contiguous().view(torch.uint8), (0, pad_cols, 0, pad_rows))
    return raw.view(x.dtype)
