"""Frozen configuration objects, read by every other module.

All configs are ``dataclasses.dataclass(frozen=True)``: hashable, comparable by value
(so they can ride along as Float8Tensor metadata and as torch.compile guards), and
``dataclasses.replace`` derives variants. ``__post_init__`` says what is wrong and what
is allowed.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from f8tensor.formats import FLOAT8_DTYPES, HP_DTYPES

__all__ = ["Granularity", "GemmConfig"]


class Granularity(str, enum.Enum):
    """How many scales a cast uses.

    ``TENSORWISE``: one scale for the whole tensor. ``ROWWISE``: one scale per row along
    the last dimension (for a weight ``(out, in)``: one per output feature). Internally a
    rowwise scale may also run along another axis (``axiswise_dim``), e.g. per column for
    the operands of the weight-gradient GEMM.
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"

    @classmethod
    def parse(cls, value: object) -> "Granularity":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(g.value) for g in cls)
            raise ValueError(f"granularity must be one of {allowed}; got {value!r}") from None


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool; got {value!r}")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """How one FP8 matrix product runs; carried by each Float8Tensor operand.

    - ``out_dtype``: dtype of the product. ``None`` means the first operand's
      high-precision dtype (``x`` in ``x @ w8.t()``). Any of bf16, fp16, fp32 is written
      straight from the fp32 accumulator: there is no FP8 round trip before, say, a
      residual add. For an FP8 output with a known scale use :func:`f8tensor.float8_mm`.
    - ``use_fast_accum``: Hopper's faster, less precise FP8 accumulation (ignored on CPU).
    - ``pad_inner_dim``: zero-pad K and N up to multiples of 16 (what ``torch._scaled_mm``
      requires) instead of raising.
    """

    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False
    pad_inner_dim: bool = False

    def __post_init__(self) -> None:
        if self.out_dtype is not None and self.out_dtype not in HP_DTYPES:
            hint = (
                " (for an FP8 output pass out_dtype and out_scale to f8tensor.float8_mm)"
                if self.out_dtype in FLOAT8_DTYPES
                else ""
            )
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            raise ValueError(
                f"GemmConfig.out_dtype must be None or one of {allowed}; got {self.out_dtype!r}{hint}"
            )
        _check_bool("GemmConfig", "use_fast_accum", self.use_fast_accum)
        _check_bool("GemmConfig", "pad_inner_dim", self.pad_inner_dim)


DEFAULT_GEMM = GemmConfig()
