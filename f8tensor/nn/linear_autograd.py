"""The linear's autograd Function: ``x @ W.t() + b`` with quantized GEMMs, for every recipe.

:class:`QuantizedLinearFn` serves ``Float8Linear``, the FP8 experts and the attention
projections: per-role recipes (each operand cast per its CastConfig) and per-GEMM formats or
FP4 (per :meth:`Float8LinearConfig.cast_for`). Casts and role state are
:mod:`f8tensor.quant.quantizers`'; DTensors are unwrapped above, in :mod:`f8tensor.distributed.dtensor`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from f8tensor.gemm import matmul
from f8tensor.kernels import GemmCast
from f8tensor.quant.config import CastSpec, Float8LinearConfig, GemmConfig
from f8tensor.quant.hadamard import RHT_SIZE, apply_rht
from f8tensor.quant.quantizers import (
    DelayedState,
    RolePlan,
    StatsBuffers,
    cast_second_operand,
    column_major_copy,
    delayed_views,
    linear_quantizers,
    quantize,
    recomputing,
    record_call,
    recorded_scales,
    role_plan,
    sync_amax,
)
from f8tensor.quant.scaling import push_amaxes, tensor_amax
from f8tensor.tensor.float8 import Float8Tensor, dequantize, from_gemm_cast
from f8tensor.tensor.fp4 import Float4Tensor, is_float4
from f8tensor.tensor.fp4 import transpose_2d as transpose_2d_fp4
from f8tensor.tensor.product_ops import transpose_2d

__all__ = ["LinearArgs", "LinearPlan", "NoDoubleBackward", "QuantizedLinearFn", "linear_plan", "plan_number", "planned"]


class LinearPlan(NamedTuple):
    """What every call of a linear with ``config`` needs from it, derived once per config.

    Immutable values only (a constant to dynamo). Fields: ``roles``, the (input, weight,
    grad_output) :class:`~f8tensor.quant.quantizers.RolePlan`; ``fwd``, ``bwd`` and ``bwd_w``,
    the GEMM configs of the output, grad_input and grad_weight products; ``weight_rescale``, the
    spec of a tensorwise weight re-cast with forward's scale; ``precast_weight``, the weight
    cast once per step into the layer's buffers (:func:`~f8tensor.per_step_weight_casts`);
    the rest, flags of ``config`` the calls branch on.
    """

    config: Float8LinearConfig
    roles: tuple[RolePlan, RolePlan, RolePlan]
    uses_gemm_formats: bool
    any_delayed: bool
    collect_stats: bool
    gathers_delayed_weight: bool
    caches_weight: bool
    records_calls: bool
    keep_fp8_input: bool
    gw_uses_g8: bool
    fwd: GemmConfig
    bwd: GemmConfig
    bwd_w: GemmConfig
    weight_rescale: CastSpec
    precast_weight: bool = False


def linear_plan(config: Float8LinearConfig, precast_weight: bool = False) -> LinearPlan:
    """The :class:`LinearPlan` of ``config``; ``precast_weight``: the weight cast once per step."""
    # Each config attribute read once: traced, every read is a guard.
    roles = p_in, p_w, p_go = role_plan(config.input), role_plan(config.weight), role_plan(config.grad_output)
    any_delayed = p_in.delayed or p_w.delayed or p_go.delayed
    fp8_grad_w = not config.weight_grad_in_hp
    pad, emulate = config.pad_inner_dim, config.emulate
    return LinearPlan(
        config=config,
        roles=roles,
        uses_gemm_formats=config.uses_gemm_formats,
        any_delayed=any_delayed,
        collect_stats=config.collect_stats,
        gathers_delayed_weight=any_delayed and config.enable_fsdp_float8_all_gather,
        caches_weight=not p_w.delayed and p_w.specs[1].rounding == "nearest",
        records_calls=p_in.delayed or p_w.delayed,
        keep_fp8_input=p_in.tensorwise and fp8_grad_w,
        gw_uses_g8=p_go.tensorwise and fp8_grad_w,
        fwd=GemmConfig(use_fast_accum=config.use_fast_accum, pad_inner_dim=pad, emulate=emulate),
        bwd=GemmConfig(pad_inner_dim=pad, emulate=emulate),
        # M varies with the batch: always pad, never fail on an odd batch.
        bwd_w=GemmConfig(pad_inner_dim=True, emulate=emulate),
        # A tensorwise weight re-cast in backward with forward's scale.
        weight_rescale=CastSpec(p_w.cast.dtype),
        precast_weight=precast_weight,
    )


# Plans by number, one per distinct config: a layer keeps only the number, so traced code
# reads one str (one guard; an int attribute is two) and gets the plan as a constant.
_PLANS: dict[str, LinearPlan] = {}
_PLAN_NUMBERS: dict[tuple[Float8LinearConfig, bool], str] = {}


def plan_number(config: Float8LinearConfig, precast_weight: bool = False) -> str:
    """The number of ``config``'s :class:`LinearPlan` (:func:`planned`), planned on first sight."""
    key = (config, precast_weight)
    number = _PLAN_NUMBERS.get(key)
    if number is None:
        number = f"plan{len(_PLANS)}"
        _PLANS[number] = linear_plan(config, precast_weight)
        number = _PLAN_NUMBERS.setdefault(key, number)
    return number


