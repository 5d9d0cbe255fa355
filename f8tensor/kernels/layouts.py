"""The column-major layout: the one place that allocates it.

The weight-gradient GEMM contracts over the tokens (dim 0 of both its operands) and every
FP8 kernel reads its second operand column-major, so casts and operand preparation write
FP8 bytes with the last two dims stored column-major (strides ``(..., 1, rows)``). Every
such buffer of the package comes from :func:`empty_column_major`, and every copy into one
from :func:`to_column_major` (an ``empty_strided`` and a ``copy_``: two ops, where a
transpose, a clone and a transpose are three).
"""

from __future__ import annotations

import math

import torch

__all__ = ["column_major_strides", "empty_column_major", "to_column_major"]


def column_major_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Strides of a tensor of ``shape`` (2D or more) whose last two dims are stored
    column-major, the batch dims before them contiguous over the matrices."""
    rows, cols = shape[-2], shape[-1]
    batch = tuple(rows * cols * math.prod(shape[d + 1 : -2]) for d in range(len(shape) - 2))
    return (*batch, 1, rows)


def empty_column_major(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` laid out column-major (see the module docstring)."""
    return torch.empty_strided(tuple(shape), column_major_strides(shape), dtype=dtype, device=device)


def to_column_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (2D or more) with its last two dims stored column-major."""
    return empty_column_major(t.shape, t.dtype, t.device).copy_(t)
