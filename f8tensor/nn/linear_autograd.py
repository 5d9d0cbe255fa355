"""The linear's autograd Function: ``x @ W.t() + b`` with quantized GEMMs, for every recipe.

:class:`QuantizedLinearFn` is the one Function for ``Float8Linear``, the FP8 experts and the
attention projections, whatever the config: per-tensor, rowwise, block-scaled, MX and
delayed recipes (each operand cast per its role's :class:`~f8tensor.quant.config.CastConfig`),
and configs that name a format per GEMM or use FP4 (each operand of each GEMM cast per
:meth:`Float8LinearConfig.cast_for`). It takes the tensors ``x``, ``weight``, ``bias`` and
one :class:`LinearArgs`, which holds everything else a call needs. DTensors are handled
above, by :mod:`f8tensor.distributed.dtensor`, which runs this Function on local shards.

The casts, the column-major layout the weight-gradient GEMM reads and the per-role state
(delayed histories, telemetry buffers) are :mod:`f8tensor.quant.quantizers`'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from f8tensor.gemm import matmul
from f8tensor.quant.config import CastSpec, Float8LinearConfig, GemmConfig
from f8tensor.quant.hadamard import RHT_SIZE, apply_rht
from f8tensor.quant.quantizers import (
    DelayedBuffers,
    StatsBuffers,
    cast_second_operand,
    column_major_copy,
    linear_quantizers,
    quantize,
    recomputing,
    record_call,
    recorded_scales,
    sync_amax,
)
from f8tensor.quant.scaling import tensor_amax
from f8tensor.tensor.float8 import Float8Tensor, dequantize
from f8tensor.tensor.fp4 import Float4Tensor, is_float4
from f8tensor.tensor.fp4 import transpose_2d as transpose_2d_fp4
from f8tensor.tensor.product_ops import transpose_2d

__all__ = ["LinearArgs", "NoDoubleBackward", "QuantizedLinearFn"]


class LinearArgs(NamedTuple):
    """Everything but the tensors that :class:`QuantizedLinearFn` takes (a NamedTuple:
    torch.compile traces through it as it does through a tuple).

    ``config``: the recipe. ``delayed``: the layer's :class:`DelayedBuffers` (delayed
    recipes), else None. ``stats``: its :class:`StatsBuffers` (telemetry on), else None.
    ``weight_amax``: for a delayed weight that FSDP2 gathered in FP8, the amax of this
    rank's shard, measured before the gather (distributed/fsdp.py), else None.
    ``weight_casts``: inside a ``reuse_weight_casts`` scope (weight_cache.py), (the layer's
    WeightCasts, the parameter they are keyed on): the weight's casts are served from there
    while the parameter is unchanged (dynamic, round-to-nearest weights only); else None.
    They ride on ctx, not save_for_backward: later steps update them in place, which is
    their purpose, not a hazard for this step's gradients.

    The FP8 (per-role) recipes use every field; configs with per-GEMM formats or FP4 use
    ``config`` and ``stats`` (their casts are dynamic)."""

    config: Float8LinearConfig
    delayed: DelayedBuffers | None = None
    stats: StatsBuffers | None = None
    weight_amax: torch.Tensor | None = None
    weight_casts: tuple[Any, torch.Tensor] | None = None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., features) as the (tokens, features) matrix: ``t`` itself when it is one
    already (a reshape to the same shape is still a view op, which eager mode pays for)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _unrows(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The (tokens, features) product ``t`` in the caller's ``shape`` (``t`` itself if it has it)."""
    return t if t.shape == shape else t.reshape(shape)


def _token_rows(x: Float8Tensor, gemm: GemmConfig) -> Float8Tensor:
    """An FP8 input of shape (..., K) as the (tokens, K) operand: its scales are per tensor
    or per token (rowwise, 1xB blocks), so the leading dims flatten with them."""
    k = x.shape[-1]
    if x._scale.dim() == 0:
        return x._replace(data=x._data.reshape(-1, k), block=(0, 0), gemm=gemm)
    if any(b != 1 for b in x._block[:-1]):
        raise ValueError(f"an FP8 input must be scaled per tensor or per token; got blocks {x._block}")
    scale = x._scale.reshape(-1, x._scale.shape[-1])
    return x._replace(data=x._data.reshape(-1, k), scale=scale, block=(1, x._block[-1]), gemm=gemm)


