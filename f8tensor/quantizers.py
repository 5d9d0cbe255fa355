"""The casts of the linear's operands and the per-role state they use.

Every cast of :class:`~f8tensor.linear_autograd.QuantizedLinearFn` goes through this module:
:func:`cast_operand` (an FP8 cast per a role's :class:`~f8tensor.config.CastConfig`, dynamic
or delayed, any granularity: :meth:`CastConfig.operand_spec` gives each GEMM operand its
:class:`~f8tensor.config.CastSpec`) and :func:`cast_gemm_operand` (FP8 or FP4, dynamic, for
configs that name a format per GEMM). Both end in one cast entry point, :func:`quantize`.
:func:`column_major_copy` is the one place here that lays FP8 bytes out column-major for
the weight-gradient GEMM.

The state is named: :class:`DelayedBuffers` (the delayed-scaling buffers of a layer) and
:class:`StatsBuffers` (its telemetry), each ``None`` when the config does not use it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from f8tensor.compat import current_graph_task_id, functional_all_reduce_max
from f8tensor.config import CastConfig, CastSpec, Float8LinearConfig, GemmConfig, is_tensorwise
from f8tensor.fp4 import to_float4, to_float4_with_stats
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.scaling import delayed_scale, materialized, tensor_amax
from f8tensor.tensor import Float8Tensor, to_float8_for_gemm, to_float8_with_stats, with_inverse_scale

__all__ = [
    "DelayedBuffers",
    "StatsBuffers",
    "cast_column_major",
    "cast_gemm_operand",
    "cast_operand",
    "cast_second_operand",
    "column_major_copy",
    "quantize",
    "recomputing",
    "record_call",
    "recorded_scales",
    "sync_amax",
]


class DelayedBuffers(NamedTuple):
    """A layer's delayed-scaling state (fp32 buffers; the field names are the buffer names).

    One amax history per operand role; the scales the current step used for input and
    weight (re-used if activation checkpointing re-runs forward); and the scales of each of
    the last calls of a step, keyed by the input's amax (see ``Float8Linear``)."""

    amax_history_input: torch.Tensor
    amax_history_weight: torch.Tensor
    amax_history_grad_output: torch.Tensor
    scale_input: torch.Tensor
    scale_weight: torch.Tensor
    delayed_call_keys: torch.Tensor
    delayed_call_scales: torch.Tensor


class StatsBuffers(NamedTuple):
    """A layer's cast telemetry, one float64 vector per operand role (laid out as
    ``CAST_STATS_FIELDS``; the field names are the buffer names)."""

    float8_stats_input: torch.Tensor
    float8_stats_weight: torch.Tensor
    float8_stats_grad_output: torch.Tensor


def record_call(
    keys: torch.Tensor, scales: torch.Tensor, key: torch.Tensor, scale_in: torch.Tensor, scale_w: torch.Tensor
) -> None:
    """Push this forward's (key, input scale, weight scale) as the newest recorded call."""
    keys.copy_(torch.cat([key.reshape(1).to(keys.dtype), keys[:-1]]))
    scales.copy_(torch.cat([torch.stack([scale_in, scale_w]).reshape(1, 2), scales[:-1]]))


