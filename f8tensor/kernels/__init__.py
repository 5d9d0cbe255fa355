"""Raw casts: a high-precision tensor and a cast spec in, FP8 data and scales out.

Below the tensor (``f8tensor.tensor.float8`` wraps what these return in a Float8Tensor), so that
``from_hp``, every Float8Linear and expert cast, and the operand preparation of every
product use the same casts. Four functions, each the one place its kind of call goes:

- :func:`cast`: ``(hp, spec, scale=None) -> (data, scale)``;
- :func:`cast_for_gemm`: the same, with what a step's GEMMs read written by the same
  cast: the data column-major, or a column-major copy too (the layout the
  weight-gradient GEMM takes), and a per-tensor scale's inverse;
- :func:`cast_with_stats`: the same, plus the telemetry vector (:data:`CAST_STATS_FIELDS`);
- :func:`dequantize`: ``(data, scale, block, dtype) -> hp``;
- :func:`block_scale`: block amaxes -> the scales a dynamic block cast takes (for amaxes
  agreed elsewhere, e.g. across FSDP ranks).

Two implementations with the same bits: the torch-ops reference
(:mod:`f8tensor.kernels.reference`; the same bits eager and under torch.compile, where
inductor fuses each cast into one pass) and, for eager CUDA tensors, the fused Triton
kernels (:mod:`f8tensor.kernels.triton_cast`: two kernels for a tensorwise cast, one for
every per-row or per-block cast; one for :func:`dequantize` of 1 x b block scales along
the last dim). The choice is made here, per call: the fused path where it applies (see
``triton_cast``; ``F8TENSOR_FUSED_CASTS=0`` switches it off), the reference everywhere
else, the CPU included. ``cast_with_stats`` is the reference's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from f8tensor.kernels import reference, triton_cast, triton_dequantize
from f8tensor.kernels.layouts import to_column_major
from f8tensor.kernels.reference import CAST_STATS_FIELDS, block_scale, cast_with_stats
from f8tensor.quant.scaling import inverse_scale_of, materialized
from f8tensor.quant.specs import CastSpec

__all__ = ["CAST_STATS_FIELDS", "GemmCast", "block_scale", "cast", "cast_for_gemm", "cast_with_stats", "dequantize"]


def _fused_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a device whose calls try the fused kernels first: CUDA. (The
    tests point this at the CPU to run the same routing through the Triton interpreter.)"""
    return t.is_cuda


def cast(
    hp: torch.Tensor,
    spec: CastSpec,
    scale: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hp`` cast per ``spec``: ``(data, scale)`` (see :func:`f8tensor.kernels.reference.cast`;
    the fused kernels give the same bits)."""
    if _fused_device(hp):
        fused = triton_cast.maybe_cast(hp, spec, scale)
        if fused is not None:
            return fused[0], fused[2]
    return reference.cast(hp, spec, scale, generator=generator, uniform=uniform)


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``data / scale`` per block, in ``dtype`` (see :func:`f8tensor.kernels.reference.dequantize`;
    the fused kernel, for fp32 scales of 1 x b blocks along the last dim, gives the same
    bits, a NaN's payload aside)."""
    if _fused_device(data):
        fused = triton_dequantize.maybe_dequantize(data, scale, block, dtype)
        if fused is not None:
            return fused
    return reference.dequantize(data, scale, block, dtype)


class GemmCast(NamedTuple):
    """What :func:`cast_for_gemm` returns: the FP8 data (column-major with
    ``layouts="column_major"``), its column-major copy (``layouts="both"``, else None), the
    scale, and its inverse where the cast computed it (the fused kernels: every scale; the
    reference in eager mode: a per-tensor scale; else None)."""

    data: torch.Tensor
    column_major: torch.Tensor | None
    scale: torch.Tensor
    inverse: torch.Tensor | None


#: ``layouts`` of :func:`cast_for_gemm`, as the fused op numbers them.
_LAYOUTS = {"natural": triton_cast.NATURAL, "both": triton_cast.BOTH, "column_major": triton_cast.COLUMN_MAJOR}


def cast_for_gemm(
    hp: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None = None, *, layouts: str = "natural"
) -> GemmCast:
    """:func:`cast` with what the GEMMs of a training step read, from the same pass.

    ``layouts``: ``"natural"`` (the data as :func:`cast` lays it out), ``"both"`` (also a
    column-major copy, strides ``(1, rows)``: the layout the weight-gradient GEMM takes) or
    ``"column_major"`` (the data itself column-major: a cast only that GEMM reads); the
    last two for 2D tensors. The scale's inverse, the factor the GEMMs read, comes with it
    where computing it here saves work: from the fused kernels for every scale, from the
    reference for a per-tensor scale (which two GEMMs read) in eager mode (under
    torch.compile inductor places the reciprocal); else ``inverse`` is None.

    Fused (eager CUDA, see :mod:`~f8tensor.kernels.triton_cast`): the cast kernel writes
    every layout asked for and the inverse in its one pass (``"both"`` for tensorwise and
    tile casts; ``"column_major"`` for every granularity) and the inverse in its one pass.
    Otherwise the reference cast, a copy of its bytes into a column-major buffer (under
    torch.compile, inductor writes the copy from the cast's own loop) and a reciprocal.
    """
    code = _LAYOUTS.get(layouts)
    if code is None:
        raise ValueError(f"layouts must be one of {sorted(_LAYOUTS)}; got {layouts!r}")
    if layouts != "natural" and hp.dim() != 2:
        raise ValueError(f"cast_for_gemm(layouts={layouts!r}) takes a 2D tensor; got shape {tuple(hp.shape)}")
    if _fused_device(hp):
        fused = triton_cast.maybe_cast(hp, spec, scale, layouts=code)
        if fused is not None:
            return GemmCast(*fused)
    data, scale = reference.cast(hp, spec, scale)
    inverse = inverse_scale_of(scale) if scale.dim() == 0 and not torch.compiler.is_compiling() else None
    if layouts == "natural":
        return GemmCast(data, None, scale, inverse)
    copy = materialized(to_column_major(data), (1, data.shape[0]))
    if layouts == "both":
        return GemmCast(data, copy, scale, inverse)
    return GemmCast(copy, None, scale, inverse)