class QuantizedLinearFn(torch.autograd.Function):
    """``x @ W.t() + b`` with quantized GEMMs in forward and both backward GEMMs:
    ``QuantizedLinearFn.apply(x, weight, bias, LinearArgs(config, ...))``.

    Returns ``y`` of shape ``(*x.shape[:-1], out_features)``; the gradients of ``x``,
    ``weight`` and ``bias`` as autograd asks for them (none for ``args``). A second
    derivative is refused with a message naming the layer (:class:`NoDoubleBackward`).

    Per-role recipes (``not config.uses_gemm_formats``):

    Saved for backward: the FP8 input the weight-gradient GEMM reads (1 byte/element and
    its scales): the forward's cast itself for a tensorwise input, else (rowwise,
    block-scaled, MX) the input cast along the tokens in forward; the high-precision input
    only for a high-precision weight gradient (``rowwise_with_gw_hp``) or a weight without
    gradient. The weight itself (a parameter, no extra memory) and, for a tensorwise
    weight, its 0-dim scale, so backward re-casts it to the very same bytes instead of
    keeping an FP8 copy of every weight alive. Delayed scaling also keeps the input's and
    weight's 0-dim amax. (This is what eager mode keeps; under torch.compile the
    partitioner decides.) The FP8 input is saved column-major, the layout the
    weight-gradient GEMM takes (see column_major_copy). A stochastically rounded input
    draws its weight-gradient cast's random bits in forward rather than in backward.

    Delayed scaling pushes each amax into its history in backward, once per backward of
    this node, never in forward. So every forward of one step (gradient accumulation:
    several forwards, then their backwards) casts with the same scale, which is also
    kept in a buffer; a forward that activation checkpointing re-runs in backward casts
    with that stored scale and reproduces the original bytes. A forward without a
    backward (evaluation) leaves the histories alone.

    Telemetry (``stats``: ``None``, or the layer's three statistics buffers) records the
    three primary casts: input and weight in forward, grad_output in backward. The
    re-casts along the other axis that rowwise recipes make for the weight-gradient GEMM
    (and the backward re-cast of a rowwise weight) are not recorded.

    Per-GEMM formats and FP4 (``config.uses_gemm_formats``): ``cast_for(gemm, role)`` of
    the config decides every cast: an FP8 CastConfig (any granularity), NVFP4, MXFP4, or
    ``None`` (that GEMM in high precision). Saved for backward: the high-precision input
    and the weight (a parameter, no copy): the backward GEMMs re-cast them along their own
    contraction dims (for FP4 with the Hadamard transform along the tokens first; for
    16x16 weight blocks to the same codes as in forward). Telemetry records the first cast
    of each role.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, args: LinearArgs):  # type: ignore[override]
        config = args.config
        ctx.config = config
        ctx.x_shape = x.shape
        ctx.layer = f"Float8Linear(in_features={weight.shape[1]}, out_features={weight.shape[0]})"
        if config.uses_gemm_formats:
            y = _formats_forward(ctx, x, weight, bias, config, args.stats)
        else:
            y = _recipe_forward(ctx, x, weight, bias, args)
        # A fresh tensor, not a view of the 2D product (reshape returns a view even when
        # the shape is unchanged), like nn.Linear's output: FSDP2 warns on every forward
        # whose output is a view, as an in-place op on it would bypass the backward hook.
        # _scaled_mm's result is contiguous, so _unsafe_view only relabels its shape.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        saved = ctx.saved_tensors  # unpacked once (a checkpointed forward allows no second unpack)
        grads_of = _formats_backward if ctx.config.uses_gemm_formats else _recipe_backward
        if not torch.is_grad_enabled():
            return (*grads_of(ctx, grad_y, saved), None)
        # create_graph=True: FP8 GEMMs have no derivative (torch._scaled_mm has none), so
        # compute the gradients without a graph and attach a node that refuses a second
        # backward with a message naming the layer, instead of failing deep in autograd.
        with torch.no_grad():
            grads = list(grads_of(ctx, grad_y, saved))
        saved_x, weight = saved[:2]
        present = [i for i, g in enumerate(grads) if g is not None]
        outs = NoDoubleBackward.apply(ctx.layer, grad_y, weight, saved_x, *(grads[i] for i in present))
        for i, g in zip(present, outs):
            grads[i] = g
        return (*grads, None)


# ===================================================================== per-role recipes


def _recipe_forward(ctx, x, weight, bias, args: LinearArgs) -> torch.Tensor:
    """The forward of a per-role recipe (see :class:`QuantizedLinearFn`): the 2D product."""
    config, d, stats, weight_amax, weight_casts = args
    q_in, q_w, q_go = linear_quantizers(config, d, stats, weight_casts)
    scale_in, scale_w = q_in.scale, q_w.scale
    recompute = config.any_delayed and recomputing()
    fwd = GemmConfig(use_fast_accum=config.use_fast_accum, pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
    calls = (d.delayed_call_keys, d.delayed_call_scales) if d and (config.input.delayed or config.weight.delayed) else None
    keep_fp8_input = config.input.tensorwise and not config.weight_grad_in_hp
    if isinstance(x, Float8Tensor):  # an input gathered in FP8 (distributed.tp): cast already
        x8, amax_x = _token_rows(x, fwd), None
        x2 = dequantize(x8) if calls is not None or not keep_fp8_input else None
    else:
        x2 = _rows(x)
    if calls is not None and recompute:
        assert x2 is not None  # delayed buffers: an FP8 input was dequantized above
        # This call's own scales, not the latest call's (see DelayedBuffers).
        scale_in, scale_w = recorded_scales(*calls, sync_amax(tensor_amax(x2)))
        q_in, q_w = q_in._replace(scale=scale_in), q_w._replace(scale=scale_w)
    x8_cm = None
    if not isinstance(x, Float8Tensor):
        assert x2 is not None  # a high-precision input: reshaped above
        # The weight-gradient GEMM takes x8 with M innermost: written so by the cast.
        x8, x8_cm, amax_x = q_in.quantize(x2, 1, fwd, column_major=fwd if keep_fp8_input else None, recompute=recompute)
    if isinstance(weight, Float8Tensor):  # FSDP2 float8 all-gather hands over an FP8 weight
        w8, amax_w = weight._replace(gemm=fwd), None
        if config.weight.delayed:
            # Cast by the gather with the history's scale: record that scale and the
            # whole weight's amax (for the history, pushed in backward) as a cast here would.
            if weight_amax is None:
                raise RuntimeError(
                    "a delayed-scaled weight gathered in FP8 arrived without its amax; call the layer "
                    "(Float8Linear), which hands it over, in LinearArgs.weight_amax"
                )
            amax_w = sync_amax(weight_amax)
            if not recompute:
                q_w.keep_scale(weight._scale)
    elif q_w.cache is not None:
        w8, amax_w = q_w.cached("forward", lambda: q_w.quantize(weight, 1, fwd).tensor), None
    else:
        w8, _, amax_w = q_w.quantize(weight, 1, fwd, recompute=recompute)
    if calls is not None and not recompute:
        # x2 exists whenever amax_x is None (delayed buffers: an FP8 input was dequantized above).
        key = amax_x if amax_x is not None else sync_amax(tensor_amax(x2))  # type: ignore[arg-type]
        record_call(*calls, key, scale_in, scale_w)  # type: ignore[arg-type]  # calls: delayed buffers exist
    y = matmul(x8, transpose_2d(w8), bias=bias)  # built, not dispatched: torch.export traces it

    # The weight-gradient GEMM contracts over tokens (dim 0 of x): a tensorwise x8 is
    # reused there as is (keep_fp8_input); a rowwise, block-scaled or MX one would need
    # the other axis (the tokens). In eager mode that cast is made here, column-major as
    # that GEMM reads it, and saved (1 byte per element and its scales) instead of x: the
    # very cast backward would make, so the same gradients. Under torch.compile the
    # partitioner decides what to save (it keeps that cast in FP8 as well); x stays in hp
    # (an FP8-gathered one: its dequantized values) for a high-precision weight gradient,
    # for a weight without gradient and for a forward that records no backward.
    saved_x = x2
    if keep_fp8_input:
        # Lay x8's bytes out column-major now, while the cast writes them (see
        # column_major_copy; an FP8-gathered input is copied).
        saved_x = column_major_copy(x8) if x8_cm is None else x8_cm
    elif not config.weight_grad_in_hp and not torch.compiler.is_compiling() and ctx.needs_input_grad[1] and _records_backward(ctx):
        assert x2 is not None  # a non-tensorwise input: reshaped or dequantized above
        saved_x = q_in.quantize_column_major(x2, 0, GemmConfig(pad_inner_dim=True, emulate=config.emulate))
    # Backward re-casts a tensorwise high-precision weight with this very scale; a
    # rowwise or block-scaled weight is cast along the other axis there (a 128x128 one
    # to the same blocks), so its scale is not kept.
    reuse_w_scale = not isinstance(weight, Float8Tensor) and config.weight.tensorwise
    ctx.save_for_backward(saved_x, weight, w8._scale if reuse_w_scale else None, amax_x, amax_w)
    ctx.quantizers = (q_in, q_w, q_go)
    return y


def _recipe_backward(ctx, grad_y, saved) -> tuple[torch.Tensor | None, ...]:
    """The gradients of x, weight and bias for a per-role recipe."""
    saved_x, weight, w_scale, amax_x, amax_w = saved
    q_in, q_w, q_go = ctx.quantizers
    need_grad_x, need_grad_w, need_grad_b = ctx.needs_input_grad[:3]
    config: Float8LinearConfig = ctx.config
    bwd = GemmConfig(pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
    # grad_W contracts over the tokens, whose count (M) varies with the batch: always
    # pad it to 16 (zero rows add nothing), never fail on an odd batch.
    bwd_w = GemmConfig(pad_inner_dim=True, emulate=config.emulate)
    g = _rows(grad_y)
    go_cfg = config.grad_output

    # g8: grad_output scaled along N (or per tensor), for grad_x and, per tensor, also
    # for grad_W. A delayed cast measures every backward's grad_output, needed or not.
    g8 = None
    gw_uses_g8 = go_cfg.tensorwise and not config.weight_grad_in_hp
    # An FP8-gathered rowwise weight W = W8 / s has one scale per row n, which grad_x's
    # product contracts over: fold the row scales into grad_output, g @ W = (g / s) @ W8,
    # and cast that per token, so the gathered bytes serve as they are (re-casting W8
    # per column would cost ~3 dB of grad_x; see CHANGELOG). g8 is then only grad_x's.
    fold = need_grad_x and isinstance(weight, Float8Tensor) and _row_scaled(weight) and go_cfg.rowwise
    # g8_cm: the weight-gradient GEMM's copy of g8 (M innermost), written by the cast's
    # own pass (fused, or under torch.compile by inductor).
    g8_cm = None
    if need_grad_x or (need_grad_w and gw_uses_g8) or go_cfg.delayed:
        g_x = g.float() / weight._scale.reshape(1, -1) if fold else g
        g8, g8_cm, amax_g = q_go.quantize(g_x, 1, bwd, column_major=bwd_w if need_grad_w and gw_uses_g8 else None)
        if fold:
            g8 = g8._replace(orig_dtype=g.dtype)  # grad_x comes out in grad_output's dtype
        q_go.push(amax_g)

    # grad_x = g @ W: contraction over N, so W's scale must be constant along dim 0.
    grad_x = None
    if need_grad_x:
        if fold:  # the row scales are in g8 already: W8 with a unit scale
            unit = torch.ones((), dtype=torch.float32, device=weight._scale.device)
            w8 = weight._replace(scale=unit, block=(0, 0), gemm=bwd)
        elif isinstance(weight, Float8Tensor) and _blocked_along_k(weight, spec0 := config.weight.operand_spec(0)):
            # An FP8-gathered weight whose blocks run along K (MX 1x32): grad_x contracts
            # over N, and no block-scaled kernel reads a 1x32 second operand along N. Cast
            # again along N from the gathered values (a second rounding, backward only;
            # exact for normal values with power-of-two scales). Deliberate fp32 between
            # the two roundings, not the weight's bf16.
            w8 = cast_second_operand(dequantize(weight, torch.float32), spec0, bwd)
            w8 = w8._replace(orig_dtype=weight._orig_dtype)
        elif isinstance(weight, Float8Tensor):
            w8 = weight._replace(gemm=bwd)
        elif q_w.cache is not None:
            # The cached casts (weight_cache.py): forward's bytes serve grad_x as they
            # are for a tensorwise weight (the same scale); other granularities keep
            # the cast along the other axis under its own layout.
            if config.weight.tensorwise:
                w8 = q_w.cached("forward", lambda: quantize(weight, CastSpec(config.weight.dtype), scale=w_scale)[0])
            else:
                w8 = q_w.cached("backward", lambda: cast_second_operand(weight, config.weight.operand_spec(0), bwd))
            w8 = w8._replace(gemm=bwd)
        elif not config.weight.tensorwise:
            w8 = cast_second_operand(weight, config.weight.operand_spec(0), bwd)
        else:
            # Same scale as in forward: the same FP8 bytes, without keeping them alive.
            # A delayed scale was decided without this weight's amax: guard an inf in it
            # as the forward cast did (cast_operand), or the clamp would make it the
            # format's max and grad_x finite. A dynamic scale is NaN then already.
            hp_w = torch.where(torch.isinf(weight), torch.nan, weight) if config.weight.delayed else weight
            w8 = cast_second_operand(hp_w, CastSpec(config.weight.dtype), bwd, scale=w_scale)
        grad_x = _unrows(matmul(g8, w8), ctx.x_shape)  # type: ignore[arg-type]  # need_grad_x: g8 was cast

    # grad_W = g.t() @ x: contraction over M.
    grad_w = None
    if need_grad_w:
        if config.weight_grad_in_hp:
            grad_w = g.t().to(saved_x.dtype) @ saved_x
        else:
            # Both operands with M innermost (column-major), written by their casts.
            if gw_uses_g8:
                assert g8_cm is not None  # need_grad_w and gw_uses_g8: copied with bwd_w above
                gt8 = g8_cm
            else:
                # When grad_x was not needed this is the only cast of grad_output: it
                # then feeds the telemetry.
                gt8 = q_go.quantize_column_major(g, 0, bwd_w, measure=g8 is None)
            if isinstance(saved_x, Float8Tensor):
                x8 = saved_x._replace(gemm=bwd_w)
            else:
                x8 = q_in.quantize_column_major(saved_x, 0, bwd_w)
            # Written in the weight's dtype (fp32 for fp32 master weights), not bf16:
            # autograd needs the fp32 .grad anyway, and a bf16 output adds a rounding
            # and an upcast pass. Bytes per weight element in eager: tensorwise route
            # 4 (fp32 written once) vs 4 + 2 + 4 (bf16 written, read, fp32 written);
            # post-scale route (a rowwise product with an fp32 output, or any precise
            # one when asked for: gemm.choose_route) fp32 either way until its last
            # pass, then 12 bytes more for bf16. The
            # accuracy is the same either way (grad_W SQNR vs fp64: 28.9 dB, rowwise
            # e4m3, M=256 K=64 N=48 and M=2048 K=512 N=1792), so the bytes decide.
            grad_w = matmul(transpose_2d(gt8), x8, out_dtype=weight.dtype)
        grad_w = grad_w.to(weight.dtype)
    grad_b = g.sum(0) if need_grad_b else None
    # Pushed last: under torch.compile an amax the partitioner recomputes here (the
    # weight's) is then read in the same pass as the weight's re-cast above.
    q_in.push(amax_x)
    q_w.push(amax_w)
    return grad_x, grad_w, grad_b


def _records_backward(ctx) -> bool:
    """Whether this call records a backward node (grad mode on at ``apply`` and an input
    that requires grad). ``forward`` runs with grad mode off, so it cannot ask
    ``torch.is_grad_enabled()``; the node has its next edges exactly when it is recorded."""
    return len(ctx.next_functions) > 0


def _blocked_along_k(w8: Float8Tensor, spec: CastSpec) -> bool:
    """``w8`` (N, K), a block-scaled weight cast for the forward, has blocks that grad_x's
    product (contracting over N, as ``spec`` says) cannot read as they are."""
    return w8.is_blockwise and w8._block != spec.block


def _row_scaled(w8: Float8Tensor) -> bool:
    """``w8`` (N, K) has one scale per row (a rowwise weight cast for the forward)."""
    return w8.dim() == 2 and w8._block == (1, 0)


def _t(q: Float4Tensor | Float8Tensor) -> torch.Tensor:
    return transpose_2d_fp4(q) if is_float4(q) else transpose_2d(q)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` (zero tokens add
    nothing to the weight gradient)."""
    extra = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


