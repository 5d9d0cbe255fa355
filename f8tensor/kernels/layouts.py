"""The column-major layout: the one place that allocates it.

Every FP8 kernel reads its second operand column-major (strides ``(..., 1, rows)``); every
such buffer comes from :func:`empty_column_major`, every copy into one from
:func:`to_column_major` (two ops, where transpose-clone-transpose is three).
"""

from __future__ import annotations

import math

import torch

__all__ = ["column_major_strides", "empty_column_major", "to_column_major"]


def column_major_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Strides of ``shape`` with the last two dims column-major, batch dims contiguous over the matrices."""
    rows, cols = shape[-2], shape[-1]
    if len(shape) == 2:
        return (1, rows)
    batch = tuple(rows * cols * math.prod(shape[d + 1 : -2]) for d in range(len(shape) - 2))
    return (*batch, 1, rows)


def empty_column_major(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` laid out column-major."""
    return torch.empty_strided(tuple(shape), column_major_strides(shape), dtype=dtype, device=device)


def to_column_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (2D or more) with its last two dims stored column-major."""
    # empty_column_major's body, inlined: a product's operand is copied so.
    return torch.empty_strided(tuple(t.shape), column_major_strides(t.shape), dtype=t.dtype, device=t.device).copy_(t)
