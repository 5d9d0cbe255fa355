"""Raw casts: a high-precision tensor and a cast spec in, FP8 data and scales out.

Every cast in the package goes through :func:`cast`, :func:`cast_for_gemm`,
:func:`cast_with_stats`, :func:`dequantize` or :func:`block_scale`. Two implementations
give the same bits, chosen here per call: the torch-ops reference
(:mod:`f8tensor.kernels.reference`, eager and compiled) and, for eager CUDA tensors, the
fused Triton kernels (:mod:`f8tensor.kernels.triton_cast`; ``F8TENSOR_FUSED_CASTS=0``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from f8tensor.kernels import reference, triton_cast, triton_dequantize
from f8tensor.kernels.layouts import to_column_major

# Imported by name: traced, one path to the module (dynamo guards a module reached two ways).
from f8tensor.kernels.reference import CAST_STATS_FIELDS, block_scale, cast_values, cast_with_stats
from f8tensor.quant.scaling import inverse_scale_of, materialized
from f8tensor.quant.specs import CastSpec

__all__ = ["CAST_STATS_FIELDS", "GemmCast", "block_scale", "cast", "cast_for_gemm", "cast_with_stats", "dequantize"]


def _fused_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s calls try the fused kernels first (CUDA; tests point it at the CPU)."""
    return t.is_cuda


def cast(
    hp: torch.Tensor,
    spec: CastSpec,
    scale: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hp`` cast per ``spec``: ``(data, scale)`` (see :func:`f8tensor.kernels.reference.cast`)."""
    if _fused_device(hp):
        fused = triton_cast.maybe_cast(hp, spec, scale)
        if fused is not None:
            return fused[0], fused[2]
    return reference.cast(hp, spec, scale, generator=generator, uniform=uniform)


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``data / scale`` per block, in ``dtype`` (see :func:`f8tensor.kernels.reference.dequantize`)."""
    if _fused_device(data):
        fused = triton_dequantize.maybe_dequantize(data, scale, block, dtype)
        if fused is not None:
            return fused
    return reference.dequantize(data, scale, block, dtype)


class GemmCast(NamedTuple):
    """What :func:`cast_for_gemm` returns: data, its column-major copy or None, scale, inverse
    or None, and whether it ran eager (None: not known)."""

    data: torch.Tensor
    column_major: torch.Tensor | None
    scale: torch.Tensor
    inverse: torch.Tensor | None
    eager: bool | None = None


#: ``layouts`` of :func:`cast_for_gemm`, as the fused op numbers them.
_LAYOUTS = {"natural": triton_cast.NATURAL, "both": triton_cast.BOTH, "column_major": triton_cast.COLUMN_MAJOR}


def cast_for_gemm(
    hp: torch.Tensor,
    spec: CastSpec,
    scale: torch.Tensor | None = None,
    *,
    layouts: str = "natural",
    products_only: bool = False,
) -> GemmCast:
    """:func:`cast` with what the GEMMs of a training step read, from the same pass.

    Args:
        hp: the tensor to cast.
        spec: the cast spec.
        scale: a given scale, else dynamic.
        layouts: ``"natural"``, ``"both"`` (plus a column-major copy, for the weight-gradient
            GEMM) or ``"column_major"`` (the data itself); the last two for 2D tensors.
        products_only: compiled, the data is written once, not per product.
    Returns:
        A :class:`GemmCast`; ``inverse`` is set where computing it here saves work (fused
        kernels; a per-tensor scale in eager).
    Raises:
        ValueError: unknown ``layouts``, or a non-2D tensor with a column-major layout.
    """
    # A literal, not _LAYOUTS: traced, each key read of a global dict is a guard.
    if layouts not in ("natural", "both", "column_major"):
        raise ValueError(f"layouts must be one of {sorted(_LAYOUTS)}; got {layouts!r}")
    if layouts != "natural" and hp.dim() != 2:
        raise ValueError(f"cast_for_gemm(layouts={layouts!r}) takes a 2D tensor; got shape {tuple(hp.shape)}")
    compiling = torch.compiler.is_compiling()
    if not compiling and _fused_device(hp):  # eager only
        fused = triton_cast.maybe_cast(hp, spec, scale, layouts=_LAYOUTS[layouts])
        if fused is not None:
            return GemmCast(*fused)
    # Every argument given: traced, a default read is a guard.
    data, scale, _, _, _ = cast_values(
        hp, spec, scale, None, need_amax=False, amax=None, uniform=None, eager=not compiling
    )
    inverse = inverse_scale_of(scale) if scale.dim() == 0 and not compiling else None
    if compiling and products_only:  # materialized(), inlined: a call is a guard
        data = data.as_strided(data.shape, data.stride())
    if layouts == "natural":
        return GemmCast(data, None, scale, inverse, not compiling)
    copy = to_column_major(data)
    if compiling:
        copy = materialized(copy, (1, data.shape[0]))
    if layouts == "both":
        return GemmCast(data, copy, scale, inverse, not compiling)
    return GemmCast(copy, None, scale, inverse, not compiling)
