"""Block quantizers: the casts whose results are kept as raw FP8 bytes and scales.

A :class:`~f8tensor.quant.quantizers.Quantizer` casts a linear's operands for its GEMMs and hands
them over as Float8Tensors. The roles here keep what they cast as plain tensors (FP8 data
and its scales, in their own state or buffers), or build a tensor from bytes a collective
moved. Each role has one :class:`BlockQuantizer`, built from its config:

==============================  ===================================  ============================================
role                            built by                             cast
==============================  ===================================  ============================================
optimizer moments (AdamW)       :func:`moment_quantizer`             e4m3, one scale per 128 elements of each
                                                                     dim-0 row, stochastic rounding with the
                                                                     caller's draws; back in fp32
saved activations               :func:`activation_quantizer`         one scale per ``block`` elements of the last
                                                                     dim; back in the saved tensor's dtype
FSDP2 weight shard (gather)     :func:`weight_gather_quantizer`      the weight's cast, with the scale the ranks
                                                                     agreed (tensorwise, blocks that shards cut)
                                                                     or the shard's own
TP input shard (gather)         :func:`input_gather_quantizer`       the layer's input cast along the last dim,
                                                                     tensorwise with the group's agreed scale
MoE weight-gradient groups      ``BlockQuantizer(spec)``             per tensor, or per expert group and column
                                                                     with scales from the groups' amaxes
exported weights                :func:`export_quantizer`             the weight role of a granularity
==============================  ===================================  ============================================

Every cast goes through the one raw cast below (:func:`f8tensor.kernels.cast`: the fused
kernels on eager CUDA where they apply, the torch-ops reference elsewhere) and back through
:func:`f8tensor.kernels.dequantize`, with one rule per block: ``data = saturate(hp *
scale)``, ``hp ~= data / scale``. Scales agreed elsewhere (an all-reduced amax) become
scales through :meth:`BlockQuantizer.scale_for`, the rule a dynamic cast applies. A format
that stores the inverse (inference engines' ``weight_scale_inv``) is converted where it
leaves the package, in ``export.py``.
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

    Fields: ``spec``, the :class:`~f8tensor.quant.specs.CastSpec` of every cast (format, block,
    scale dtype, rounding); ``dtype``, what :meth:`dequantize` returns unless told otherwise;
    ``rows``: the tensor is cast as ``(shape[0], numel / shape[0])``, its dim-0 rows (2 dims
    or more; the data comes back in the tensor's shape, the scales in that 2D view's).

    A NamedTuple: immutable, compared by value, and free to build per call.
    """

    spec: CastSpec
    dtype: torch.dtype = torch.float32
    rows: bool = False

    def quantize(
        self, hp: torch.Tensor, scale: torch.Tensor | None = None, *, uniform: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)``: ``hp`` cast per :attr:`spec` (:func:`f8tensor.kernels.cast`).

        ``scale``: used as is when given (0-dim for a tensorwise spec, else the block's scale
        shape), dynamic otherwise. ``uniform``: for stochastic rounding, the draws in ``[0,
        1)``, one per element (``hp``'s shape, or with ``rows`` that of its 2D view)."""
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
        """``data / scale`` per block (:func:`f8tensor.kernels.dequantize`), in ``dtype``
        (default :attr:`dtype`), in ``data``'s shape."""
        dtype = self.dtype if dtype is None else dtype
        if not self.rows:
            return kernels.dequantize(data, scale, self.block_of(data.dim()), dtype)
        shape = _row_view(data, "dequantize")
        if data.shape == shape:
            return kernels.dequantize(data, scale, self.block_of(2), dtype)
        return kernels.dequantize(data.view(shape), scale, self.block_of(2), dtype).view(data.shape)

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The scales a dynamic cast per :attr:`spec` takes for block amaxes ``amax``
        (:func:`f8tensor.kernels.block_scale`): for amaxes measured or agreed elsewhere."""
        return kernels.block_scale(amax, self.spec)

    def block_of(self, ndim: int) -> tuple[int, ...]:
        """The per-dim block a Float8Tensor of ``ndim`` dims over this quantizer's data
        stores (tensorwise: all zeros)."""
        return layout_block(self.spec.block, ndim)

    def with_block(self, block: tuple[int, ...]) -> BlockQuantizer:
        """This quantizer with another block (e.g. ``(1, 1)``: one given scale per element)."""
        return self._replace(spec=self.spec._replace(block=block))


def _row_view(t: torch.Tensor, what: str) -> torch.Size:
    """``t``'s shape as ``(shape[0], prod(shape[1:]))``: an empty shard keeps its row length."""
    if t.dim() < 2:
        raise ValueError(
            f"BlockQuantizer(rows=True).{what}: blocks run along dim-0 rows of a tensor with 2 dims or more; "
            f"got shape {tuple(t.shape)}"
        )
    return torch.Size((t.shape[0], math.prod(t.shape[1:])))


def moment_quantizer(
    float8_dtype: torch.dtype = torch.float8_e4m3fn, block: int = 128, rounding: str = "stochastic"
) -> BlockQuantizer:
    """An optimizer moment: one fp32 scale per ``block`` consecutive elements of each dim-0
    row (the tensor seen as ``(shape[0], numel / shape[0])``; a row's last block may be
    short), dynamic scales, ``rounding`` (``"stochastic"`` with the caller's draws, or
    ``"nearest"``); back in fp32. FSDP2 shards dim 0, so a shard's blocks are those one
    process has."""
    return BlockQuantizer(CastSpec(float8_dtype, (1, block), rounding=rounding), torch.float32, rows=True)


def activation_quantizer(float8_dtype: torch.dtype, block: int, ndim: int, dtype: torch.dtype) -> BlockQuantizer:
    """A saved activation of ``ndim`` dims and dtype ``dtype``: one fp32 scale per ``block``
    consecutive elements of its last dim (the last block may be short), dynamic, round to
    nearest; back in ``dtype``."""
    return BlockQuantizer(CastSpec(float8_dtype, (1,) * (ndim - 1) + (block,)), dtype)


def weight_gather_quantizer(cast: CastConfig) -> BlockQuantizer:
    """The shard of a weight that FSDP2 all-gathers in FP8, per its :class:`CastConfig`: the
    cast of the weight's GEMM operand (contracted over dim 1). Tensorwise shards are always
    cast with a scale given (agreed over the mesh, or the delayed one), rounded to nearest."""
    if cast.tensorwise:
        return BlockQuantizer(CastSpec(cast.dtype))
    return BlockQuantizer(cast.operand_spec(1))


def input_gather_quantizer(cast: CastConfig, ndim: int) -> BlockQuantizer:
    """A layer input of ``ndim`` dims that a tensor-parallel style gathers in FP8: the
    input's cast (``cast``) for a GEMM contracted over the last dim."""
    return BlockQuantizer(cast.operand_spec(ndim - 1, ndim=ndim))


def export_quantizer(granularity: Granularity | BlockGranularity) -> BlockQuantizer:
    """A 2D weight (N, K) written to an FP8 checkpoint: e4m3, dynamic scales of
    ``granularity`` as the weight's GEMM operand (contracted over K) takes them."""
    return BlockQuantizer(CastConfig(granularity=granularity).operand_spec(1))
