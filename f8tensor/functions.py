"""Autograd Functions shared by ``Float8Linear`` and the FP8 experts, and the per-operand casts.

:class:`Float8LinearFn` is ``x @ W.t() + b`` with FP8 GEMMs in forward and both backward
GEMMs, each operand cast per its :class:`~f8tensor.config.CastConfig` (dynamic or delayed,
any granularity: :meth:`CastConfig.operand_spec` gives each GEMM operand its
:class:`~f8tensor.config.CastSpec`). Its state is named: :class:`DelayedBuffers` (the
delayed-scaling buffers of a layer) and :class:`StatsBuffers` (its telemetry), each
``None`` when the config does not use it. :class:`NoDoubleBackward` refuses a second
derivative with a message naming the layer.

:class:`GemmFormatsLinearFn` is the same product for configs that name a format per GEMM
(``Float8LinearConfig.gemm_overrides``) or use FP4 (NVFP4, MXFP4): each operand of each
GEMM is cast per :meth:`Float8LinearConfig.cast_for` (dynamic scaling), a GEMM with a
high-precision operand runs in high precision, and the weight-gradient GEMM's FP4 operands
get the random Hadamard transform when the config asks for it.

Layer: above ``ops``; imports ``gemm``, ``ops``, ``tensor``, ``fp4``, ``hadamard``,
``scaling``, ``config``, ``compat``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from f8tensor.compat import current_graph_task_id, functional_all_reduce_max
from f8tensor.config import CastConfig, CastSpec, Float8LinearConfig, GemmConfig, is_tensorwise
from f8tensor.fp4 import Float4Tensor, is_float4, to_float4, to_float4_with_stats
from f8tensor.fp4 import transpose_2d as transpose_2d_fp4
from f8tensor.gemm import matmul
from f8tensor.hadamard import RHT_SIZE, apply_rht
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.ops import transpose_2d
from f8tensor.scaling import delayed_scale, materialized, push_amax, tensor_amax
from f8tensor.tensor import Float8Tensor, dequantize, to_float8_for_gemm, to_float8_with_stats, with_inverse_scale

__all__ = [
    "DelayedBuffers",
    "Float8LinearFn",
    "GemmFormatsLinearFn",
    "NoDoubleBackward",
    "StatsBuffers",
    "cast_gemm_operand",
    "cast_operand",
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


def _record_call(
    keys: torch.Tensor, scales: torch.Tensor, key: torch.Tensor, scale_in: torch.Tensor, scale_w: torch.Tensor
) -> None:
    """Push this forward's (key, input scale, weight scale) as the newest recorded call."""
    keys.copy_(torch.cat([key.reshape(1).to(keys.dtype), keys[:-1]]))
    scales.copy_(torch.cat([torch.stack([scale_in, scale_w]).reshape(1, 2), scales[:-1]]))


