"""Quantizers: one per operand role of a linear, and the one cast entry point below them.

A :class:`Quantizer` is one role of a linear (input, weight or grad_output), built per
call from the config and the layer's buffers by :func:`linear_quantizers`. It casts an
operand once for the GEMM that reads it, writes the layouts its consumers read (with
``column_major``, also the weight-gradient GEMM's column-major copy, from the same pass
where the cast is fused), and owns the role's state: the delayed amax history and the
step's scale, the telemetry buffer, and for the weight the reused casts of a
``reuse_weight_casts`` scope. :class:`~f8tensor.nn.linear_autograd.QuantizedLinearFn` holds
the three quantizers between forward and backward.

Below them: :func:`cast_operand` (a role's FP8 cast, dynamic or delayed, any granularity:
:meth:`CastConfig.operand_spec` gives each GEMM operand its :class:`CastSpec`) and
:func:`cast_gemm_operand` (FP8 or FP4, dynamic, for configs that name a format per GEMM)
both end in :func:`quantize`, the one cast entry point; every column-major copy of a
cast is :func:`column_major_copy`'s (its buffer from :mod:`f8tensor.kernels.layouts`).

The layer's buffers travel as :class:`DelayedBuffers` (the delayed-scaling buffers) and
:class:`StatsBuffers` (its telemetry), each ``None`` when the config does not use it.

The roles that keep raw FP8 bytes and scales rather than Float8Tensors (optimizer moments,
saved activations, the FSDP2 and TP gathers, MoE's per-group casts, export) have their
quantizers beside these, in :mod:`f8tensor.quant.block_quantizers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from f8tensor.compat import current_graph_task_id, functional_all_reduce_max
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.kernels.layouts import to_column_major
from f8tensor.quant.config import DEFAULT_GEMM, CastConfig, CastSpec, Float8LinearConfig, GemmConfig, is_tensorwise
from f8tensor.quant.scaling import delayed_scale, materialized, push_amax, tensor_amax
from f8tensor.tensor.float8 import Float8Tensor, to_float8_for_gemm, to_float8_with_stats, with_inverse_scale
from f8tensor.tensor.fp4 import Float4Tensor, to_float4, to_float4_with_stats

__all__ = [
    "DelayedBuffers",
    "Quantized",
    "Quantizer",
    "StatsBuffers",
    "cast_column_major",
    "cast_gemm_operand",
    "cast_operand",
    "cast_second_operand",
    "column_major_copy",
    "linear_quantizers",
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
    into ``history`` (see :class:`~f8tensor.nn.linear_autograd.QuantizedLinearFn`), for a dynamic cast ``None``; and with
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
            f8, twin = quantize(hp, spec, gemm, stats=stats, layouts="both", column_major_gemm=column_major)
            return f8, None, twin
        return quantize(hp, spec, gemm, stats=stats)[0], None, None
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
    fp8 = quantize(guarded, spec, gemm, scale=scale, stats=stats, amax=amax_local)[0]
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
    hp: torch.Tensor,
    spec: CastSpec | FP4Spec,
    gemm: GemmConfig = DEFAULT_GEMM,
    *,
    scale: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    layouts: str = "natural",
    column_major_gemm: GemmConfig | None = None,
) -> tuple[Any, Float8Tensor | None]:
    """The one cast entry point of the linear's operands: ``hp`` cast per ``spec`` (FP8 per a
    :class:`CastSpec`, FP4 per an :class:`FP4Spec`) for a GEMM with config ``gemm``.

    Returns the cast and, with ``layouts="both"``, its column-major copy (config
    ``column_major_gemm``, default ``gemm``), else None; ``layouts="column_major"``: the
    cast's own bytes column-major. The fused kernels write every layout in the one pass
    (``kernels.cast_for_gemm``); otherwise the copy is :func:`column_major_copy`'s.
    ``scale``: a scale decided in advance (delayed scaling), else a dynamic one. ``stats``:
    the role's telemetry buffer, which the measuring cast overwrites (never accumulates:
    a checkpointed forward that runs again writes the same), with ``amax`` the amax the
    stats report where the caller measured it; None: no telemetry. FP4 casts take
    neither ``scale`` nor other layouts."""
    if isinstance(spec, FP4Spec):
        assert scale is None and layouts == "natural"  # FP4 casts are dynamic, packed along the contraction
        if stats is None:
            return to_float4(hp, spec, gemm=gemm), None
        f4, measured = to_float4_with_stats(hp, spec, gemm=gemm)
        stats.copy_(measured)
        return f4, None
    if stats is None:
        f8, twin = to_float8_for_gemm(hp, spec, scale=scale, gemm=gemm, layouts=layouts, column_major_gemm=column_major_gemm)
        if layouts == "both" and twin is None:
            twin = column_major_copy(f8, column_major_gemm)
        return f8, twin
    f8, measured = to_float8_with_stats(hp, spec, scale=scale, gemm=gemm, amax=amax)
    stats.copy_(measured)
    f8 = with_inverse_scale(f8)
    if layouts == "natural":
        return f8, None
    if layouts == "both":
        return f8, column_major_copy(f8, column_major_gemm)
    return column_major_copy(f8), None


def cast_second_operand(hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None) -> Float8Tensor:
    """The weight cast for grad_x's product, whose second operand it is: on CUDA written
    column-major, the layout every FP8 kernel reads its second operand in (the GEMM's
    operand preparation would copy it otherwise); on CPU, where only the per-tensor
    product needs that layout, as the cast lays it out for block scales (their reference
    product reads any layout). Under torch.compile the layout is inductor's to place (a
    column-major cast there would have the partitioner keep a transposed copy of the
    weight for backward)."""
    column_major = not torch.compiler.is_compiling() and (hp.is_cuda or is_tensorwise(spec.block))
    return quantize(hp, spec, gemm, scale=scale, layouts="column_major" if column_major else "natural")[0]


def cast_column_major(
    stats: torch.Tensor | None, hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None
) -> Float8Tensor:
    """:func:`quantize` of a 2D ``hp`` with its bytes column-major: an operand only one GEMM
    reads, as its second operand or as an operand of the weight-gradient GEMM (M
    innermost), written so by the cast where it is fused (else copied, as the GEMM's
    operand preparation would copy it)."""
    return quantize(hp, spec, gemm, scale=scale, stats=stats, layouts="column_major")[0]


def column_major_copy(f8: Float8Tensor, gemm: GemmConfig | None = None) -> Float8Tensor:
    """``f8`` (2D) with its FP8 bytes laid out column-major: the layout the weight-gradient
    GEMM takes for both operands (it contracts over the tokens, dim 0).

    Written as a copy into a column-major buffer (:func:`f8tensor.kernels.layouts.to_column_major`),
    which inductor fuses into the cast that produced ``f8``: one pass over the
    high-precision tensor stores both layouts. (Left to the GEMM's operand preparation
    (``gemm.operands.col_major``), the transposed copy becomes a pass of its own that casts
    the high-precision tensor a second time.) In eager mode it is one copy of the FP8
    bytes. ``gemm``: the copy's GemmConfig (default: ``f8``'s).
    """
    data = f8._data  # a fresh cast: row-major (no stride test, which dynamic shapes would trace)
    out = to_column_major(data)
    return f8._replace(data=materialized(out, (1, data.shape[0])), gemm=f8._gemm if gemm is None else gemm)


def cast_gemm_operand(
    hp: torch.Tensor,
    cast: CastConfig,
    contracted_dim: int,
    gemm: GemmConfig,
    config: Float8LinearConfig,
    stats: torch.Tensor | None = None,
) -> Any:
    """One GEMM operand cast per ``cast`` (FP8 or FP4, dynamic scaling), contracted over
    ``contracted_dim``: a Float8Tensor or a Float4Tensor (packed along that dim).
    ``stats``: the role's telemetry buffer, overwritten, or ``None``."""
    spec = cast.operand_spec(contracted_dim)
    if not cast.fp4:
        return quantize(hp, spec, gemm, stats=stats)[0]
    kind = cast.fp4_kind
    assert kind is not None  # an FP4 cast (cast.fp4) names its kind
    fspec = FP4Spec(kind, spec.block, contracted_dim % hp.dim(), spec.scale_mode, spec.rounding,
                    config.four_over_six and kind == "nvfp4")
    return quantize(hp, fspec, gemm, stats=stats)[0]


