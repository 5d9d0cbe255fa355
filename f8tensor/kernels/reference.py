"""The reference casts: torch ops only, the same bits eager and under torch.compile.

:func:`cast` is every FP8 cast of the library: a high-precision tensor and a
:class:`~f8tensor.quant.config.CastSpec` (and optionally a given scale) in, the FP8 data and its
scale out; :func:`cast_with_stats` also measures what the cast did; :func:`dequantize` is
the way back. Scale semantics, one rule per block (see ``scaling.py``)::

    data = saturate(hp.float() * scale)        hp ~= data.float() / scale
"""

from __future__ import annotations

import torch

from f8tensor.quant.formats import E8M0, format_number, saturated_cast, saturation_bound
from f8tensor.quant.scaling import (
    amax_to_e8m0_scale,
    amax_to_scale,
    block_abs_max,
    block_amax,
    dynamic_scale,
    expand_block_scale,
    stochastic_round,
    tensor_amax,
)
from f8tensor.quant.specs import CastSpec, is_axiswise, is_tensorwise

__all__ = ["CAST_STATS_FIELDS", "block_scale", "cast", "cast_with_stats", "dequantize"]

#: The entries of the vector :func:`cast_with_stats` returns, in this order.
CAST_STATS_FIELDS: tuple[str, ...] = ("saturated_count", "underflow_count", "numel", "amax", "scale", "headroom_log2")


