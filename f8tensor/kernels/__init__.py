"""Raw casts: a high-precision tensor and a cast spec in, FP8 data and scales out.

Below the tensor (``f8tensor.tensor`` wraps what these return in a Float8Tensor), so that
``from_hp``, every Float8Linear and expert cast, and the operand preparation of every
product use the same casts. Four functions, each the one place its kind of call goes:

- :func:`cast`: ``(hp, spec, scale=None) -> (data, scale)``;
- :func:`cast_with_column_major`: the same, plus the data laid out column-major (the
  layout the weight-gradient GEMM takes), written by the same cast;
- :func:`cast_with_stats`: the same, plus the telemetry vector (:data:`CAST_STATS_FIELDS`);
- :func:`dequantize`: ``(data, scale, block, dtype) -> hp``.

Two implementations with the same bits: the torch-ops reference
(:mod:`f8tensor.kernels.reference`; the same bits eager and under torch.compile, where
inductor fuses each cast into one pass) and, for eager CUDA tensors, the fused Triton
kernels (:mod:`f8tensor.kernels.triton_cast`: two kernels for a tensorwise cast, one for
every per-row or per-block cast). The choice is made here, per call: the fused path where
it applies (see ``triton_cast``; ``F8TENSOR_FUSED_CASTS=0`` switches it off), the
reference everywhere else, the CPU included. ``cast_with_stats`` and ``dequantize`` are
the reference's.

Layer: above ``scaling``; imports ``scaling``, ``config``, ``formats``, ``compat``.
"""

from __future__ import annotations

import torch

from f8tensor.config import CastSpec
from f8tensor.kernels import reference, triton_cast
from f8tensor.kernels.reference import CAST_STATS_FIELDS, cast_with_stats, dequantize
from f8tensor.scaling import materialized

__all__ = ["CAST_STATS_FIELDS", "cast", "cast_with_column_major", "cast_with_stats", "dequantize"]


def cast(
    hp: torch.Tensor,
    spec: CastSpec,
    scale: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hp`` cast per ``spec``: ``(data, scale)`` (see :func:`f8tensor.kernels.reference.cast`;
    the fused kernels give the same bits)."""
    if hp.is_cuda:
        fused = triton_cast.maybe_cast(hp, spec, scale)
        if fused is not None:
            return fused[0], fused[2]
    return reference.cast(hp, spec, scale, generator=generator)


def cast_with_column_major(
    hp: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast` of a 2D ``hp``, also returning the data laid out column-major (strides
    ``(1, rows)``): ``(data, data_column_major, scale)``.

    Fused (a tensorwise or br x bc block cast of an eager CUDA tensor): the cast kernel
    writes both layouts in its one pass. Otherwise the reference cast and a copy of its
    bytes into a column-major buffer (under torch.compile, inductor writes the copy from
    the cast's own loop).
    """
    if hp.dim() != 2:
        raise ValueError(f"cast_with_column_major takes a 2D tensor; got shape {tuple(hp.shape)}")
    if hp.is_cuda:
        fused = triton_cast.maybe_cast(hp, spec, scale, column_major=True)
        if fused is not None:
            return fused
    data, scale = reference.cast(hp, spec, scale)
    rows = data.shape[0]
    column_major = torch.empty_strided(data.shape, (1, rows), dtype=data.dtype, device=data.device)
    column_major.copy_(data)
    return data, materialized(column_major, (1, rows)), scale
