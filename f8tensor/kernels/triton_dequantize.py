"""Fused FP8 dequantization: one Triton kernel behind ``f8tensor::fused_dequantize``.

:func:`maybe_dequantize`: one kernel for FP8 data with fp32 scales of 1 x b blocks along
the last dim (the layout the groups cast writes, 2D with any strides or N-D dense in the
data's memory order), bit for bit ``reference.dequantize`` (the FP8 bytes and the
fp16/bf16 rounding in integer arithmetic, the quotient correctly rounded); everything else
stays on the reference's eager ops. The kernel (``dequantize_groups_kernel``) lives with
the casts' kernels and shares their row layout and launch grid (:mod:`.triton_cast`).
"""

from __future__ import annotations

import os

import torch

from f8tensor.kernels.triton_cast import (
    _GROUP_ROWS,
    _MAX_BLOCK,
    _OPTIONS,
    _PLAIN,
    _bytes,
    _format,
    _groups_grid,
    _kernels,
    _memory_order,
    _next_pow2,
    _rows_of,
    _scale_shape,
    enabled,
)
from f8tensor.quant.formats import FORMATS

__all__ = ["fused_dequantize", "maybe_dequantize"]

#: The output dtypes of the fused dequantization, as the kernel numbers them.
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _dequantize_problem(data: torch.Tensor, scale: torch.Tensor, block: list[int], dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take this dequantization (None: it can)."""
    if data.dtype not in FORMATS or dtype not in _OUT_CODES or scale.dtype != torch.float32:
        return f"{data.dtype} data, {scale.dtype} scales to {dtype} (FP8 data, fp32 scales, fp32/bf16/fp16 out)"
    if data.dim() == 0 or len(block) != data.dim() or any(b != 1 for b in block[:-1]) or block[-1] < 1:
        return f"block {tuple(block)} for {data.dim()}-dim data (1 x b blocks along the last dim, b >= 1)"
    if _next_pow2(block[-1]) > _MAX_BLOCK:
        return f"block {block[-1]} (at most {_MAX_BLOCK} elements)"
    if tuple(scale.shape) != _scale_shape(tuple(data.shape), tuple(block)):
        return f"scale shape {tuple(scale.shape)} for data {tuple(data.shape)} and block {tuple(block)}"
    if data.dim() > 2:
        order = _memory_order(data)
        if order is None or not scale.permute(order).is_contiguous():
            return "N-D data not dense, or a scale not laid out in the data's memory order"
    elif any(st == 0 and n > 1 for t in (data, scale) for st, n in zip(t.stride(), t.shape)):
        return "broadcast (zero) strides"
    return None


def _dequantized_like(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output in the data's layout where it is dense (its memory order), else contiguous."""
    return torch.empty_like(data, dtype=dtype, memory_format=torch.preserve_format)


_DEQUANTIZE_SCHEMA = "(Tensor data, Tensor scale, int[] block, ScalarType dtype) -> Tensor"


@torch.library.custom_op("f8tensor::fused_dequantize", mutates_args=(), schema=_DEQUANTIZE_SCHEMA)
def fused_dequantize(data: torch.Tensor, scale: torch.Tensor, block: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``reference.dequantize(data, scale, block, dtype)`` by one Triton kernel (interpreted
    for CPU tensors): FP8 ``data`` with fp32 scales of 1 x ``block[-1]`` blocks along the
    last dim, out in ``dtype`` (fp32, bf16 or fp16), laid out as ``data``."""
    problem = _dequantize_problem(data, scale, block, dtype)
    if problem is not None:
        raise ValueError(f"fused_dequantize: no kernel for {problem}")
    out = _dequantized_like(data, dtype)
    _launch_dequantize(data, scale, block[-1], out)
    return out


@fused_dequantize.register_fake
def _(data, scale, block, dtype):
    return _dequantized_like(data, dtype)


def _launch_dequantize(data: torch.Tensor, scale: torch.Tensor, blk: int, out: torch.Tensor) -> None:
    if data.device.type == "cuda" and data.device.index != torch.cuda.current_device():
        with torch.cuda.device(data.device):
            _launch_dequantize(data, scale, blk, out)
        return
    k = _kernels(data.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    f = _format(data.dtype)
    order = _memory_order(data) if data.dim() > 2 else None
    d_rows, s_rows, o_rows = (_rows_of(t, order) for t in (data, scale, out))
    R, C = d_rows.R, d_rows.C
    nb, b, g, grid = _groups_grid(R, C, blk)
    if not (R and nb):
        return
    o = out if out.dtype == torch.float32 else out.view(torch.int16)  # 16-bit outputs as integer bits
    k.dequantize_groups_kernel[grid](
        _bytes(data), scale, o, R, C, nb, blk, d_rows.nr,
        d_rows.outer, d_rows.inner, d_rows.col, s_rows.outer, s_rows.inner, s_rows.col,
        o_rows.outer, o_rows.inner, o_rows.col,
        BIAS=f.bias, MBITS=f.mbits, FNUZ=f.fnuz, INF=data.dtype == torch.float8_e5m2,
        SUB_UNIT=float(2.0 ** (1 - f.bias - f.mbits)), OUT=_OUT_CODES[out.dtype],
        LIMIT=float(torch.finfo(out.dtype).max), BR=_GROUP_ROWS, G=g, B=b, **_OPTIONS,
    )  # fmt: skip


def maybe_dequantize(
    data: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """``reference.dequantize(data, scale, block, dtype)`` by the fused kernel, or None
    where the reference must run: compiling, tensors that are not plain, a scale that
    requires grad, the fused path switched off, or a layout the kernel does not take (see
    :func:`fused_dequantize`)."""
    if torch.compiler.is_compiling() or type(data) not in _PLAIN or type(scale) is not torch.Tensor or not enabled():
        return None
    if scale.requires_grad and torch.is_grad_enabled():
        return None  # the reference's ops carry the gradient to a scale that asks for one
    if data.device != scale.device or _dequantize_problem(data, scale, list(block), dtype) is not None:
        return None
    return torch.ops.f8tensor.fused_dequantize(data, scale, list(block), dtype)  # type: ignore[no-any-return]