def recorded_scales(keys: torch.Tensor, scales: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight scales of the newest recorded call with this key (no device
    sync: an argmax on the device). No match (more than _CALLS calls since): the newest."""
    index = (keys == key).to(torch.int32).argmax()
    row = scales[index]
    return row[0], row[1]


def sync_amax(amax: torch.Tensor) -> torch.Tensor:
    """Make an amax agree across data-parallel ranks (a no-op without torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return amax
    return functional_all_reduce_max(amax, dist.group.WORLD)


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside backward (eager).

    Delayed scaling must cast with the scale the original forward used then. Under
    torch.compile the partitioner recomputes from the traced graph and never replays
    buffer updates.
    """
    if torch.compiler.is_compiling():
        return False
    return current_graph_task_id() != -1


def cast_operand(
    hp: torch.Tensor,
    cast: CastConfig,
    contracted_dim: int,
    gemm: GemmConfig,
    config: Float8LinearConfig,
    history: torch.Tensor | None = None,
    scale_buffer: torch.Tensor | None = None,
    recompute: bool = False,
    stats: torch.Tensor | None = None,
    column_major: GemmConfig | None = None,
) -> tuple[Float8Tensor, torch.Tensor | None, Float8Tensor | None]:
    """Cast one GEMM operand per its CastConfig (dynamic or delayed); its GEMM contracts
    over ``contracted_dim`` (see :meth:`CastConfig.operand_spec`).

    Returns the FP8 tensor; for a delayed cast the current amax, which the caller pushes
    into ``history`` (see :class:`~f8tensor.linear_autograd.QuantizedLinearFn`), for a dynamic cast ``None``; and with
    ``column_major`` (the weight-gradient GEMM's config) the tensor's column-major twin,
    written by the same cast where the cast is fused (else None).
    Delayed: the scale comes from ``history`` and is also written to ``scale_buffer``;
    with ``recompute`` (a checkpointed forward running again) the scale stored there by
    the original forward is used instead. ``stats``: the role's telemetry buffer, which
    this cast overwrites, or ``None`` (no telemetry).
    """
    spec = cast.operand_spec(contracted_dim)
    if not cast.delayed:
        if column_major is not None:
            f8, twin = _cast_both(stats, hp, spec, gemm, column_major)
            return f8, None, twin
        return quantize(stats, hp, spec, gemm=gemm), None, None
    assert history is not None  # a delayed cast comes with its amax history
    # The scale comes from the history alone (unit scale while it is empty, see
    # delayed_scale), so the cast does not wait for the current amax. That amax, pushed
    # into the history in backward, is taken after the cast, which is stored first
    # (`materialized`): under torch.compile inductor then computes it in the cast's own
    # pass over `hp` (its CPU back end fuses a pointwise loop with a later reduction over
    # the same outer loop, not with an earlier one). A scale decided in advance does not
    # see an inf in `hp`, which the saturating cast would turn into the format's max:
    # make it NaN, element by element, in the same pass (NaN stays NaN).
    guarded = torch.where(torch.isinf(hp), torch.nan, hp)
    if recompute:
        assert scale_buffer is not None  # recomputed casts (input, weight) keep their scale
        scale = scale_buffer.clone()
    else:
        scale = delayed_scale(
            history,
            cast.dtype,
            reduction=config.delayed.reduction,
            margin=config.delayed.margin,
            round_pow2=cast.power_of_2_scale,
        )
    amax_local = None if stats is None else _amax_by_rows(hp)
    # The stats describe this rank's tensor: its own amax, not the all-reduced one.
    fp8 = quantize(stats, guarded, spec, scale=scale, gemm=gemm, amax=amax_local)
    fp8 = fp8._replace(data=materialized(fp8._data))
    if amax_local is None:
        amax_local = _amax_by_rows(hp)
    if scale_buffer is not None and not recompute:
        scale_buffer.copy_(scale)
    return fp8, sync_amax(amax_local), None if column_major is None else column_major_copy(fp8, column_major)


def _amax_by_rows(hp: torch.Tensor) -> torch.Tensor:
    """``tensor_amax(hp)`` (the same value: min and max are exact), reduced row by row
    first for a 2D ``hp``: a reduction over the cast's own loop nest, which inductor fuses
    into the cast's pass (a flat reduction over all elements has other loops and stays a
    pass of its own)."""
    if hp.dim() != 2 or hp.numel() == 0:
        return tensor_amax(hp)
    return torch.maximum(hp.amax(-1), -hp.amin(-1)).amax().float()


def quantize(
    stats: torch.Tensor | None, hp: torch.Tensor, spec: CastSpec, *, amax: torch.Tensor | None = None, **kwargs
) -> Float8Tensor:
    """``to_float8``, or with ``stats`` its measuring twin, whose numbers overwrite ``stats``
    (never accumulate: a checkpointed forward that runs again writes the same)."""
    if stats is None:
        return to_float8_for_gemm(hp, spec, **kwargs)[0]
    f8, measured = to_float8_with_stats(hp, spec, amax=amax, **kwargs)
    stats.copy_(measured)
    return with_inverse_scale(f8)


def _cast_both(
    stats: torch.Tensor | None, hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, column_major: GemmConfig
) -> tuple[Float8Tensor, Float8Tensor]:
    """:func:`quantize` of a 2D ``hp`` and its column-major twin (config ``column_major``), from
    one pass where the cast is fused (with telemetry: the measuring cast, then a copy)."""
    if stats is None:
        f8, twin = to_float8_for_gemm(hp, spec, gemm=gemm, layouts="both", column_major_gemm=column_major)
        if twin is not None:
            return f8, twin
    else:
        f8 = quantize(stats, hp, spec, gemm=gemm)
    return f8, column_major_copy(f8, column_major)


def cast_second_operand(hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None) -> Float8Tensor:
    """The weight cast for grad_x's product, whose second operand it is: on CUDA written
    column-major, the layout every FP8 kernel reads its second operand in (the GEMM's
    operand preparation would copy it otherwise); on CPU, where only the per-tensor
    product needs that layout, as the cast lays it out for block scales (their reference
    product reads any layout). Under torch.compile the layout is inductor's to place (a
    column-major cast there would have the partitioner keep a transposed copy of the
    weight for backward)."""
    if not torch.compiler.is_compiling() and (hp.is_cuda or is_tensorwise(spec.block)):
        return cast_column_major(None, hp, spec, gemm, scale)
    return quantize(None, hp, spec, scale=scale, gemm=gemm)


def cast_column_major(
    stats: torch.Tensor | None, hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None
) -> Float8Tensor:
    """:func:`quantize` of a 2D ``hp`` with its bytes column-major: an operand only one GEMM
    reads, as its second operand or as an operand of the weight-gradient GEMM (M
    innermost), written so by the cast where it is fused (else copied, as the GEMM's
    operand preparation would copy it)."""
    if stats is None:
        return to_float8_for_gemm(hp, spec, scale=scale, gemm=gemm, layouts="column_major")[0]
    return column_major_copy(quantize(stats, hp, spec, scale=scale, gemm=gemm))


def column_major_copy(f8: Float8Tensor, gemm: GemmConfig | None = None) -> Float8Tensor:
    """``f8`` (2D) with its FP8 bytes laid out column-major: the layout the weight-gradient
    GEMM takes for both operands (it contracts over the tokens, dim 0).

    Written as a copy into a column-major buffer, which inductor fuses into the cast that
    produced ``f8``: one pass over the high-precision tensor stores both layouts. (Left to
    the GEMM's operand preparation (``gemm.operands.col_major``), the transposed copy becomes a pass of its own that
    casts the high-precision tensor a second time.) In eager mode it is one copy of the
    FP8 bytes, as before. ``gemm``: the copy's GemmConfig (default: ``f8``'s).
    """
    data = f8._data  # a fresh cast: row-major (no stride test, which dynamic shapes would trace)
    out = torch.empty_strided(data.shape, (1, data.shape[0]), dtype=data.dtype, device=data.device)
    out.copy_(data)
    return f8._replace(data=materialized(out, (1, data.shape[0])), gemm=f8._gemm if gemm is None else gemm)


def cast_gemm_operand(
    hp: torch.Tensor,
    cast: CastConfig,
    contracted_dim: int,
    gemm: GemmConfig,
    config: Float8LinearConfig,
    stats: torch.Tensor | None = None,
):
    """One GEMM operand cast per ``cast`` (FP8 or FP4, dynamic scaling), contracted over
    ``contracted_dim``: a Float8Tensor or a Float4Tensor (packed along that dim).
    ``stats``: the role's telemetry buffer, overwritten, or ``None``."""
    spec = cast.operand_spec(contracted_dim)
    if not cast.fp4:
        return quantize(stats, hp, spec, gemm=gemm)
    kind = cast.fp4_kind
    assert kind is not None  # an FP4 cast (cast.fp4) names its kind
    fspec = FP4Spec(kind, spec.block, contracted_dim % hp.dim(), spec.scale_mode, spec.rounding,
                    config.four_over_six and kind == "nvfp4")
    if stats is None:
        return to_float4(hp, fspec, gemm=gemm)
    f4, measured = to_float4_with_stats(hp, fspec, gemm=gemm)
    stats.copy_(measured)
    return f4