@torch.compiler.assume_constant_result
def planned(number: str) -> LinearPlan:
    """The :class:`LinearPlan` numbered ``number``; to torch.compile a constant, its fields unguarded."""
    return _PLANS[number]


class LinearArgs(NamedTuple):
    """Everything but the tensors that :class:`QuantizedLinearFn` takes.

    Fields: ``config``; ``delayed`` and ``stats``, the layer's buffers or None; ``weight_amax``,
    the shard amax of a delayed weight FSDP2 gathered in FP8; ``weight_casts``, a
    ``reuse_weight_casts`` cache (on ctx, not saved: later steps update it on purpose);
    ``plan``, ``config``'s :class:`LinearPlan` where the caller keeps one (else built per call);
    ``precast``, the (data, scale) buffers of a weight cast once per step, or None.
    """

    config: Float8LinearConfig
    delayed: DelayedState | None = None
    stats: StatsBuffers | None = None
    weight_amax: torch.Tensor | None = None
    weight_casts: tuple[Any, torch.Tensor] | None = None
    plan: LinearPlan | None = None
    precast: tuple[torch.Tensor, torch.Tensor] | None = None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., features) as a (tokens, features) matrix, ``t`` itself when already 2D."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _token_rows(x: Float8Tensor, gemm: GemmConfig) -> Float8Tensor:
    """An FP8 input (..., K) as the (tokens, K) operand; its scales must be per tensor or token."""
    k = x.shape[-1]
    if x._scale.dim() == 0:
        return x._replace(data=x._data.reshape(-1, k), block=(0, 0), gemm=gemm)
    if any(b != 1 for b in x._block[:-1]):
        raise ValueError(f"an FP8 input must be scaled per tensor or per token; got blocks {x._block}")
    scale = x._scale.reshape(-1, x._scale.shape[-1])
    return x._replace(data=x._data.reshape(-1, k), scale=scale, block=(1, x._block[-1]), gemm=gemm)


