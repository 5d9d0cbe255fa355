"""Block quantizers: casts kept as raw FP8 bytes and scales (moments, saved activations, gathers).

Each storage role has one :class:`BlockQuantizer`; every cast goes through
:func:`f8tensor.kernels.cast` and back through :func:`f8tensor.kernels.dequantize`, one rule per
block: ``data = saturate(hp * scale)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from f8tensor import kernels
from f8tensor.quant.config import CastConfig
from f8tensor.quant.specs import BlockGranularity, CastSpec, Granularity, layout_block

__all__ = [
    "BlockQuantizer",
    "activation_quantizer",
    "export_quantizer",
    "input_gather_quantizer",
    "moment_quantizer",
    "weight_gather_quantizer",
]


class BlockQuantizer(NamedTuple):
    """One storage role's cast and its way back.

    Fields: ``spec`` (the cast), ``dtype`` (what :meth:`dequantize` returns), ``rows`` (cast
    as ``(shape[0], numel / shape[0])``).
    """

    spec: CastSpec
    dtype: torch.dtype = torch.float32
    rows: bool = False

    def quantize(
        self, hp: torch.Tensor, scale: torch.Tensor | None = None, *, uniform: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` of ``hp``; ``scale`` given or dynamic, ``uniform``: stochastic draws."""
        if not self.rows:
            return kernels.cast(hp, self.spec, scale, uniform=uniform)
        shape = _row_view(hp, "quantize")
        if hp.shape == shape:
            return kernels.cast(hp, self.spec, scale, uniform=uniform)
        if uniform is not None and uniform.shape != shape:
            uniform = uniform.reshape(shape)
        data, scale = kernels.cast(hp.reshape(shape), self.spec, scale, uniform=uniform)
        return data.view(hp.shape), scale

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``data / scale`` per block, in ``dtype`` (default :attr:`dtype`)."""
        dtype = self.dtype if dtype is None else dtype
        if not self.rows:
            return kernels.dequantize(data, scale, self.block_of(data.dim()), dtype)
        shape = _row_view(data, "dequantize")
        if data.shape == shape:
            return kernels.dequantize(data, scale, self.block_of(2), dtype)
        return kernels.dequantize(data.view(shape), scale, self.block_of(2), dtype).view(data.shape)

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The scales a dynamic cast takes for block amaxes measured or agreed elsewhere."""
        return kernels.block_scale(amax, self.spec)

    def block_of(self, ndim: int) -> tuple[int, ...]:
        """The per-dim block of a Float8Tensor of ``ndim`` dims (tensorwise: zeros)."""
        return layout_block(self.spec.block, ndim)

    def with_block(self, block: tuple[int, ...]) -> BlockQuantizer:
        """This quantizer with another block."""
        return self._replace(spec=self.spec._replace(block=block))


def _row_view(t: torch.Tensor, what: str) -> torch.Size:
    """``t``'s shape as ``(shape[0], prod(shape[1:]))``."""
    if t.dim() < 2:
        raise ValueError(
            f"BlockQuantizer(rows=True).{what}: blocks run along dim-0 rows of a tensor with 2 dims or more; "
            f"got shape {tuple(t.shape)}"
        )
    return torch.Size((t.shape[0], math.prod(t.shape[1:])))


def moment_quantizer(
    float8_dtype: torch.dtype = torch.float8_e4m3fn, block: int = 128, rounding: str = "stochastic"
) -> BlockQuantizer:
    """An optimizer moment: one scale per ``block`` elements of each dim-0 row; back in fp32."""
    return BlockQuantizer(CastSpec(float8_dtype, (1, block), rounding=rounding), torch.float32, rows=True)


def activation_quantizer(float8_dtype: torch.dtype, block: int, ndim: int, dtype: torch.dtype) -> BlockQuantizer:
    """A saved activation: one scale per ``block`` elements of the last dim; back in ``dtype``."""
    return BlockQuantizer(CastSpec(float8_dtype, (1,) * (ndim - 1) + (block,)), dtype)


def weight_gather_quantizer(cast: CastConfig) -> BlockQuantizer:
    """A weight shard FSDP2 all-gathers in FP8 (tensorwise: with the agreed scale)."""
    if cast.tensorwise:
        return BlockQuantizer(CastSpec(cast.dtype))
    return BlockQuantizer(cast.operand_spec(1))


def input_gather_quantizer(cast: CastConfig, ndim: int) -> BlockQuantizer:
    """A layer input a tensor-parallel style gathers in FP8, contracted over the last dim."""
    return BlockQuantizer(cast.operand_spec(ndim - 1, ndim=ndim))


def export_quantizer(granularity: Granularity | BlockGranularity, power_of_2_scale: bool = False) -> BlockQuantizer:
    """A 2D weight (N, K) written to an FP8 checkpoint, e4m3 scales of ``granularity`` (powers of two if asked)."""
    return BlockQuantizer(CastConfig(granularity=granularity, power_of_2_scale=power_of_2_scale).operand_spec(1))