# ===================================================================== one role's quantizer


class Quantized(NamedTuple):
    """What :meth:`Quantizer.quantize` returns: the cast as its first GEMM reads it; its
    column-major copy for the weight-gradient GEMM where that was asked for (written by the
    same pass where the cast is fused), else None; and for a delayed cast the amax of
    ``hp`` (agreed across ranks) that :meth:`Quantizer.push` adds to the history, else None."""

    tensor: Float8Tensor
    column_major: Float8Tensor | None
    amax: torch.Tensor | None


class Quantizer(NamedTuple):
    """One operand role of a linear (``"input"``, ``"weight"`` or ``"grad_output"``): its
    cast, the layouts its consumers read, and its state.

    Built per call by :func:`linear_quantizers` from the config and the layer's buffers
    (a NamedTuple: torch.compile traces through it as through a tuple). Fields: ``role``;
    ``config``, whose field of that name is the role's :class:`CastConfig` (and whose
    ``cast_for`` gives the per-GEMM formats); ``history``: the role's delayed amax history,
    else None; ``scale``: for a delayed input or weight, the buffer keeping the scale the
    step's forward used, else None; ``stats``: the role's telemetry buffer (each measured
    cast overwrites it), else None; ``cache``: for the weight inside a
    ``reuse_weight_casts`` scope, (the layer's WeightCasts, the parameter they are keyed
    on), else None.

    Every cast ends in :func:`quantize`, the one cast entry point; every column-major copy
    in :func:`column_major_copy`.
    """

    role: str
    config: Float8LinearConfig
    history: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    cache: tuple[Any, torch.Tensor] | None = None

    def cast_config(self) -> CastConfig:
        """The role's CastConfig (per-role recipes)."""
        return getattr(self.config, self.role)

    def quantize(
        self,
        hp: torch.Tensor,
        contracted_dim: int,
        gemm: GemmConfig,
        *,
        column_major: GemmConfig | None = None,
        recompute: bool = False,
        measure: bool = True,
    ) -> Quantized:
        """The role's cast of ``hp`` for a GEMM that contracts over ``contracted_dim``
        (:func:`cast_operand`): dynamic or delayed per the role's CastConfig. With
        ``column_major`` (the weight-gradient GEMM's config), also the column-major copy.
        ``measure=False``: a re-cast the telemetry does not record."""
        f8, amax, twin = cast_operand(
            hp, self.cast_config(), contracted_dim, gemm, self.config, self.history, self.scale, recompute,
            self.stats if measure else None, column_major,
        )
        return Quantized(f8, twin, amax)

    def quantize_column_major(
        self, hp: torch.Tensor, contracted_dim: int, gemm: GemmConfig, *, measure: bool = False
    ) -> Float8Tensor:
        """The role's dynamic cast of a 2D ``hp`` with its bytes column-major, for the
        weight-gradient GEMM (:func:`cast_column_major`)."""
        return cast_column_major(self.stats if measure else None, hp, self.cast_config().operand_spec(contracted_dim), gemm)

    def quantize_for(
        self, gemm_name: str, hp: torch.Tensor, contracted_dim: int, gemm: GemmConfig, *, measure: bool = True
    ) -> Float8Tensor | Float4Tensor:
        """The cast of ``hp`` that the config names for this role in GEMM ``gemm_name``
        (per-GEMM formats, FP8 or FP4: :func:`cast_gemm_operand`); see :meth:`format_for`."""
        cast = self.format_for(gemm_name)
        assert cast is not None  # the caller runs that GEMM in high precision otherwise
        return cast_gemm_operand(hp, cast, contracted_dim, gemm, self.config, self.stats if measure else None)

    def format_for(self, gemm_name: str) -> CastConfig | None:
        """The role's cast in GEMM ``gemm_name`` (``Float8LinearConfig.cast_for``); None: that
        GEMM runs in high precision."""
        return self.config.cast_for(gemm_name, self.role)

    def cached(self, key: str, make: Callable[[], Float8Tensor]) -> Float8Tensor:
        """The weight's cast ``key`` from the layer's WeightCasts while the parameter is
        unchanged, else ``make()`` (then kept there)."""
        assert self.cache is not None  # only a weight inside a reuse_weight_casts scope has one
        casts, param = self.cache
        return casts.get(key, param, self.config, make)

    def push(self, amax: torch.Tensor | None) -> None:
        """Add a delayed cast's amax to the role's history (backward; nothing for None)."""
        if amax is not None:
            assert self.history is not None  # only a delayed cast returns an amax
            push_amax(self.history, amax)

    def keep_scale(self, scale: torch.Tensor) -> None:
        """Keep ``scale`` as the step's scale of a delayed role (a weight gathered in FP8,
        cast by the gather rather than here)."""
        if self.scale is not None:
            self.scale.copy_(scale)


def linear_quantizers(
    config: Float8LinearConfig,
    delayed: DelayedBuffers | None = None,
    stats: StatsBuffers | None = None,
    weight_cache: tuple[Any, torch.Tensor] | None = None,
) -> tuple[Quantizer, Quantizer, Quantizer]:
    """The (input, weight, grad_output) quantizers of a linear with ``config``, holding the
    layer's delayed buffers and telemetry where it has them, and its weight casts cache."""
    hist_in, hist_w, hist_go, scale_in, scale_w = (None,) * 5 if delayed is None else delayed[:5]
    st_in, st_w, st_go = (None,) * 3 if stats is None else stats
    return (
        Quantizer("input", config, hist_in, scale_in, st_in),
        Quantizer("weight", config, hist_w, scale_w, st_w, weight_cache),
        Quantizer("grad_output", config, hist_go, None, st_go),
    )