class QuantizedLinearFn(torch.autograd.Function):
    """``x @ W.t() + b`` with quantized GEMMs in forward and both backward GEMMs.

    Call as ``QuantizedLinearFn.apply(x, weight, bias, LinearArgs(config, ...))``; returns ``y``
    of shape ``(*x.shape[:-1], out_features)``. A second derivative is refused
    (:class:`NoDoubleBackward`).

    Invariants: backward reads the FP8 input (cast along the tokens in forward), never an FP8
    copy of the weight (re-cast with the forward's scale: the same bytes). Delayed amaxes are
    pushed in backward only, so every forward of a step, and a checkpointed re-run, casts with
    the same scale. Telemetry records each role's first cast; re-casts along the other axis are
    not recorded. Per-GEMM formats save the high-precision input and re-cast it per GEMM.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, args: LinearArgs):  # type: ignore[override]
        plan = linear_plan(args.config) if args.plan is None else args.plan
        ctx.config = plan.config
        ctx.plan = plan
        ctx.x_shape = x.shape
        ctx.layer = f"Float8Linear(in_features={weight.shape[1]}, out_features={weight.shape[0]})"
        if plan.uses_gemm_formats:
            y = _formats_forward(ctx, x, weight, bias, plan.config, args.stats)
        else:
            y = _recipe_forward(ctx, x, weight, bias, plan, args)
        # Not a view, like nn.Linear's output: FSDP2 warns on a view output.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        saved = ctx.saved_tensors  # once: checkpointing allows one unpack
        grads_of = _formats_backward if ctx.plan.uses_gemm_formats else _recipe_backward
        if not torch.is_grad_enabled():
            return (*grads_of(ctx, grad_y, saved), None)
        # create_graph=True: FP8 GEMMs have no derivative; a node refuses it by name.
        with torch.no_grad():
            grads = list(grads_of(ctx, grad_y, saved))
        saved_x, weight = saved[:2]
        present = [i for i, g in enumerate(grads) if g is not None]
        outs = NoDoubleBackward.apply(ctx.layer, grad_y, weight, saved_x, *(grads[i] for i in present))
        for i, g in zip(present, outs):
            grads[i] = g
        return (*grads, None)


def _recipe_forward(ctx, x, weight, bias, plan: LinearPlan, args: LinearArgs) -> torch.Tensor:
    """The forward of a per-role recipe: the 2D product."""
    config = plan.config
    d, weight_amax = args.delayed, args.weight_amax
    parts = None if d is None else delayed_views(d)
    q_in, q_w, q_go = linear_quantizers(config, parts, args.stats, args.weight_casts, plan.roles)
    scale_in, scale_w = q_in.scale, q_w.scale
    recompute = plan.any_delayed and recomputing()
    fwd = plan.fwd
    calls = parts[5] if parts is not None and plan.records_calls else None
    keep_fp8_input = plan.keep_fp8_input
    if isinstance(x, Float8Tensor):  # an input gathered in FP8 (distributed.tp): cast already
        x8, amax_x = _token_rows(x, fwd), None
        x2 = dequantize(x8) if calls is not None or not keep_fp8_input else None
    else:
        x2 = _rows(x)
    if calls is not None and recompute:
        assert x2 is not None  # delayed buffers: an FP8 input was dequantized above
        scale_in, scale_w = recorded_scales(calls, sync_amax(tensor_amax(x2)))
        q_in, q_w = q_in._replace(scale=scale_in), q_w._replace(scale=scale_w)
    x8_cm = None
    if not isinstance(x, Float8Tensor):
        assert x2 is not None  # a high-precision input: reshaped above
        x8, x8_cm, amax_x = q_in.quantize(
            x2, 1, fwd, column_major=plan.bwd_w if keep_fp8_input else None, recompute=recompute
        )
    if isinstance(weight, Float8Tensor):  # FSDP2 float8 all-gather hands over an FP8 weight
        w8, amax_w = weight._replace(gemm=fwd), None
        if q_w.plan.delayed:
            # Cast by the gather: record its scale and amax as a cast here would.
            if weight_amax is None:
                raise RuntimeError(
                    "a delayed-scaled weight gathered in FP8 arrived without its amax; call the layer "
                    "(Float8Linear), which hands it over, in LinearArgs.weight_amax"
                )
            amax_w = sync_amax(weight_amax)
            if not recompute:
                q_w.keep_scale(weight._scale)
    elif args.precast is not None:  # cast once per step, as the call would (tensorwise)
        w8, amax_w = _precast(*args.precast, weight.dtype, fwd), None
        if q_w.plan.delayed:
            amax_w = args.precast[1][2]
            if not recompute:
                q_w.keep_scale(w8._scale)
    elif q_w.cache is not None:
        w8, amax_w = q_w.cached("forward", lambda: q_w.quantize(weight, 1, fwd)[0]), None
    else:
        w8, _, amax_w = q_w.quantize(weight, 1, fwd, recompute=recompute)
    if calls is not None and not recompute:
        key = amax_x if amax_x is not None else sync_amax(tensor_amax(x2))  # type: ignore[arg-type]
        record_call(calls, key, scale_in, scale_w)  # type: ignore[arg-type]  # calls: delayed buffers exist
    y = matmul(x8, transpose_2d(w8), bias=bias, out_dtype=None)  # built, not dispatched: torch.export traces it

    # Saved for grad_W: a tensorwise x8 as is; other granularities cast along the tokens
    # here, in eager (compiled: the partitioner decides); hp only where no FP8 grad_W runs.
    saved_x = x2
    if keep_fp8_input:
        saved_x = column_major_copy(x8, plan.bwd_w) if x8_cm is None else x8_cm  # read by grad_W only
    elif (
        not config.weight_grad_in_hp
        and not torch.compiler.is_compiling()
        and ctx.needs_input_grad[1]
        and _records_backward(ctx)
    ):
        assert x2 is not None  # a non-tensorwise input: reshaped or dequantized above
        saved_x = q_in.quantize_column_major(x2, 0, plan.bwd_w)
    # Only a tensorwise weight is re-cast with this scale in backward.
    reuse_w_scale = not isinstance(weight, Float8Tensor) and q_w.plan.tensorwise
    precast = (None, None) if args.precast is None else args.precast
    ctx.save_for_backward(saved_x, weight, w8._scale if reuse_w_scale else None, amax_x, amax_w, *precast)
    ctx.quantizers = (q_in, q_w, q_go)
    ctx.histories = None if d is None else d[0]  # backward pushes the amaxes in one write
    return y


def _precast(data: torch.Tensor, scales: torch.Tensor, orig_dtype: torch.dtype, gemm: GemmConfig) -> Float8Tensor:
    """The Float8Tensor of a weight cast once per step (tensorwise): ``scales[:2]`` is (scale, 1 / scale)."""
    # Every argument given: traced, a default read is a guard.
    f8 = from_gemm_cast(GemmCast(data, None, scales[0], None, None), orig_dtype, (0, 0), gemm, None)[0]
    f8._inv_scale = scales[1]  # set here, not through GemmCast.inverse: that means "eager"
    return f8


def _recipe_backward(ctx, grad_y, saved) -> tuple[torch.Tensor | None, ...]:
    """The gradients of x, weight and bias for a per-role recipe."""
    saved_x, weight, w_scale, amax_x, amax_w, precast_data, precast_scales = saved
    q_in, q_w, q_go = ctx.quantizers
    need_grad_x, need_grad_w, need_grad_b = ctx.needs_input_grad[:3]
    plan: LinearPlan = ctx.plan
    config = plan.config
    bwd, bwd_w = plan.bwd, plan.bwd_w
    g = _rows(grad_y)
    if torch.compiler.is_compiling():
        # Written once (as bf16's GEMMs have it), not recomputed by each cast; materialized,
        # inlined (a call is guards).
        g = g.contiguous().as_strided(g.shape, (g.shape[1], 1))
    go_plan, w_plan = q_go.plan, q_w.plan

    # A delayed cast measures every backward's grad_output, needed or not.
    g8 = None
    gw_uses_g8 = plan.gw_uses_g8
    # FP8-gathered rowwise W = W8 / s: g @ W = (g / s) @ W8 keeps the gathered bytes (CHANGELOG).
    fold = need_grad_x and isinstance(weight, Float8Tensor) and _row_scaled(weight) and go_plan.rowwise
    g8_cm = amax_g = None
    if need_grad_x or (need_grad_w and gw_uses_g8) or go_plan.delayed:
        g_x = g.float() / weight._scale.reshape(1, -1) if fold else g
        g8, g8_cm, amax_g = q_go.quantize(g_x, 1, bwd, column_major=bwd_w if need_grad_w and gw_uses_g8 else None)
        if fold:
            g8 = g8._replace(orig_dtype=g.dtype)  # grad_x comes out in grad_output's dtype

    # grad_x = g @ W: over N, so W's scale must be constant along dim 0.
    grad_x = None
    if need_grad_x:
        if fold:  # the row scales are in g8 already: W8 with a unit scale
            unit = torch.ones((), dtype=torch.float32, device=weight._scale.device)
            w8 = weight._replace(scale=unit, block=(0, 0), gemm=bwd)
        elif isinstance(weight, Float8Tensor) and _blocked_along_k(weight, spec0 := w_plan.specs[0]):
            # Blocks along K (MX 1x32) no kernel reads along N: re-cast, via fp32 deliberately.
            w8 = cast_second_operand(dequantize(weight, torch.float32), spec0, bwd, None)
            w8 = w8._replace(orig_dtype=weight._orig_dtype)
        elif isinstance(weight, Float8Tensor):
            w8 = weight._replace(gemm=bwd)
        elif precast_data is not None:  # forward's bytes and scale, cast once per step
            w8 = _precast(precast_data, precast_scales, weight.dtype, bwd)
        elif q_w.cache is not None:
            # Tensorwise: forward's cached bytes serve as they are (the same scale).
            if w_plan.tensorwise:
                w8 = q_w.cached("forward", lambda: quantize(weight, plan.weight_rescale, scale=w_scale)[0])
            else:
                w8 = q_w.cached("backward", lambda: cast_second_operand(weight, w_plan.specs[0], bwd, None))
            w8 = w8._replace(gemm=bwd)
        elif not w_plan.tensorwise:
            w8 = cast_second_operand(weight, w_plan.specs[0], bwd, None)
        else:
            # Forward's scale: the same bytes. A delayed scale never saw an inf: make it NaN.
            hp_w = weight.masked_fill(weight.isinf(), float("nan")) if w_plan.delayed else weight
            w8 = cast_second_operand(hp_w, plan.weight_rescale, bwd, scale=w_scale)
        grad_x = matmul(g8, w8, bias=None, out_dtype=None)  # type: ignore[arg-type]  # need_grad_x: g8 was cast
        if grad_x.shape != ctx.x_shape:  # not a view of another shape
            grad_x = grad_x.reshape(ctx.x_shape)

    # grad_W = g.t() @ x: contraction over M.
    grad_w = None
    if need_grad_w:
        if config.weight_grad_in_hp:
            grad_w = g.t().to(saved_x.dtype) @ saved_x
        else:
            if gw_uses_g8:
                assert g8_cm is not None  # need_grad_w and gw_uses_g8: copied with bwd_w above
                gt8 = g8_cm
            else:
                gt8 = q_go.quantize_column_major(g, 0, bwd_w, measure=g8 is None)
            if isinstance(saved_x, Float8Tensor):
                x8 = saved_x if saved_x._gemm is bwd_w else saved_x._replace(gemm=bwd_w)
            else:
                x8 = q_in.quantize_column_major(saved_x, 0, bwd_w)
            # In the weight's dtype, deliberately: a bf16 output adds a rounding and a pass.
            grad_w = matmul(transpose_2d(gt8), x8, bias=None, out_dtype=weight.dtype)
        grad_w = grad_w.to(weight.dtype)
    grad_b = g.sum(0) if need_grad_b else None
    if plan.any_delayed:  # only delayed casts return an amax
        # Last, all three in one write: a recomputed amax then shares the weight re-cast's pass.
        push_amaxes(ctx.histories, (amax_x, amax_w, amax_g))
    return grad_x, grad_w, grad_b


def _records_backward(ctx) -> bool:
    """Whether this call records a backward node (``forward`` runs with grad mode off)."""
    return len(ctx.next_functions) > 0


def _blocked_along_k(w8: Float8Tensor, spec: CastSpec) -> bool:
    """``w8`` (N, K) has blocks grad_x's product (over N, per ``spec``) cannot read."""
    return w8.is_blockwise and not w8._block == spec.block  # noqa: SIM201 (2.11's dynamo fails on !=)


