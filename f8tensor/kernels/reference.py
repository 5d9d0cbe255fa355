"""The reference casts: torch ops only, the same bits eager and under torch.compile.

Scale semantics, one rule per block (see ``scaling.py``)::

    data = saturate(hp.float() * scale)        hp ~= data.float() / scale
"""

from __future__ import annotations

import torch

from f8tensor.quant.formats import E8M0, format_number, saturated_cast, saturation_bound
from f8tensor.quant.scaling import (
    abs_max,
    amax_to_e8m0_scale,
    amax_to_scale,
    block_abs_max,
    block_amax,
    expand_block_scale,
    scale_of_amax,
    stochastic_round,
    tensor_amax,
)
from f8tensor.quant.specs import CastSpec

__all__ = ["CAST_STATS_FIELDS", "block_scale", "cast", "cast_values", "cast_with_stats", "dequantize"]

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

    Args:
        hp: the high-precision tensor.
        spec: the cast spec.
        scale: used as is (0-dim, or the block scale shape, in ``spec.scale_dtype``); None:
            dynamic, from the amax per block.
        generator: for stochastic rounding.
        uniform: the draws of a stochastic rounding, given instead.
    """
    data, scale, _, _, _ = cast_values(hp, spec, scale, generator, need_amax=False, amax=None, uniform=uniform)
    return data, scale


def block_scale(amax: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The scales a dynamic block cast derives from block amaxes (for amaxes agreed elsewhere, e.g. FSDP).

    e8m0 powers of two for MX specs, else fp32 ``float8_max / amax`` (power-of-2 if asked).
    """
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
    """:func:`cast` (the same bits), plus a float64 vector laid out as :data:`CAST_STATS_FIELDS`.

    - ``saturated_count``: elements the clamp set (scaled magnitude above
      :func:`~f8tensor.quant.formats.saturation_bound`); NaN never counted.
    - ``underflow_count``: non-zero in ``hp``, zero in FP8.
    - ``numel``: the element count.
    - ``amax``: ``max |hp|`` (``amax``, when given, is that value already measured; tensorwise only).
    - ``scale``: the scale in use (the smallest one for axiswise and block scales).
    - ``headroom_log2``: ``log2(float8_max / max |hp * scale|)``; ``inf`` for all zeros.

    Stochastic casts report round-to-nearest counts. Computed from the cast's own fp32
    products, so it fuses into the cast under torch.compile; float64 keeps counts exact.
    """
    data, scale, scaled, group_amax, scale32 = cast_values(hp, spec, scale, generator, need_amax=True, amax=amax)
    return data, scale, _cast_stats(hp, scaled, group_amax, scale32, spec.float8_dtype)


def cast_values(
    hp, spec: CastSpec, scale=None, generator=None, *, need_amax=False, amax=None, uniform=None, eager=False
):
    """The saturating cast both casts share: (data, scale, scaled fp32 values, group amax, fp32 scale).

    ``eager``: the caller knows it runs eager (a dynamic scale is then not materialized).
    """
    float8_dtype, block = spec.float8_dtype, spec.block
    fmax = format_number(float8_dtype, "max")  # read once per cast
    group_amax, to_e8m0 = None, False
    # Tensorwise or axiswise with fp32 scales: the per-axis amax kernels (same bits as block ones).
    axis = None
    tensorwise = not block  # is_tensorwise, inlined: once per cast
    # is_axiswise with one 0, inlined: the other entries all 1.
    if (
        not tensorwise
        and spec.scale_dtype == torch.float32
        and block.count(0) == 1
        and block.count(1) == len(block) - 1
    ):
        axis = block.index(0)
    if tensorwise or axis is not None:
        if scale is None and not need_amax:
            # dynamic_scale's body; materialized only where it matters (compiled).
            amax = abs_max(hp, axis)
            if eager:
                scale = scale_of_amax(amax, fmax, spec.power_of_2)
            else:
                scale = amax_to_scale(amax, float8_dtype, round_pow2=spec.power_of_2)
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
            # block_scale's body (inlined: one read of the spec's scale dtype, one guard), e8m0 in
            # fp32: converted after the cast (on a CPU a call, which would split amax from cast),
            # the fp32 scale written once for the cast.
            to_e8m0 = spec.scale_dtype == E8M0
            if to_e8m0:
                scale = amax_to_e8m0_scale(amax, float8_dtype, spec.scale_mode, torch.float32)
                if not eager:
                    scale = scale.as_strided(scale.shape, scale.stride())
            else:
                scale = amax_to_scale(amax, float8_dtype, round_pow2=spec.power_of_2)
        # Deliberate upcast of e8m0 scales: powers of two, exact in fp32.
        scale32 = scale if scale.dtype == torch.float32 else scale.to(torch.float32)
        expanded = expand_block_scale(scale32, block, tuple(hp.shape))
    scaled = _scaled_fp32(hp, expanded)
    if spec.rounding == "stochastic":
        data = saturated_cast(
            stochastic_round(scaled.clamp(-fmax, fmax), float8_dtype, generator, uniform), float8_dtype, fmax=fmax
        )
    else:
        # The product is a temporary of our own: clamp it in place unless stats read it.
        data = saturated_cast(scaled, float8_dtype, inplace=not need_amax, fmax=fmax)
    if to_e8m0:
        scale = scale.to(E8M0)
    return data, scale, scaled, group_amax, scale32


def _scaled_fp32(hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``hp * scale`` in fp32: the values the FP8 rounding sees.

    Deliberate upcast: no second rounding of bf16/fp16 inputs. A 1-element scale promotes
    ``hp`` inside the multiply (no separate upcast pass; the same bits).
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
    # int32 counters where they cannot overflow: cheaper on CPU.
    count = torch.int32 if hp.numel() < 2**31 else torch.int64
    saturated = (magnitude > saturation_bound(float8_dtype)).sum(dtype=count)
    # RNE sends |x| <= smallest_subnormal / 2 (the tie included) to zero, in all four formats.
    underflow = ((hp != 0) & (magnitude <= format_number(float8_dtype, "smallest_subnormal") / 2)).sum(dtype=count)
    # max |hp * scale| without another pass: fp32 rounding is monotonic.
    scaled_amax = (group_amax * scale).amax()
    # Deliberate upcast: a ratio of fp32 numbers, exact enough for the log in float64.
    headroom = torch.log2(format_number(float8_dtype, "max") / scaled_amax.to(f64))
    numel = torch.full((), hp.numel(), dtype=f64, device=hp.device)
    return torch.stack(
        [saturated.to(f64), underflow.to(f64), numel, group_amax.amax().to(f64), scale.amin().to(f64), headroom]
    )


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``data / scale`` in fp32 per block (``block``: a Float8Tensor's ``_block``), cast to ``dtype``."""
    if scale.dim() and any(b > 1 for b in block):
        scale = expand_block_scale(scale, block, tuple(data.shape))
    elif scale.dtype != torch.float32:
        scale = scale.to(torch.float32)  # e8m0: powers of two, exact in fp32
    data32 = data.to(torch.float32)
    hp = data32 / scale
    # Saturate to ``dtype``'s finite range: with power-of-two scales a value near the
    # dtype's max can round into the next binade (fp16 65504 -> 65536). NaN stays NaN; an
    # e5m2 infinity stays infinite.
    limit = torch.finfo(dtype).max
    hp = hp.clamp(-limit, limit)
    if data.dtype == torch.float8_e5m2:
        hp = torch.where(torch.isinf(data32), data32, hp)
    return hp.to(dtype)