def _recorded_scales(keys: torch.Tensor, scales: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight scales of the newest recorded call with this key (no device
    sync: an argmax on the device). No match (more than _CALLS calls since): the newest."""
    index = (keys == key).to(torch.int32).argmax()
    row = scales[index]
    return row[0], row[1]


def _sync_amax(amax: torch.Tensor) -> torch.Tensor:
    """Make an amax agree across data-parallel ranks (a no-op without torch.distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return amax
    return functional_all_reduce_max(amax, dist.group.WORLD)


def _recomputing() -> bool:
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
    into ``history`` (see :class:`Float8LinearFn`), for a dynamic cast ``None``; and with
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
        return _cast(stats, hp, spec, gemm=gemm), None, None
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
    fp8 = _cast(stats, guarded, spec, scale=scale, gemm=gemm, amax=amax_local)
    fp8 = fp8._replace(data=materialized(fp8._data))
    if amax_local is None:
        amax_local = _amax_by_rows(hp)
    if scale_buffer is not None and not recompute:
        scale_buffer.copy_(scale)
    return fp8, _sync_amax(amax_local), None if column_major is None else _column_major_copy(fp8, column_major)


def _amax_by_rows(hp: torch.Tensor) -> torch.Tensor:
    """``tensor_amax(hp)`` (the same value: min and max are exact), reduced row by row
    first for a 2D ``hp``: a reduction over the cast's own loop nest, which inductor fuses
    into the cast's pass (a flat reduction over all elements has other loops and stays a
    pass of its own)."""
    if hp.dim() != 2 or hp.numel() == 0:
        return tensor_amax(hp)
    return torch.maximum(hp.amax(-1), -hp.amin(-1)).amax().float()


def _cast(
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
    """:func:`_cast` of a 2D ``hp`` and its column-major twin (config ``column_major``), from
    one pass where the cast is fused (with telemetry: the measuring cast, then a copy)."""
    if stats is None:
        f8, twin = to_float8_for_gemm(hp, spec, gemm=gemm, layouts="both", column_major_gemm=column_major)
        if twin is not None:
            return f8, twin
    else:
        f8 = _cast(stats, hp, spec, gemm=gemm)
    return f8, _column_major_copy(f8, column_major)


def _cast_second_operand(hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None) -> Float8Tensor:
    """The weight cast for grad_x's product, whose second operand it is: on CUDA written
    column-major, the layout every FP8 kernel reads its second operand in (the GEMM's
    operand preparation would copy it otherwise); on CPU, where only the per-tensor
    product needs that layout, as the cast lays it out for block scales (their reference
    product reads any layout). Under torch.compile the layout is inductor's to place (a
    column-major cast there would have the partitioner keep a transposed copy of the
    weight for backward)."""
    if not torch.compiler.is_compiling() and (hp.is_cuda or is_tensorwise(spec.block)):
        return _cast_column_major(None, hp, spec, gemm, scale)
    return _cast(None, hp, spec, scale=scale, gemm=gemm)


def _cast_column_major(
    stats: torch.Tensor | None, hp: torch.Tensor, spec: CastSpec, gemm: GemmConfig, scale: torch.Tensor | None = None
) -> Float8Tensor:
    """:func:`_cast` of a 2D ``hp`` with its bytes column-major: an operand only one GEMM
    reads, as its second operand or as an operand of the weight-gradient GEMM (M
    innermost), written so by the cast where it is fused (else copied, as the GEMM's
    operand preparation would copy it)."""
    if stats is None:
        return to_float8_for_gemm(hp, spec, scale=scale, gemm=gemm, layouts="column_major")[0]
    return _column_major_copy(_cast(stats, hp, spec, scale=scale, gemm=gemm))


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


def _column_major_copy(f8: Float8Tensor, gemm: GemmConfig | None = None) -> Float8Tensor:
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


class Float8LinearFn(torch.autograd.Function):
    """``x @ W.t() + b`` with FP8 GEMMs in forward and backward.

    Saved for backward: the FP8 input (1 byte/element) when the weight-gradient GEMM
    takes it as is (tensorwise input), else the high-precision input; the weight itself
    (a parameter, no extra memory) and, for a tensorwise weight, its 0-dim scale, so
    backward re-casts it to the very same bytes instead of keeping an FP8 copy of every
    weight alive. Delayed scaling also keeps the input's and weight's 0-dim amax. (This
    is what eager mode keeps; under torch.compile the partitioner may save other tensors,
    e.g. a rowwise input already cast along the other axis, in FP8.) The FP8 input is
    saved column-major, the layout the weight-gradient GEMM takes (see _column_major_copy).

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
    """

    @staticmethod
    def forward(ctx, x, weight, bias, config, delayed, stats, weight_amax=None, weight_casts=None):  # type: ignore[override]
        # `delayed`: None, or the layer's DelayedBuffers; `stats`: None, or its StatsBuffers.
        # `weight_amax`: for a delayed weight that FSDP2 gathered in FP8, the amax of this
        # rank's shard, measured before the gather (distributed/fsdp.py).
        # `weight_casts`: None, or (the layer's WeightCasts, the parameter they are keyed on)
        # inside a reuse_weight_casts scope (weight_cache.py): the weight's casts are served
        # from there while the parameter is unchanged (dynamic, round-to-nearest weights only).
        # They ride on ctx, not save_for_backward: they are updated in place by later steps,
        # which is their purpose, not a hazard for this step's gradients.
        d = delayed
        hist_in, hist_w, hist_go = (d.amax_history_input, d.amax_history_weight, d.amax_history_grad_output) if d else (None,) * 3
        scale_in, scale_w = (d.scale_input, d.scale_weight) if d else (None, None)
        st_in, st_w, st_go = stats if stats is not None else (None,) * 3
        recompute = config.any_delayed and _recomputing()
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
            scale_in, scale_w = _recorded_scales(*calls, _sync_amax(tensor_amax(x2)))
        x8_cm = None
        if not isinstance(x, Float8Tensor):
            assert x2 is not None  # a high-precision input: reshaped above
            # The weight-gradient GEMM takes x8 with M innermost: written so by the cast.
            x8, amax_x, x8_cm = cast_operand(
                x2, config.input, 1, fwd, config, hist_in, scale_in, recompute, st_in, column_major=fwd if keep_fp8_input else None
            )
        if isinstance(weight, Float8Tensor):  # FSDP2 float8 all-gather hands over an FP8 weight
            w8, amax_w = weight._replace(gemm=fwd), None
            if config.weight.delayed:
                # Cast by the gather with the history's scale: record that scale and the
                # whole weight's amax (for the history, pushed in backward) as a cast here would.
                if weight_amax is None:
                    raise RuntimeError(
                        "a delayed-scaled weight gathered in FP8 arrived without its amax; call the layer "
                        "(Float8Linear), which hands it over, rather than Float8LinearFn directly"
                    )
                amax_w = _sync_amax(weight_amax)
                if scale_w is not None and not recompute:
                    scale_w.copy_(weight._scale)
        elif weight_casts is not None:
            casts, param = weight_casts
            w8 = casts.get("forward", param, config, lambda: cast_operand(weight, config.weight, 1, fwd, config, stats=st_w)[0])
            amax_w = None
        else:
            w8, amax_w, _ = cast_operand(weight, config.weight, 1, fwd, config, hist_w, scale_w, recompute, st_w)
        if calls is not None and not recompute:
            # x2 exists whenever amax_x is None (delayed buffers: an FP8 input was dequantized above).
            key = amax_x if amax_x is not None else _sync_amax(tensor_amax(x2))  # type: ignore[arg-type]
            _record_call(*calls, key, scale_in, scale_w)  # type: ignore[arg-type]  # calls: delayed buffers exist
        y = matmul(x8, transpose_2d(w8), bias=bias)  # built, not dispatched: torch.export traces it

        # The weight-gradient GEMM contracts over tokens (dim 0 of x): a tensorwise x8 is
        # reused there as is (keep_fp8_input); a rowwise or block-scaled one would need the
        # other axis (the tokens), so keep x in hp (an FP8-gathered one: its dequantized values).
        # Backward re-casts a tensorwise high-precision weight with this very scale; a
        # rowwise or block-scaled weight is cast along the other axis there (a 128x128 one
        # to the same blocks), so its scale is not kept.
        reuse_w_scale = not isinstance(weight, Float8Tensor) and config.weight.tensorwise
        # The weight-gradient GEMM takes x8 with M innermost: lay the bytes out so now, while
        # the cast writes them (see _column_major_copy; an FP8-gathered input is copied).
        if keep_fp8_input and x8_cm is None:
            x8_cm = _column_major_copy(x8)
        ctx.save_for_backward(
            x8_cm if keep_fp8_input else x2, weight, w8._scale if reuse_w_scale else None, amax_x, amax_w
        )
        ctx.config = config
        ctx.weight_casts = weight_casts
        ctx.histories = (hist_in, hist_w, hist_go)
        ctx.stats_go = st_go
        ctx.x_shape = x.shape
        ctx.layer = f"Float8Linear(in_features={weight.shape[1]}, out_features={weight.shape[0]})"
        # A fresh tensor, not a view of the 2D product (reshape returns a view even when
        # the shape is unchanged), like nn.Linear's output: FSDP2 warns on every forward
        # whose output is a view, as an in-place op on it would bypass the backward hook.
        # _scaled_mm's result is contiguous, so _unsafe_view only relabels its shape.
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        saved = ctx.saved_tensors  # unpacked once (a checkpointed forward allows no second unpack)
        if not torch.is_grad_enabled():
            return Float8LinearFn._backward(ctx, grad_y, saved)
        # create_graph=True: FP8 GEMMs have no derivative (torch._scaled_mm has none), so
        # compute the gradients without a graph and attach a node that refuses a second
        # backward with a message naming the layer, instead of failing deep in autograd.
        with torch.no_grad():
            grads = Float8LinearFn._backward(ctx, grad_y, saved)
        saved_x, weight = saved[:2]
        present = [i for i, g in enumerate(grads[:3]) if g is not None]
        outs = NoDoubleBackward.apply(ctx.layer, grad_y, weight, saved_x, *(grads[i] for i in present))
        grads = list(grads)
        for i, g in zip(present, outs):
            grads[i] = g
        return tuple(grads)

    @staticmethod
    def _backward(ctx, grad_y, saved):
        saved_x, weight, w_scale, amax_x, amax_w = saved
        hist_in, hist_w, hist_go = ctx.histories
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
            g8, amax_g, g8_cm = cast_operand(
                g_x, go_cfg, 1, bwd, config, hist_go, stats=ctx.stats_go, column_major=bwd_w if need_grad_w and gw_uses_g8 else None
            )
            if fold:
                g8 = g8._replace(orig_dtype=g.dtype)  # grad_x comes out in grad_output's dtype
            if amax_g is not None:
                push_amax(hist_go, amax_g)

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
                w8 = _cast_second_operand(dequantize(weight, torch.float32), spec0, bwd)
                w8 = w8._replace(orig_dtype=weight._orig_dtype)
            elif isinstance(weight, Float8Tensor):
                w8 = weight._replace(gemm=bwd)
            elif ctx.weight_casts is not None:
                # The cached casts (weight_cache.py): forward's bytes serve grad_x as they
                # are for a tensorwise weight (the same scale); other granularities keep
                # the cast along the other axis under its own layout.
                casts, param = ctx.weight_casts
                if config.weight.tensorwise:
                    w8 = casts.get("forward", param, config, lambda: _cast(None, weight, CastSpec(config.weight.dtype), scale=w_scale))
                else:
                    w8 = casts.get("backward", param, config, lambda: _cast_second_operand(weight, config.weight.operand_spec(0), bwd))
                w8 = w8._replace(gemm=bwd)
            elif not config.weight.tensorwise:
                w8 = _cast_second_operand(weight, config.weight.operand_spec(0), bwd)
            else:
                # Same scale as in forward: the same FP8 bytes, without keeping them alive.
                # A delayed scale was decided without this weight's amax: guard an inf in it
                # as the forward cast did (cast_operand), or the clamp would make it the
                # format's max and grad_x finite. A dynamic scale is NaN then already.
                hp_w = torch.where(torch.isinf(weight), torch.nan, weight) if config.weight.delayed else weight
                w8 = _cast_second_operand(hp_w, CastSpec(config.weight.dtype), bwd, scale=w_scale)
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
                    gt8 = _cast_column_major(ctx.stats_go if g8 is None else None, g, go_cfg.operand_spec(0), bwd_w)
                if isinstance(saved_x, Float8Tensor):
                    x8 = saved_x._replace(gemm=bwd_w)
                else:
                    x8 = _cast_column_major(None, saved_x, config.input.operand_spec(0), bwd_w)
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
        if amax_x is not None:
            push_amax(hist_in, amax_x)
        if amax_w is not None:
            push_amax(hist_w, amax_w)
        # One None per non-tensor input; trailing ones for `weight_amax` and `weight_casts`,
        # which autograd drops when the caller passed fewer inputs.
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _blocked_along_k(w8: Float8Tensor, spec: CastSpec) -> bool:
    """``w8`` (N, K), a block-scaled weight cast for the forward, has blocks that grad_x's
    product (contracting over N, as ``spec`` says) cannot read as they are."""
    return w8.is_blockwise and w8._block != spec.block


def _row_scaled(w8: Float8Tensor) -> bool:
    """``w8`` (N, K) has one scale per row (a rowwise weight cast for the forward)."""
    return w8.dim() == 2 and w8._block == (1, 0)


# ===================================================================== per-GEMM formats, FP4


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
        return _cast(stats, hp, spec, gemm=gemm)
    kind = cast.fp4_kind
    assert kind is not None  # an FP4 cast (cast.fp4) names its kind
    fspec = FP4Spec(kind, spec.block, contracted_dim % hp.dim(), spec.scale_mode, spec.rounding,
                    config.four_over_six and kind == "nvfp4")
    if stats is None:
        return to_float4(hp, fspec, gemm=gemm)
    f4, measured = to_float4_with_stats(hp, fspec, gemm=gemm)
    stats.copy_(measured)
    return f4


def _t(q: Float4Tensor | Float8Tensor) -> torch.Tensor:
    return transpose_2d_fp4(q) if is_float4(q) else transpose_2d(q)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` (zero tokens add
    nothing to the weight gradient)."""
    extra = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


class GemmFormatsLinearFn(torch.autograd.Function):
    """``x @ W.t() + b`` with each operand of each GEMM in its own format.

    ``cast_for(gemm, role)`` of the config decides every cast: an FP8 CastConfig (any
    granularity), NVFP4, MXFP4, or ``None`` (that GEMM in high precision). Saved for
    backward: the high-precision input and the weight (a parameter, no copy): the
    backward GEMMs re-cast them along their own contraction dims (for FP4 with the Hadamard
    transform along the tokens first; for 16x16 weight blocks to the same codes as in
    forward). Telemetry records the first cast of each role.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, config, stats):  # type: ignore[override]
        st_in, st_w, st_go = stats if stats is not None else (None,) * 3
        fwd = GemmConfig(use_fast_accum=config.use_fast_accum, pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
        x2 = x.reshape(-1, x.shape[-1])
        ci, cw = config.cast_for("forward", "input"), config.cast_for("forward", "weight")
        if ci is None or cw is None:
            y = torch.nn.functional.linear(x2, weight.to(x2.dtype), bias)
        else:
            x_q = cast_gemm_operand(x2, ci, 1, fwd, config, st_in)
            w_q = cast_gemm_operand(weight, cw, 1, fwd, config, st_w)
            y = matmul(x_q, _t(w_q), bias=bias)
        ctx.save_for_backward(x2, weight)
        ctx.config = config
        ctx.stats_go = st_go
        ctx.x_shape = x.shape
        ctx.layer = f"Float8Linear(in_features={weight.shape[1]}, out_features={weight.shape[0]})"
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        saved = ctx.saved_tensors
        if not torch.is_grad_enabled():
            return GemmFormatsLinearFn._backward(ctx, grad_y, saved)
        with torch.no_grad():
            grads = GemmFormatsLinearFn._backward(ctx, grad_y, saved)
        x2, weight = saved
        present = [i for i, g in enumerate(grads[:3]) if g is not None]
        outs = NoDoubleBackward.apply(ctx.layer, grad_y, weight, x2, *(grads[i] for i in present))
        grads = list(grads)
        for i, g in zip(present, outs):
            grads[i] = g
        return tuple(grads)

    @staticmethod
    def _backward(ctx, grad_y, saved):
        x2, weight = saved
        config: Float8LinearConfig = ctx.config
        need_grad_x, need_grad_w, need_grad_b = ctx.needs_input_grad[:3]
        bwd = GemmConfig(pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
        bwd_w = GemmConfig(pad_inner_dim=True, emulate=config.emulate)
        g = grad_y.reshape(-1, grad_y.shape[-1])
        st_go = ctx.stats_go

        grad_x = None
        if need_grad_x:
            cg, cw = config.cast_for("grad_input", "grad_output"), config.cast_for("grad_input", "weight")
            if cg is None or cw is None:
                grad_x = g @ weight.to(g.dtype)
            else:
                g_q = cast_gemm_operand(g, cg, 1, bwd, config, st_go)
                st_go = None  # recorded once per backward
                grad_x = matmul(g_q, cast_gemm_operand(weight, cw, 0, bwd, config))
            grad_x = grad_x.reshape(ctx.x_shape)

        grad_w = None
        if need_grad_w:
            cg, cx = config.cast_for("grad_weight", "grad_output"), config.cast_for("grad_weight", "input")
            if cg is None or cx is None:
                grad_w = g.t().to(x2.dtype) @ x2
            else:
                gg, xx = g, x2
                if cg.fp4 or cx.fp4:
                    # FP4 blocks run along the tokens here: pad them to whole blocks (and RHT blocks).
                    gg, xx = _pad_rows(gg, 2 * RHT_SIZE), _pad_rows(xx, 2 * RHT_SIZE)
                    if config.hadamard_wgrad:
                        gg, xx = apply_rht(gg, config.hadamard_seed), apply_rht(xx, config.hadamard_seed)
                g_q = cast_gemm_operand(gg, cg, 0, bwd_w, config, st_go)
                x_q = cast_gemm_operand(xx, cx, 0, bwd_w, config)
                grad_w = matmul(_t(g_q), x_q, out_dtype=weight.dtype)
            grad_w = grad_w.to(weight.dtype)
        grad_b = g.sum(0) if need_grad_b else None
        return grad_x, grad_w, grad_b, None, None


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