# ===================================================================== per-GEMM formats, FP4


def _formats_forward(ctx, x, weight, bias, config: Float8LinearConfig, stats: StatsBuffers | None) -> torch.Tensor:
    """The forward of a config with per-GEMM formats or FP4 (see :class:`QuantizedLinearFn`)."""
    q_in, q_w, q_go = linear_quantizers(config, None, stats)
    fwd = GemmConfig(use_fast_accum=config.use_fast_accum, pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
    x2 = _rows(x)
    if q_in.format_for("forward") is None or q_w.format_for("forward") is None:
        y = torch.nn.functional.linear(x2, weight.to(x2.dtype), bias)
    else:
        y = matmul(q_in.quantize_for("forward", x2, 1, fwd), _t(q_w.quantize_for("forward", weight, 1, fwd)), bias=bias)
    ctx.save_for_backward(x2, weight)
    ctx.quantizers = (q_in, q_w, q_go)
    return y


def _formats_backward(ctx, grad_y, saved) -> tuple[torch.Tensor | None, ...]:
    """The gradients of x, weight and bias for a config with per-GEMM formats or FP4."""
    x2, weight = saved
    config: Float8LinearConfig = ctx.config
    need_grad_x, need_grad_w, need_grad_b = ctx.needs_input_grad[:3]
    bwd = GemmConfig(pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
    bwd_w = GemmConfig(pad_inner_dim=True, emulate=config.emulate)
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
                # FP4 blocks run along the tokens here: pad them to whole blocks (and RHT blocks).
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