def _row_scaled(w8: Float8Tensor) -> bool:
    """``w8`` (N, K) has one scale per row."""
    return w8.dim() == 2 and w8._block == (1, 0)


def _t(q: Float4Tensor | Float8Tensor) -> torch.Tensor:
    return transpose_2d_fp4(q) if is_float4(q) else transpose_2d(q)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows up to a multiple of ``multiple`` (they add nothing to grad_W)."""
    extra = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


def _formats_forward(ctx, x, weight, bias, config: Float8LinearConfig, stats: StatsBuffers | None) -> torch.Tensor:
    """The forward of a config with per-GEMM formats or FP4."""
    plan: LinearPlan = ctx.plan
    q_in, q_w, q_go = linear_quantizers(config, None, stats, roles=plan.roles)
    fwd = plan.fwd
    x2 = _rows(x)
    if q_in.format_for("forward") is None or q_w.format_for("forward") is None:
        y = torch.nn.functional.linear(x2, weight.to(x2.dtype), bias)
    else:
        y = matmul(q_in.quantize_for("forward", x2, 1, fwd), _t(q_w.quantize_for("forward", weight, 1, fwd)), bias=bias)
    ctx.save_for_backward(x2, weight)
    ctx.quantizers = (q_in, q_w, q_go)
    return y


def _formats_backward(ctx, grad_y, saved) -> tuple[torch.Tensor | None, ...]:
    """The gradients of x, weight and bias for per-GEMM formats or FP4."""
    x2, weight = saved
    plan: LinearPlan = ctx.plan
    config = plan.config
    need_grad_x, need_grad_w, need_grad_b = ctx.needs_input_grad[:3]
    bwd, bwd_w = plan.bwd, plan.bwd_w
    g = grad_y.reshape(-1, grad_y.shape[-1])
    q_in, q_w, q_go = ctx.quantizers
    measure_go = True  # grad_output's telemetry records its first cast of each backward

    grad_x = None
    if need_grad_x:
        if q_go.format_for("grad_input") is None or q_w.format_for("grad_input") is None:
            grad_x = g @ weight.to(g.dtype)
        else:
            g_q = q_go.quantize_for("grad_input", g, 1, bwd)
            measure_go = False
            grad_x = matmul(g_q, q_w.quantize_for("grad_input", weight, 0, bwd, measure=False))
        grad_x = grad_x.reshape(ctx.x_shape)

    grad_w = None
    if need_grad_w:
        cg, cx = q_go.format_for("grad_weight"), q_in.format_for("grad_weight")
        if cg is None or cx is None:
            grad_w = g.t().to(x2.dtype) @ x2
        else:
            gg, xx = g, x2
            if cg.fp4 or cx.fp4:
                # FP4 and RHT blocks run along the tokens: pad to whole blocks.
                gg, xx = _pad_rows(gg, 2 * RHT_SIZE), _pad_rows(xx, 2 * RHT_SIZE)
                if config.hadamard_wgrad:
                    gg, xx = apply_rht(gg, config.hadamard_seed), apply_rht(xx, config.hadamard_seed)
            g_q = q_go.quantize_for("grad_weight", gg, 0, bwd_w, measure=measure_go)
            x_q = q_in.quantize_for("grad_weight", xx, 0, bwd_w, measure=False)
            grad_w = matmul(_t(g_q), x_q, out_dtype=weight.dtype)
        grad_w = grad_w.to(weight.dtype)
    grad_b = g.sum(0) if need_grad_b else None
    return grad_x, grad_w, grad_b


class NoDoubleBackward(torch.autograd.Function):
    """Identity on first-order gradients whose own backward explains why there is none."""

    @staticmethod
    def forward(ctx, layer, grad_y, weight, x, *grads):  # type: ignore[override]
        ctx.layer = layer
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx, *unused):  # type: ignore[override]
        raise RuntimeError(
            f"{ctx.layer}: double backward (a gradient of a gradient, e.g. a gradient penalty or "
            f"torch.autograd.grad(..., create_graph=True) followed by another backward) is not "
            f"supported through FP8 GEMMs, which have no second derivative. Keep this layer in high "
            f"precision (convert_to_float8_training(..., module_filter_fn=...) leaving it out)."
        )
