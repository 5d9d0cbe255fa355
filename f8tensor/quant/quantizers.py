"""Quantizers: one per operand role of a linear, and the one cast entry point below them.

A :class:`Quantizer` (input, weight or grad_output) is built per call by
:func:`linear_quantizers`; it casts an operand once for the GEMM that reads it, writes the
layouts its consumers read, and owns the role's state (delayed history, telemetry, cached
weight casts). Every cast ends in :func:`quantize`; every column-major copy is
:func:`column_major_copy`'s. Raw-byte roles are in :mod:`f8tensor.quant.block_quantizers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from f8tensor.compat import current_graph_task_id, functional_all_reduce_max
from f8tensor.kernels import cast_for_gemm
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.kernels.layouts import to_column_major
from f8tensor.quant.config import DEFAULT_GEMM, CastConfig, CastSpec, Float8LinearConfig, GemmConfig, is_tensorwise
from f8tensor.quant.scaling import delayed_scale, materialized, tensor_amax
from f8tensor.tensor.float8 import (
    Float8Tensor,
    from_gemm_cast,
    to_float8_with_stats,
    with_inverse_scale,
)
from f8tensor.tensor.fp4 import Float4Tensor, to_float4, to_float4_with_stats

__all__ = [
    "DELAYED_CALLS",
    "DELAYED_PARTS",
    "DelayedState",
    "Quantized",
    "Quantizer",
    "RolePlan",
    "StatsBuffers",
    "cast_column_major",
    "cast_gemm_operand",
    "cast_operand",
    "cast_second_operand",
    "column_major_copy",
    "delayed_views",
    "linear_quantizers",
    "quantize",
    "recomputing",
    "record_call",
    "recorded_scales",
    "role_plan",
    "sync_amax",
]


#: A layer's delayed-scaling state, two fp32 buffers (traced, each buffer read is a guard):
#: ``histories`` (3, history_len), the amax histories of input, weight and grad_output,
#: newest first, written in backward only; ``step`` (2 + 3 * DELAYED_CALLS,), the step's
#: input and weight scales, then the recorded calls, written in forward only (torch 2.13's
#: default partitioner refuses a buffer written in both).
DelayedState = tuple[torch.Tensor, torch.Tensor]
#: The state's parts (:func:`delayed_views`), by attribute and state-dict name.
DELAYED_PARTS = (
    "amax_history_input",
    "amax_history_weight",
    "amax_history_grad_output",
    "scale_input",
    "scale_weight",
    "delayed_calls",
)
#: Recorded calls the state keeps: the last forwards' rows (input amax as the key, input
#: scale, weight scale), so a checkpointed recompute of each uses its own scales.
DELAYED_CALLS = 8


def delayed_views(state: DelayedState) -> tuple[torch.Tensor, ...]:
    """The parts of a layer's delayed state (:data:`DELAYED_PARTS`), as views of its buffers."""
    histories, step = state
    return histories[0], histories[1], histories[2], step[0], step[1], step[2:].view(-1, 3)


class StatsBuffers(NamedTuple):
    """A layer's cast telemetry, one float64 vector per operand role."""

    float8_stats_input: torch.Tensor
    float8_stats_weight: torch.Tensor
    float8_stats_grad_output: torch.Tensor


class RolePlan(NamedTuple):
    """A role's CastConfig and what each of its casts reads of it, derived once.

    ``specs``: the operand :class:`CastSpec` of a 2D operand contracted over dim 0 and dim 1.
    Traced, a plan is a constant whose config methods and properties dynamo cannot call:
    what the calls read of them is a field here.
    """

    cast: CastConfig
    delayed: bool
    tensorwise: bool
    specs: tuple[CastSpec, CastSpec]
    rowwise: bool