def cast(
    hp: torch.Tensor,
    spec: CastSpec,
    scale: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hp`` cast per ``spec``: ``(data, scale)``.

    With ``scale=None`` the scale is dynamic (the current amax of ``hp``, per block);
    otherwise ``scale`` is used as is (0-dim for a tensorwise spec, else the block's scale
    shape, in ``spec.scale_dtype``). ``generator``: for stochastic rounding; ``uniform``:
    the draws of a stochastic rounding given instead (see :func:`~f8tensor.quant.scaling.stochastic_round`).
    """
    data, scale, _, _, _ = _cast(hp, spec, scale, generator, need_amax=False, uniform=uniform)
    return data, scale


def block_scale(amax: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The scales a dynamic block cast per ``spec`` derives from its block amaxes ``amax``
    (any shape; fp32, or the tensor's own dtype, which widens exactly): e8m0 powers of two
    for MX specs, else fp32 ``float8_max / amax`` (power-of-2 rounded if the spec asks).
    The one rule :func:`cast` applies, for callers that measure or agree the amaxes
    themselves (FSDP ranks that share a block) and pass the scale in."""
    if spec.scale_dtype == E8M0:
        return amax_to_e8m0_scale(amax, spec.float8_dtype, spec.scale_mode)
    return amax_to_scale(amax, spec.float8_dtype, round_pow2=spec.power_of_2)


def cast_with_stats(
    hp: torch.Tensor,
    spec: CastSpec,
    scale: torch.Tensor | None = None,
    *,
    amax: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast` (bitwise the same data and scale), also measuring what the cast did to
    ``hp``: a float64 vector laid out as :data:`CAST_STATS_FIELDS`:

    - ``saturated_count``: elements whose FP8 value the clamp set, i.e. scaled magnitude
      above :func:`~f8tensor.quant.formats.saturation_bound` (max itself, and values that round
      to max anyway, are not saturated). NaN is never counted.
    - ``underflow_count``: elements non-zero in ``hp`` and zero in FP8 (flushed to zero:
      scaled magnitude at most half the smallest subnormal, where round-to-nearest-even
      gives zero).
    - ``numel``: the element count, so that fractions can be formed where they are read.
    - ``amax``: ``max |hp|``. ``amax``, when given, is that value already measured by the
      caller (tensorwise only), and saves a read of ``hp``.
    - ``scale``: the scale in use; for axiswise and block scales the smallest one (the
      row or block that holds the tensor's amax, under dynamic scaling).
    - ``headroom_log2``: ``log2(float8_max / max |hp * scale|)``. About 0 with a dynamic
      scale; positive when a (delayed) scale leaves range unused; negative when the amax
      was clipped, by that many powers of two. ``inf`` for an all-zero tensor.

    With ``rounding="stochastic"`` the counts are those of round-to-nearest on the same
    products (a stochastic cast flushes a slightly different set of tiny values).

    Everything is computed from the fp32 products ``hp * scale`` the cast computes anyway
    and the amax it measures, so under torch.compile it fuses into the cast's kernel (no
    second read of ``hp``). The vector is float64 so that counts stay exact (fp32 would
    stop at 2**24 elements) next to fp32 amax and scale values.
    """
    data, scale, scaled, group_amax, scale32 = _cast(hp, spec, scale, generator, need_amax=True, amax=amax)
    return data, scale, _cast_stats(hp, scaled, group_amax, scale32, spec.float8_dtype)


def _cast(hp, spec: CastSpec, scale, generator, *, need_amax, amax=None, uniform=None):
    """Shared body of the two casts: (data, scale, scaled fp32 values, group amax, fp32 scale)."""
    float8_dtype, block = spec.float8_dtype, spec.block
    group_amax = None
    # Tensorwise, or an axiswise block (0 at one dim, 1 elsewhere) with fp32 scales: the
    # per-axis amax kernels (one reduction over x; the same bits as the block kernels).
    axis = None
    if not is_tensorwise(block) and spec.scale_dtype == torch.float32 and block.count(0) == 1 and is_axiswise(block):
        axis = block.index(0)
    if is_tensorwise(block) or axis is not None:
        if scale is None and not need_amax:
            scale = dynamic_scale(hp, float8_dtype, axiswise_dim=axis, round_pow2=spec.power_of_2)
        elif scale is None:
            group_amax = tensor_amax(hp, axis)
            scale = amax_to_scale(group_amax, float8_dtype, round_pow2=spec.power_of_2)
        elif need_amax:
            group_amax = amax if (amax is not None and axis is None) else tensor_amax(hp, axis)
        scale32 = scale
        expanded = scale
    else:
        if need_amax:
            group_amax = block_amax(hp, block)
        if scale is None:
            # Without stats the amax goes from hp's dtype straight to the scale's float64.
            amax = group_amax if group_amax is not None else block_abs_max(hp, block)
            scale = block_scale(amax, spec)
        # Deliberate upcast of e8m0 scales: powers of two, exact in fp32.
        scale32 = scale if scale.dtype == torch.float32 else scale.to(torch.float32)
        expanded = expand_block_scale(scale32, block, tuple(hp.shape))
    scaled = _scaled_fp32(hp, expanded)
    if spec.rounding == "stochastic":
        fmax = format_number(float8_dtype, "max")
        data = saturated_cast(
            stochastic_round(scaled.clamp(-fmax, fmax), float8_dtype, generator, uniform), float8_dtype
        )
    else:
        # The product is a temporary of our own: clamp it in place unless stats read it.
        data = saturated_cast(scaled, float8_dtype, inplace=not need_amax)
    return data, scale, scaled, group_amax, scale32


def _scaled_fp32(hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``hp * scale`` computed in fp32: the values the FP8 rounding sees.

    Deliberate upcast: bf16/fp16 inputs are not rounded a second time before the FP8
    rounding. A 0-dim fp32 scale would not promote a bf16 tensor; a 1-element one does,
    and the multiply then reads ``hp`` directly instead of after a separate upcast pass
    (the same bits as ``hp.float() * scale``).
    """
    if hp.dim() == 0:
        return hp.to(torch.float32) * scale
    return hp * (scale.reshape(1) if scale.dim() == 0 else scale)


def _cast_stats(
    hp: torch.Tensor,
    scaled: torch.Tensor,
    group_amax: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
) -> torch.Tensor:
    f64 = torch.float64
    if hp.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), float("nan")], dtype=f64, device=hp.device)
    magnitude = scaled.abs()
    # int32 counters where they cannot overflow: a CPU kernel accumulates them at about half
    # the cost of int64 ones (the tensor's size is static, so this is decided once per shape).
    count = torch.int32 if hp.numel() < 2**31 else torch.int64
    saturated = (magnitude > saturation_bound(float8_dtype)).sum(dtype=count)
    # Round-to-nearest-even sends |x| <= smallest_subnormal / 2 to zero (the tie too: zero's
    # mantissa is even) and anything larger to a non-zero value, in all four formats. So the
    # flushed elements are found on the fp32 products, not by reading the FP8 bytes back.
    underflow = ((hp != 0) & (magnitude <= format_number(float8_dtype, "smallest_subnormal") / 2)).sum(dtype=count)
    # max |hp * scale| without another pass over the tensor: fp32 rounding is monotonic, so
    # the largest rounded product is the rounded product of the largest |hp| (per group).
    scaled_amax = (group_amax * scale).amax()
    # Deliberate upcast: a ratio of fp32 numbers, exact enough for the log in float64.
    headroom = torch.log2(format_number(float8_dtype, "max") / scaled_amax.to(f64))
    numel = torch.full((), hp.numel(), dtype=f64, device=hp.device)
    return torch.stack(
        [saturated.to(f64), underflow.to(f64), numel, group_amax.amax().to(f64), scale.amin().to(f64), headroom]
    )


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``data / scale`` in fp32 per block (``block``: a Float8Tensor's per-dim ``_block``),
    then cast to ``dtype``."""
    if scale.dim() and any(b > 1 for b in block):
        scale = expand_block_scale(scale, block, tuple(data.shape))
    elif scale.dtype != torch.float32:
        scale = scale.to(torch.float32)  # e8m0: powers of two, exact in fp32
    data32 = data.to(torch.float32)
    hp = data32 / scale
    # Saturate to ``dtype``'s finite range, as the cast saturates to the format's. With a
    # power-of-two scale (``power_of_2_scale``, e8m0) the FP8 rounding of ``hp * scale`` is
    # the rounding of ``hp``'s mantissa to the format's bits, whatever the exponent: a
    # value within half an FP8 ulp (3-6 %) of the dtype's max rounds up into the next
    # binade (fp16 65504 -> 65536) for every power-of-two scale, so no scale choice can
    # leave room for it; the way back clamps instead. A tiny given scale overflows the
    # same way. NaN stays NaN (clamp keeps it); an FP8 infinity (e5m2 data written by
    # hand: the casts never store one) stays infinite. One elementwise op, no host sync.
    limit = torch.finfo(dtype).max
    hp = hp.clamp(-limit, limit)
    if data.dtype == torch.float8_e5m2:
        hp = torch.where(torch.isinf(data32), data32, hp)
    return hp.to(dtype)