def role_plan(cast: CastConfig) -> RolePlan:
    """The :class:`RolePlan` of ``cast``."""
    along_k = cast.operand_spec(1)
    # A 2D operand contracted over dim 0 has the transposed block (one read of cast: one guard traced).
    along_m = CastSpec(along_k.float8_dtype, along_k.block[::-1], *along_k[2:])
    return RolePlan(cast, cast.delayed, cast.tensorwise, (along_m, along_k), cast.rowwise)


def record_call(calls: torch.Tensor, key: torch.Tensor, scale_in: torch.Tensor, scale_w: torch.Tensor) -> None:
    """Push this forward's row (key, input scale, weight scale) as the newest of ``calls``."""
    # cat, not stack: traced, each torch function first used is a guard.
    row = torch.cat([key.reshape(1).to(calls.dtype), scale_in.reshape(1), scale_w.reshape(1)]).reshape(1, 3)
    calls.copy_(torch.cat([row, calls[:-1]]))


def recorded_scales(calls: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight scales of the newest recorded call with ``key`` (else the newest); no sync."""
    index = (calls[:, 0] == key).to(torch.int32).argmax()
    row = calls[index]
    return row[1], row[2]


def sync_amax(amax: torch.Tensor) -> torch.Tensor:
    """An amax agreed across data-parallel ranks (a no-op without torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return amax
    return functional_all_reduce_max(amax, dist.group.WORLD)


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside backward (eager)."""
    if torch.compiler.is_compiling():
        return False
    return current_graph_task_id() != -1


def cast_operand(
    hp: torch.Tensor,
    role: RolePlan,
    contracted_dim: int,
    gemm: GemmConfig,
    config: Float8LinearConfig,
    history: torch.Tensor | None = None,
    scale_buffer: torch.Tensor | None = None,
    recompute: bool = False,
    stats: torch.Tensor | None = None,
    column_major: GemmConfig | None = None,
) -> tuple[Float8Tensor, torch.Tensor | None, Float8Tensor | None]:
    """Cast one 2D GEMM operand per its role (dynamic or delayed), contracted over ``contracted_dim``.

    Returns:
        The FP8 tensor; a delayed cast's amax for ``history`` (else None); with ``column_major``
        the column-major twin (else None). ``recompute`` reuses ``scale_buffer``'s scale.
    """
    spec = role.specs[contracted_dim]
    if not role.delayed:
        if column_major is not None:
            f8, twin = quantize(
                hp, spec, gemm, scale=None, stats=stats, amax=None, layouts="both", column_major_gemm=column_major
            )
            return f8, None, twin
        f8 = quantize(hp, spec, gemm, scale=None, stats=stats, amax=None, layouts="natural", column_major_gemm=None)[0]
        return f8, None, None
    assert history is not None  # a delayed cast comes with its amax history
    # The amax is taken after the cast so inductor fuses it into the cast's pass; a scale
    # decided in advance does not see inf, which would saturate: make it NaN.
    guarded = hp.masked_fill(hp.isinf(), float("nan"))  # not torch.nan: traced, a read is a guard
    if recompute:
        assert scale_buffer is not None  # recomputed casts (input, weight) keep their scale
        scale = scale_buffer.clone()
    else:
        scale = delayed_scale(
            history,
            role.cast.dtype,
            reduction=config.delayed.reduction,
            margin=config.delayed.margin,
            round_pow2=role.cast.power_of_2_scale,
        )
    amax_local = None if stats is None else _amax_by_rows(hp)
    # This rank's own amax, not the all-reduced one.
    fp8 = quantize(
        guarded, spec, gemm, scale=scale, stats=stats, amax=amax_local, layouts="natural", column_major_gemm=None
    )[0]
    fp8 = fp8._replace(data=materialized(fp8._data, None))
    if amax_local is None:
        amax_local = _amax_by_rows(hp)
    if scale_buffer is not None and not recompute:
        scale_buffer.copy_(scale)
    return fp8, sync_amax(amax_local), None if column_major is None else column_major_copy(fp8, column_major)


def _amax_by_rows(hp: torch.Tensor) -> torch.Tensor:
    """``tensor_amax(hp)``, reduced by rows first so inductor fuses it into the cast's pass."""
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
    """The one cast entry point: ``hp`` cast per ``spec`` (FP8 or FP4) for a GEMM ``gemm``.

    Args:
        scale: decided in advance (delayed), else dynamic.
        stats: the role's telemetry buffer, overwritten; ``amax``: what it reports.
        layouts: ``"natural"``, ``"both"`` (plus the column-major copy) or ``"column_major"``.
    Returns:
        The cast and, with ``layouts="both"``, its column-major copy, else None.
    """
    if isinstance(spec, FP4Spec):
        assert scale is None and layouts == "natural"  # FP4 casts are dynamic, packed along the contraction
        if stats is None:
            return to_float4(hp, spec, gemm=gemm), None
        f4, measured = to_float4_with_stats(hp, spec, gemm=gemm)
        stats.copy_(measured)
        return f4, None
    if stats is None:
        out = cast_for_gemm(hp, spec, scale, layouts=layouts, products_only=False)
        f8, twin = from_gemm_cast(out, hp.dtype, spec.block or (0,) * hp.dim(), gemm, column_major_gemm)
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
    return column_major_copy(f8, None), None


def cast_second_operand(
    hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None
) -> Float8Tensor:
    """The weight cast for grad_x's product: column-major on CUDA (and tensorwise on CPU), eager."""
    column_major = not torch.compiler.is_compiling() and (hp.is_cuda or is_tensorwise(spec.block))
    layouts = "column_major" if column_major else "natural"
    return quantize(hp, spec, gemm, scale=scale, stats=None, amax=None, layouts=layouts, column_major_gemm=None)[0]


def cast_column_major(
    stats: torch.Tensor | None, hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None
) -> Float8Tensor:
    """:func:`quantize` of a 2D ``hp`` with its bytes column-major."""
    return quantize(
        hp, spec, gemm, scale=scale, stats=stats, amax=None, layouts="column_major", column_major_gemm=None
    )[0]


def column_major_copy(f8: Float8Tensor, gemm: GemmConfig | None = None) -> Float8Tensor:
    """``f8`` (2D) with its bytes column-major, the weight-gradient GEMM's layout.

    A copy inductor fuses into the cast that made ``f8``; ``gemm``: the copy's (default ``f8``'s).
    """
    data = f8._data  # a fresh cast: row-major (no stride test to trace)
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
    """One operand cast per ``cast`` (FP8 or FP4, dynamic), contracted over ``contracted_dim``."""
    spec = cast.operand_spec(contracted_dim)
    if not cast.fp4:
        return quantize(hp, spec, gemm, stats=stats)[0]
    kind = cast.fp4_kind
    assert kind is not None  # an FP4 cast (cast.fp4) names its kind
    fspec = FP4Spec(
        kind,
        spec.block,
        contracted_dim % hp.dim(),
        spec.scale_mode,
        spec.rounding,
        config.four_over_six and kind == "nvfp4",
    )
    return quantize(hp, fspec, gemm, stats=stats)[0]


#: A role's cast, its column-major copy (or None), and a delayed cast's amax (or None). A
#: plain tuple: traced, building a NamedTuple costs guards.
Quantized = tuple[Float8Tensor, "Float8Tensor | None", "torch.Tensor | None"]


class Quantizer(NamedTuple):
    """One operand role of a linear: its cast, the layouts its consumers read, and its state.

    A NamedTuple (traced as a tuple); ``plan`` is the role's :class:`RolePlan`; ``history``,
    ``scale``, ``stats`` and ``cache`` are None where the role has none.
    """

    role: str
    config: Float8LinearConfig
    plan: RolePlan
    history: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    cache: tuple[Any, torch.Tensor] | None = None

    def cast_config(self) -> CastConfig:
        """The role's CastConfig."""
        return self.plan.cast

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
        """The role's cast for a GEMM over ``contracted_dim``; ``column_major``: also the twin, for that GEMM."""
        plan, stats = self.plan, self.stats if measure else None
        if plan.delayed or stats is not None:
            f8, amax, twin = cast_operand(
                hp, plan, contracted_dim, gemm, self.config, self.history, self.scale, recompute, stats, column_major
            )
            return f8, twin, amax
        # Dynamic, unmeasured: straight to the kernels' cast (what quantize() does, without its branches).
        spec = plan.specs[contracted_dim]
        out = cast_for_gemm(hp, spec, None, layouts="natural" if column_major is None else "both", products_only=True)
        f8, twin = from_gemm_cast(out, hp.dtype, spec.block or (0,) * hp.dim(), gemm, column_major)
        if column_major is not None and twin is None:
            twin = column_major_copy(f8, column_major)
        return f8, twin, None

    def quantize_column_major(
        self, hp: torch.Tensor, contracted_dim: int, gemm: GemmConfig, *, measure: bool = False
    ) -> Float8Tensor:
        """The role's dynamic cast of 2D ``hp``, bytes column-major."""
        stats, spec = self.stats if measure else None, self.plan.specs[contracted_dim]
        # quantize() itself, not cast_column_major(): one call and, traced, one guard fewer.
        return quantize(
            hp, spec, gemm, scale=None, stats=stats, amax=None, layouts="column_major", column_major_gemm=None
        )[0]

    def quantize_for(
        self, gemm_name: str, hp: torch.Tensor, contracted_dim: int, gemm: GemmConfig, *, measure: bool = True
    ) -> Float8Tensor | Float4Tensor:
        """The cast the config names for this role in GEMM ``gemm_name``."""
        cast = self.format_for(gemm_name)
        assert cast is not None  # the caller runs that GEMM in high precision otherwise
        return cast_gemm_operand(hp, cast, contracted_dim, gemm, self.config, self.stats if measure else None)

    def format_for(self, gemm_name: str) -> CastConfig | None:
        """The role's cast in GEMM ``gemm_name``; None: high precision."""
        return self.config.cast_for(gemm_name, self.role)

    def cached(self, key: str, make: Callable[[], Float8Tensor]) -> Float8Tensor:
        """The weight's cast ``key`` while the parameter is unchanged, else ``make()``."""
        assert self.cache is not None  # only a weight inside a reuse_weight_casts scope has one
        casts, param = self.cache
        return casts.get(key, param, self.config, make)

    def keep_scale(self, scale: torch.Tensor) -> None:
        """Keep ``scale`` as a delayed role's step scale."""
        if self.scale is not None:
            self.scale.copy_(scale)


def linear_quantizers(
    config: Float8LinearConfig,
    delayed: tuple[torch.Tensor, ...] | None = None,
    stats: StatsBuffers | None = None,
    weight_cache: tuple[Any, torch.Tensor] | None = None,
    roles: tuple[RolePlan, RolePlan, RolePlan] | None = None,
) -> tuple[Quantizer, Quantizer, Quantizer]:
    """The (input, weight, grad_output) quantizers of a linear with ``config``.

    ``delayed``: the parts of the layer's delayed state (:func:`delayed_views`); ``roles``:
    the three :class:`RolePlan` of ``config`` when the caller planned them already.
    """
    p_in, p_w, p_go = roles or (role_plan(config.input), role_plan(config.weight), role_plan(config.grad_output))
    hist_in, hist_w, hist_go, scale_in, scale_w = (None,) * 5 if delayed is None else delayed[:5]
    st_in, st_w, st_go = (None,) * 3 if stats is None else stats
    return (
        Quantizer("input", config, p_in, hist_in, scale_in, st_in, None),
        Quantizer("weight", config, p_w, hist_w, scale_w, st_w, weight_cache),
        Quantizer("grad_output", config, p_go, hist_go, None, st_go, None),
    )
