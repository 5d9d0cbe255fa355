"""Float8Linear: nn.Linear whose three GEMMs run in FP8, and the model converter.

Forward ``y = x @ W.t() + b``; backward ``grad_x = grad_y @ W`` and
``grad_W = grad_y.t() @ x``, each operand cast per the :class:`Float8LinearConfig`.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable

import torch
from torch import nn

from f8tensor.config import BlockGranularity, CastConfig, Float8LinearConfig, GemmConfig
from f8tensor.formats import HP_DTYPES
from f8tensor.gemm import _matmul
from f8tensor.ops import transpose_2d
from f8tensor.scaling import delayed_scale, materialized, push_amax, tensor_amax
from f8tensor.tensor import CAST_STATS_FIELDS, Float8Tensor, cast_to_float8, cast_to_float8_with_stats

__all__ = [
    "STATS_BUFFERS",
    "STATS_ROLES",
    "TRANSPOSED_LINEAR_CLASSES",
    "Float8Conv1D",
    "Float8Linear",
    "convert_to_float8_training",
]

logger = logging.getLogger("f8tensor")

_ALIGN = 16
# Delayed-scaling buffers: one amax history per operand role, and the scales the current
# step used for input and weight (re-used if activation checkpointing re-runs forward).
_HISTORY_BUFFERS = ("amax_history_input", "amax_history_weight", "amax_history_grad_output")
_SCALE_BUFFERS = ("scale_input", "scale_weight")
# The scales of each of the last _CALLS forwards of a step, keyed by the input's amax: a
# layer called several times per step under activation checkpointing recomputes each call
# with its own scales (the 0-dim buffers above only hold the latest call's). The key is
# free (the delayed input cast measures it anyway) and a recompute reproduces it bit for
# bit; calls with equal keys share a history, hence a scale. Not persistent: they only
# link a forward to its recompute within one step.
_CALL_KEYS, _CALL_SCALES = "delayed_call_keys", "delayed_call_scales"
_CALLS = 8
_DELAYED_BUFFERS = _HISTORY_BUFFERS + _SCALE_BUFFERS + (_CALL_KEYS, _CALL_SCALES)
# Cast telemetry (config.collect_stats): one float64 vector per operand role, laid out as
# CAST_STATS_FIELDS. Not persistent: it describes the last step, not the model. Separate
# buffers, not rows of one: each cast overwrites a whole tensor, which every AOTAutograd
# partitioner handles (an in-place write to a row of a buffer in backward trips the
# default partitioner of torch 2.13).
STATS_ROLES = ("input", "weight", "grad_output")
STATS_BUFFERS = tuple(f"float8_stats_{role}" for role in STATS_ROLES)


def _fresh_state(name: str, like: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A buffer as a newly built layer has it: empty history, unit scale, no recorded call
    (key -1: an amax is never negative), telemetry NaN (not measured)."""
    if name in STATS_BUFFERS:
        return torch.full_like(like, torch.nan, device=device)
    fill = 1.0 if name in _SCALE_BUFFERS or name == _CALL_SCALES else -1.0 if name == _CALL_KEYS else 0.0
    return torch.full_like(like, fill, dtype=torch.float32, device=device)


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
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(amax, "max", dist.group.WORLD)


def _recomputing() -> bool:
    """True while activation checkpointing re-runs a forward inside backward (eager).

    Delayed scaling must cast with the scale the original forward used then. Under
    torch.compile the partitioner recomputes from the traced graph and never replays
    buffer updates.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _granularity(cast: CastConfig, contracted_dim: int) -> dict:
    """``cast_to_float8`` keywords for an operand whose GEMM contracts over ``contracted_dim``.

    Tensorwise: one scale. Rowwise: the scale is constant along the contracted dim. A block
    is written as ``(rows, contracted)``, so it is reversed for an operand contracted over
    dim 0 (a 1x128 tile becomes 128x1: 128 tokens long in the weight-gradient GEMM). The
    rounding mode rides along.
    """
    gran = cast.granularity
    if isinstance(gran, BlockGranularity):
        block = gran.block if contracted_dim == 1 else gran.block[::-1]
        return {
            "block": block,
            "scale_dtype": gran.scale_dtype,
            "scale_mode": gran.scale_mode,
            "rounding": cast.rounding,
        }
    return {"axiswise_dim": contracted_dim if cast.rowwise else None, "rounding": cast.rounding}


def _cast(
    hp: torch.Tensor,
    cast: CastConfig,
    contracted_dim: int,
    gemm: GemmConfig,
    config: Float8LinearConfig,
    history: torch.Tensor | None = None,
    scale_buffer: torch.Tensor | None = None,
    recompute: bool = False,
    stats: torch.Tensor | None = None,
) -> tuple[Float8Tensor, torch.Tensor | None]:
    """Cast one GEMM operand per its CastConfig (dynamic or delayed); its GEMM contracts
    over ``contracted_dim`` (see :func:`_granularity`).

    Returns the FP8 tensor and, for a delayed cast, the current amax, which the caller
    pushes into ``history`` (see ``_Float8LinearFn``); for a dynamic cast ``None``.
    Delayed: the scale comes from ``history`` and is also written to ``scale_buffer``;
    with ``recompute`` (a checkpointed forward running again) the scale stored there by
    the original forward is used instead. ``stats``: the role's telemetry buffer, which
    this cast overwrites, or ``None`` (no telemetry).
    """
    if not cast.delayed:
        fp8 = _cast_to_float8(
            stats, hp, cast.dtype, **_granularity(cast, contracted_dim), gemm=gemm, power_of_2_scale=cast.power_of_2_scale
        )
        return fp8, None
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
    fp8 = _cast_to_float8(stats, guarded, cast.dtype, scale=scale, gemm=gemm, amax=amax_local, rounding=cast.rounding)
    fp8 = fp8._replace(data=materialized(fp8._data))
    if amax_local is None:
        amax_local = _amax_by_rows(hp)
    if scale_buffer is not None and not recompute:
        scale_buffer.copy_(scale)
    return fp8, _sync_amax(amax_local)


def _amax_by_rows(hp: torch.Tensor) -> torch.Tensor:
    """``tensor_amax(hp)`` (the same value: min and max are exact), reduced row by row
    first for a 2D ``hp``: a reduction over the cast's own loop nest, which inductor fuses
    into the cast's pass (a flat reduction over all elements has other loops and stays a
    pass of its own)."""
    if hp.dim() != 2 or hp.numel() == 0:
        return tensor_amax(hp)
    return torch.maximum(hp.amax(-1), -hp.amin(-1)).amax().float()


def _cast_to_float8(
    stats: torch.Tensor | None, hp: torch.Tensor, float8_dtype: torch.dtype, *, amax: torch.Tensor | None = None, **kwargs
) -> Float8Tensor:
    """``cast_to_float8``, or with ``stats`` its measuring twin, whose numbers overwrite
    ``stats`` (never accumulate: a checkpointed forward that runs again writes the same)."""
    if stats is None:
        return cast_to_float8(hp, float8_dtype, **kwargs)
    f8, measured = cast_to_float8_with_stats(hp, float8_dtype, amax=amax, **kwargs)
    stats.copy_(measured)
    return f8


def _column_major(f8: Float8Tensor) -> Float8Tensor:
    """``f8`` (2D) with its FP8 bytes laid out column-major: the layout the weight-gradient
    GEMM takes for both operands (it contracts over the tokens, dim 0).

    Written as a copy into a column-major buffer, which inductor fuses into the cast that
    produced ``f8``: one pass over the high-precision tensor stores both layouts. (Left to
    ``_matmul``'s ``.t().contiguous()``, the transposed copy becomes a pass of its own that
    casts the high-precision tensor a second time.) In eager mode it is one copy of the
    FP8 bytes, as before.
    """
    data = f8._data  # a fresh cast: row-major (no stride test, which dynamic shapes would trace)
    out = torch.empty_strided(data.shape, (1, data.shape[0]), dtype=data.dtype, device=data.device)
    out.copy_(data)
    return f8._replace(data=materialized(out))


class _Float8LinearFn(torch.autograd.Function):
    """``x @ W.t() + b`` with FP8 GEMMs in forward and backward.

    Saved for backward: the FP8 input (1 byte/element) when the weight-gradient GEMM
    takes it as is (tensorwise input), else the high-precision input; the weight itself
    (a parameter, no extra memory) and, for a tensorwise weight, its 0-dim scale, so
    backward re-casts it to the very same bytes instead of keeping an FP8 copy of every
    weight alive. Delayed scaling also keeps the input's and weight's 0-dim amax. (This
    is what eager mode keeps; under torch.compile the partitioner may save other tensors,
    e.g. a rowwise input already cast along the other axis, in FP8.) The FP8 input is
    saved column-major, the layout the weight-gradient GEMM takes (see _column_major).

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
    def forward(ctx, x, weight, bias, config, state, stats):  # type: ignore[override]
        # `state`: None, or the delayed-scaling buffers (hist_in, hist_w, hist_go, scale_in,
        # scale_w). They ride on ctx, not save_for_backward: they are updated in place by
        # later steps, which is their purpose, not a hazard for this step's gradients.
        # The same holds for `stats`: None, or the telemetry buffers (input, weight, grad_output).
        hist_in, hist_w, hist_go, scale_in, scale_w = state[:5] if state is not None else (None,) * 5
        st_in, st_w, st_go = stats if stats is not None else (None,) * 3
        recompute = config.any_delayed and _recomputing()
        fwd = GemmConfig(use_fast_accum=config.use_fast_accum, pad_inner_dim=config.pad_inner_dim, emulate=config.emulate)
        x2 = x.reshape(-1, x.shape[-1])
        calls = state[5:] if state is not None and (config.input.delayed or config.weight.delayed) else None
        if calls is not None and recompute:
            # This call's own scales, not the latest call's (see _CALL_KEYS).
            scale_in, scale_w = _recorded_scales(*calls, _sync_amax(tensor_amax(x2)))
        x8, amax_x = _cast(x2, config.input, 1, fwd, config, hist_in, scale_in, recompute, st_in)
        if isinstance(weight, Float8Tensor):  # FSDP2 float8 all-gather hands over an FP8 weight
            w8, amax_w = weight._replace(gemm=fwd), None
        else:
            w8, amax_w = _cast(weight, config.weight, 1, fwd, config, hist_w, scale_w, recompute, st_w)
        if calls is not None and not recompute:
            key = amax_x if amax_x is not None else _sync_amax(tensor_amax(x2))
            _record_call(*calls, key, scale_in, scale_w)
        y = _matmul(x8, transpose_2d(w8), bias=bias)  # built, not dispatched: torch.export traces it

        # The weight-gradient GEMM contracts over tokens (dim 0 of x): a tensorwise x8 is
        # reused there as is; a rowwise or block-scaled one would need the other axis (the
        # tokens), so keep x in hp.
        keep_fp8_input = config.input.tensorwise and not config.weight_grad_in_hp
        # Backward re-casts a tensorwise high-precision weight with this very scale; a
        # rowwise or block-scaled weight is cast along the other axis there (a 128x128 one
        # to the same blocks), so its scale is not kept.
        reuse_w_scale = not isinstance(weight, Float8Tensor) and config.weight.tensorwise
        # The weight-gradient GEMM takes x8 with M innermost: lay the bytes out so now, while
        # the cast writes them (see _column_major).
        ctx.save_for_backward(
            _column_major(x8) if keep_fp8_input else x2, weight, w8._scale if reuse_w_scale else None, amax_x, amax_w
        )
        ctx.config = config
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
            return _Float8LinearFn._backward(ctx, grad_y, saved)
        # create_graph=True: FP8 GEMMs have no derivative (torch._scaled_mm has none), so
        # compute the gradients without a graph and attach a node that refuses a second
        # backward with a message naming the layer, instead of failing deep in autograd.
        with torch.no_grad():
            grads = _Float8LinearFn._backward(ctx, grad_y, saved)
        saved_x, weight = saved[:2]
        present = [i for i, g in enumerate(grads[:3]) if g is not None]
        outs = _NoDoubleBackward.apply(ctx.layer, grad_y, weight, saved_x, *(grads[i] for i in present))
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
        g = grad_y.reshape(-1, grad_y.shape[-1])
        go_cfg = config.grad_output

        # g8: grad_output scaled along N (or per tensor), for grad_x and, per tensor, also
        # for grad_W. A delayed cast measures every backward's grad_output, needed or not.
        g8 = None
        gw_uses_g8 = go_cfg.tensorwise and not config.weight_grad_in_hp
        if need_grad_x or (need_grad_w and gw_uses_g8) or go_cfg.delayed:
            g8, amax_g = _cast(g, go_cfg, 1, bwd, config, hist_go, stats=ctx.stats_go)
            if amax_g is not None:
                push_amax(hist_go, amax_g)
        # The weight-gradient GEMM's copy of g8 (M innermost), taken right at the cast so
        # that inductor writes both layouts from the cast's pass.
        g8_cm = _column_major(g8) if g8 is not None and need_grad_w and gw_uses_g8 else None

        # grad_x = g @ W: contraction over N, so W's scale must be constant along dim 0.
        grad_x = None
        if need_grad_x:
            if isinstance(weight, Float8Tensor):
                w8 = weight._replace(gemm=bwd)
            elif not config.weight.tensorwise:
                w8 = cast_to_float8(
                    weight,
                    config.weight.dtype,
                    **_granularity(config.weight, 0),
                    gemm=bwd,
                    power_of_2_scale=config.weight.power_of_2_scale,
                )
            else:
                # Same scale as in forward: the same FP8 bytes, without keeping them alive.
                w8 = cast_to_float8(weight, config.weight.dtype, scale=w_scale, gemm=bwd)
            grad_x = _matmul(g8, w8).reshape(ctx.x_shape)

        # grad_W = g.t() @ x: contraction over M.
        grad_w = None
        if need_grad_w:
            if config.weight_grad_in_hp:
                grad_w = g.t().to(saved_x.dtype) @ saved_x
            else:
                # Both operands with M innermost (column-major), written by their casts.
                if gw_uses_g8:
                    gt8 = g8_cm._replace(gemm=bwd_w)
                else:
                    # When grad_x was not needed this is the only cast of grad_output: it
                    # then feeds the telemetry.
                    gt8 = _column_major(_cast_to_float8(
                        ctx.stats_go if g8 is None else None,
                        g, go_cfg.dtype, **_granularity(go_cfg, 0), gemm=bwd_w, power_of_2_scale=go_cfg.power_of_2_scale,
                    ))
                if isinstance(saved_x, Float8Tensor):
                    x8 = saved_x._replace(gemm=bwd_w)
                else:
                    x8 = _column_major(cast_to_float8(
                        saved_x,
                        config.input.dtype,
                        **_granularity(config.input, 0),
                        gemm=bwd_w,
                        power_of_2_scale=config.input.power_of_2_scale,
                    ))
                # Written in the weight's dtype (fp32 for fp32 master weights), not bf16:
                # autograd needs the fp32 .grad anyway, and a bf16 output adds a rounding
                # and an upcast pass. Bytes per weight element in eager: tensorwise route
                # 4 (fp32 written once) vs 4 + 2 + 4 (bf16 written, read, fp32 written);
                # post-scale route (a rowwise product with an fp32 output, or any precise
                # one when asked for: gemm.choose_route) fp32 either way until its last
                # pass, then 12 bytes more for bf16. The
                # accuracy is the same either way (grad_W SQNR vs fp64: 28.9 dB, rowwise
                # e4m3, M=256 K=64 N=48 and M=2048 K=512 N=1792), so the bytes decide.
                grad_w = _matmul(gt8.t(), x8, out_dtype=weight.dtype)
            grad_w = grad_w.to(weight.dtype)
        grad_b = g.sum(0) if need_grad_b else None
        # Pushed last: under torch.compile an amax the partitioner recomputes here (the
        # weight's) is then read in the same pass as the weight's re-cast above.
        if amax_x is not None:
            push_amax(hist_in, amax_x)
        if amax_w is not None:
            push_amax(hist_w, amax_w)
        return grad_x, grad_w, grad_b, None, None, None


class _NoDoubleBackward(torch.autograd.Function):
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


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose forward and backward GEMMs run in FP8.

    Parameters are those of ``nn.Linear`` (same names, shapes, dtypes), so state dicts
    move freely between the two. Delayed scaling adds buffers: one amax history per
    operand (``amax_history_input``, ``..._weight``, ``..._grad_output``) and the input and
    weight scales of the current step (``scale_input``, ``scale_weight``), all fp32 and
    all in ``state_dict`` so a resumed run continues bit for bit. The histories grow by
    one entry per backward (see ``_Float8LinearFn``); forwards alone leave them as is.

    With ``config.collect_stats`` the layer also holds ``float8_stats_input``,
    ``..._weight`` and ``..._grad_output``: non-persistent float64 vectors laid out as
    ``CAST_STATS_FIELDS``, overwritten by each cast, NaN until the first one. Read them
    through :func:`f8tensor.float8_stats`; switch them with :meth:`set_collect_stats`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: Float8LinearConfig | None = None,
    ) -> None:
        if dtype is not None and dtype not in HP_DTYPES:
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            raise TypeError(f"Float8Linear parameters must have dtype {allowed}; got dtype={dtype}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = _check_config(config)
        _check_dims(in_features, out_features, self.config)
        if self.config.any_delayed:
            n = self.config.delayed.history_len
            for name in _HISTORY_BUFFERS:
                self.register_buffer(name, torch.zeros(n, dtype=torch.float32, device=device))
            for name in _SCALE_BUFFERS:
                self.register_buffer(name, torch.ones((), dtype=torch.float32, device=device))
            self.register_buffer(_CALL_KEYS, torch.full((_CALLS,), -1.0, device=device), persistent=False)
            self.register_buffer(_CALL_SCALES, torch.ones((_CALLS, 2), device=device), persistent=False)
        if self.config.collect_stats:
            self._register_stats_buffers(device)
        if self.config.enable_fsdp_float8_all_gather:
            self.weight = _fsdp().wrap_weight(self.weight, self.config.weight)

    def _register_stats_buffers(self, device: torch.device | str | None) -> None:
        for name in STATS_BUFFERS:
            empty = torch.full((len(CAST_STATS_FIELDS),), torch.nan, dtype=torch.float64, device=device)
            self.register_buffer(name, empty, persistent=False)

    def set_collect_stats(self, enabled: bool = True) -> None:
        """Switch cast telemetry on (fresh NaN buffers) or off (buffers removed).

        Replaces ``config`` with a copy whose ``collect_stats`` is ``enabled``; a compiled
        model recompiles once (off compiles the telemetry-free graph again). Call between
        steps, never inside forward.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool; got {enabled!r}")
        self.config = dataclasses.replace(self.config, collect_stats=enabled)
        for name in STATS_BUFFERS:
            if name in self._buffers:
                delattr(self, name)
        if enabled:
            self._register_stats_buffers(self.weight.device)

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Float8LinearConfig | None = None) -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameters (the same Parameter objects,
        so an optimizer built before the swap keeps working; with
        ``enable_fsdp_float8_all_gather`` the weight is a new Parameter over the same
        storage, and the optimizer is built after ``fully_shard`` anyway)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float expects an nn.Linear; got {type(linear).__name__}")
        if linear.weight.dtype not in HP_DTYPES:
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            raise TypeError(f"from_float: FP8 casts start from {allowed} weights; got {linear.weight.dtype}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        if new.config.enable_fsdp_float8_all_gather:
            new.weight = _fsdp().wrap_weight(linear.weight, new.config.weight)
        else:
            new.weight = linear.weight
        new.bias = linear.bias
        device = linear.weight.device
        for name, buf in list(new.named_buffers(recurse=False)):
            setattr(new, name, _fresh_state(name, buf, device))
        new.train(linear.training)
        return new

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization, and fresh delayed-scaling and telemetry state.

        The deferred-initialization path (build on ``torch.device("meta")``, ``to_empty``,
        then ``reset_parameters()``, as FSDP2 and torchtitan do) leaves buffers as
        uninitialized memory; this sets them as a newly built layer has them.
        """
        super().reset_parameters()
        with torch.no_grad():
            for name, buf in self._buffers.items():  # empty while nn.Linear.__init__ calls this
                if buf is not None and (name in _DELAYED_BUFFERS or name in STATS_BUFFERS):
                    buf.copy_(_fresh_state(name, buf))

    def _check_input(self, x: object) -> None:
        """What nn.Linear takes, restricted to what FP8 GEMMs can take; said at the entry."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Float8Linear expects a tensor input; got {type(x).__name__}")
        if isinstance(x, Float8Tensor):
            raise TypeError("Float8Linear casts its input itself: pass a high-precision tensor (call .to_hp() first)")
        if not x.is_floating_point() or x.dtype not in HP_DTYPES:
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            hint = (
                " (float64 has no FP8 GEMM on GPUs: convert the input, or keep this layer as nn.Linear)"
                if x.dtype == torch.float64
                else ""
            )
            raise TypeError(f"Float8Linear input must be a floating tensor of dtype {allowed}; got {x.dtype}{hint}")
        if x.dim() == 0:
            raise ValueError("Float8Linear input must have at least one dimension (..., in_features); got a 0-dim tensor")
        if self.weight.dtype not in HP_DTYPES:  # e.g. after model.double()
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            raise TypeError(f"Float8Linear weight must have dtype {allowed}; got {self.weight.dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_with(x, self.weight)

    def _forward_with(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The forward with ``weight`` as the (out, in) matrix (Float8Conv1D passes a view)."""
        bias = self.bias
        device_type = x.device.type if isinstance(x, torch.Tensor) else None
        # Autocast exists for some device types only (not meta): ask only where it does.
        # While compiling, the device is a real one; torch 2.11's dynamo cannot trace
        # torch.amp.is_autocast_available (torch._C._is_autocast_available), so do not ask it.
        if torch.compiler.is_compiling():
            available = device_type != "meta"
        else:
            available = device_type is not None and torch.amp.is_autocast_available(device_type)
        autocast = (
            device_type is not None
            and available
            and torch.is_autocast_enabled(device_type)
            and x.is_floating_point()
        )
        if autocast:
            # What nn.Linear does under autocast: compute in the autocast dtype. The weight
            # stays in its own dtype and is cast to FP8 straight from it.
            dtype = torch.get_autocast_dtype(device_type)
            x = x.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(device_type, enabled=False):
                return self._fp8_forward(x, weight, bias)
        return self._fp8_forward(x, weight, bias)

    def _fp8_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self._check_input(x)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if self.in_features == 0 or self.out_features == 0:
            # Nothing to quantize: an empty product is zeros (plus the bias), as nn.Linear
            # computes it, in high precision.
            return nn.functional.linear(x, weight.to(x.dtype), bias)
        state = None
        if self.config.any_delayed:
            state = tuple(getattr(self, name) for name in _DELAYED_BUFFERS)
        stats = tuple(getattr(self, name) for name in STATS_BUFFERS) if self.config.collect_stats else None
        return _Float8LinearFn.apply(x, weight, bias, self.config, state, stats)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # A plain nn.Linear checkpoint has no delayed-scaling state: start those buffers
        # fresh (the history of the weights being replaced says nothing about the loaded
        # ones) instead of failing a strict load. `state_dict` is load_state_dict's own copy.
        # (Non-persistent buffers, the telemetry, are never loaded.) The fresh buffers go
        # where the loaded weight is: load_state_dict(assign=True) into a model built on
        # meta would otherwise keep them there.
        loaded = state_dict.get(prefix + "weight")
        device = loaded.device if isinstance(loaded, torch.Tensor) else None
        for name, buf in self.named_buffers(recurse=False):
            if name not in self._non_persistent_buffers_set:
                state_dict.setdefault(prefix + name, _fresh_state(name, buf, device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if device is not None and local_metadata.get("assign_to_params_buffers", False):
            for name in self._non_persistent_buffers_set & set(self._buffers):
                buf = self._buffers[name]
                if buf is not None and buf.device != device:
                    self._buffers[name] = _fresh_state(name, buf, device)
        self._keep_fsdp_weight()

    def _keep_fsdp_weight(self) -> None:
        """Re-wrap a weight that was replaced by a plain tensor (load_state_dict(assign=True),
        torch.save of the whole model, copy.deepcopy) while the config asks for FP8 all-gather:
        the 1-byte all-gather must not silently turn off."""
        weight = self._parameters.get("weight")
        if self.config.enable_fsdp_float8_all_gather and weight is not None:
            fsdp = _fsdp()
            # A DTensor (after fully_shard) is FSDP's to manage.
            if not isinstance(weight, (fsdp.Float8AllGatherWeight, fsdp.DTensor)):
                self.weight = fsdp.wrap_weight(weight, self.config.weight)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._keep_fsdp_weight()

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .bfloat16() / .half() cast every floating buffer, but the
        # delayed-scaling state is fp32 by the scale semantics (a bf16 history rounds the
        # amax, a bf16 scale is refused by _scaled_mm): it follows device moves and keeps
        # its dtype.
        state = {name: self._buffers[name] for name in _DELAYED_BUFFERS if name in self._buffers}
        super()._apply(fn, recurse)
        for name, old in state.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        c = self.config
        ops = ", ".join(
            f"{role}={str(cc.dtype).removeprefix('torch.float8_')}/{cc.granularity.value}/{cc.scaling.value}"
            for role, cc in (("input", c.input), ("weight", c.weight), ("grad_output", c.grad_output))
        )
        extra = (", weight_grad_in_hp" if c.weight_grad_in_hp else "") + (", collect_stats" if c.collect_stats else "")
        if c.enable_fsdp_float8_all_gather:
            extra += ", fsdp_float8_all_gather"
        return f"{super().extra_repr()}, {ops}{extra}"


def _fsdp():
    """``f8tensor.fsdp``, imported when a layer asks for FP8 all-gather.

    The one reference from linear to fsdp, which sits above it (formats <- scaling <-
    tensor <- ops <- linear <- fsdp). It is resolved at call time, so importing this
    module never imports fsdp, and fsdp may use anything here without a cycle. The
    wrapper belongs in fsdp.py with the FSDP hooks it implements; linear only decides,
    from its config, that its weight gets one.
    """
    from f8tensor import fsdp

    return fsdp


def _moe():
    """``f8tensor.moe``, imported when a model is converted (it builds on this module)."""
    from f8tensor import moe

    return moe


def _check_config(config: Float8LinearConfig | None) -> Float8LinearConfig:
    if config is None:
        return Float8LinearConfig()
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(f"config must be a Float8LinearConfig (e.g. Float8LinearConfig.from_recipe('rowwise')); got {type(config).__name__}")
    return config


def _dims_ok(in_features: int, out_features: int, config: Float8LinearConfig) -> bool:
    return config.pad_inner_dim or (in_features % _ALIGN == 0 and out_features % _ALIGN == 0)


def _check_dims(in_features: int, out_features: int, config: Float8LinearConfig) -> None:
    if not _dims_ok(in_features, out_features, config):
        raise ValueError(
            f"Float8Linear({in_features}, {out_features}): FP8 GEMMs need in_features and out_features "
            f"to be multiples of {_ALIGN}; pass a config with pad_inner_dim=True to pad them with zeros"
        )


# Modules that compute exactly a linear map with a transposed weight, (in, out), named by
# where they are defined: the core imports none of the libraries they come from.
# Hugging Face's Conv1D (GPT-2, GPT-J's ancestors, ...): forward = addmm(bias, x, weight).
TRANSPOSED_LINEAR_CLASSES: frozenset[tuple[str, str]] = frozenset({("transformers.pytorch_utils", "Conv1D")})

# Why a candidate stayed in high precision, as the summary line words it.
_SKIP_FILTER = "rejected by module_filter_fn"
_SKIP_DIMS = f"dims not multiples of {_ALIGN}"
_SKIP_FORWARD = "nn.Linear subclass overriding forward"
_SKIP_FSDP = "Conv1D with FP8 all-gather (needs an (out, in) weight)"


def _is_transposed_linear(mod: nn.Module) -> bool:
    cls = type(mod)
    if (cls.__module__, cls.__qualname__) not in TRANSPOSED_LINEAR_CLASSES:
        return False
    weight = getattr(mod, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


class Float8Conv1D(Float8Linear):
    """Hugging Face ``Conv1D`` in FP8: ``y = x @ weight + bias`` with ``weight`` of shape
    ``(in_features, out_features)``.

    The parameter keeps Conv1D's layout (and is the very same Parameter object), so
    ``state_dict``, ``save_pretrained`` and an optimizer built before the swap are
    unaffected; the FP8 GEMMs see its transpose, the ``(out, in)`` weight of a linear.
    """

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: Float8LinearConfig | None = None) -> Float8Conv1D:
        if not _is_transposed_linear(conv):
            raise TypeError(f"from_conv1d expects a transformers Conv1D; got {type(conv).__name__}")
        in_features, out_features = conv.weight.shape
        with torch.device("meta"):
            new = cls(in_features, out_features, bias=conv.bias is not None, config=config)
        if new.config.enable_fsdp_float8_all_gather:
            raise ValueError("Float8Conv1D: FP8 all-gather needs an (out, in) weight; use enable_fsdp_float8_all_gather=False")
        new.weight, new.bias = conv.weight, conv.bias
        device = conv.weight.device
        for name, buf in list(new.named_buffers(recurse=False)):
            fill = torch.full_like(buf, torch.nan, device=device) if name in STATS_BUFFERS else _fresh_state(name, buf, device)
            setattr(new, name, fill)
        new.train(conv.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A transposed view: the gradient lands in the parameter's own (in, out) layout.
        return self._forward_with(x, self.weight.t())


_FLOAT8_SUBCLASSES: dict[type, type] = {}


def _float8_subclass(cls: type) -> type:
    """``Float8Linear`` mixed into an ``nn.Linear`` subclass that keeps ``nn.Linear.forward``.

    The converted layer stays an instance of ``cls`` (methods such as a library's
    ``init_weights`` and ``isinstance`` checks keep working) while ``Float8Linear``'s
    forward comes first in the MRO. One class per ``cls``, cached.
    """
    if cls is nn.Linear:
        return Float8Linear
    if cls not in _FLOAT8_SUBCLASSES:
        _FLOAT8_SUBCLASSES[cls] = type(f"Float8{cls.__name__}", (Float8Linear, cls), {"__module__": cls.__module__})
    return _FLOAT8_SUBCLASSES[cls]


def _convert_linear(mod: nn.Linear, config: Float8LinearConfig) -> Float8Linear:
    new = Float8Linear.from_float(mod, config)
    if type(mod) is not nn.Linear:
        new.__class__ = _float8_subclass(type(mod))
        # The subclass's own attributes (set by its __init__ or its library), as they were.
        for key, value in vars(mod).items():
            vars(new).setdefault(key, value)
    return new


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap every module that computes a linear map for its FP8 twin, in place.

    Converted: ``nn.Linear`` and its subclasses that keep ``nn.Linear.forward`` (e.g.
    torchtitan's ``Linear``; the new layer is a ``Float8Linear`` that is still an
    instance of the subclass), and Hugging Face's ``Conv1D`` (as :class:`Float8Conv1D`,
    weight layout kept; see ``TRANSPOSED_LINEAR_CLASSES``). Left alone, and reported:
    ``nn.Linear`` subclasses that override ``forward`` (they may not compute
    ``x @ W.t() + b``), layers ``module_filter_fn`` rejects, and layers whose dimensions
    FP8 GEMMs cannot take (not multiples of 16) unless ``config.pad_inner_dim``.

    ``module_filter_fn(mod, fqn) -> bool`` chooses among the candidates (``fqn`` is the
    dotted name, e.g. ``"layers.0.mlp.down_proj"``). Logs one summary line on the
    ``"f8tensor"`` logger (converted N of M linear layers, skipped with reasons) and
    warns when nothing was converted. Returns ``module`` (or the new layer, when
    ``module`` is itself a linear); the names of the converted layers are on the result
    as ``float8_converted_fqns`` (a tuple; ``""`` for a bare layer).

    Mixture-of-experts weights (3D parameters of an experts module, as transformers stores
    them) become :class:`~f8tensor.moe.Float8ExpertWeight`: their grouped, batched and
    per-expert GEMMs run in FP8 (see :mod:`f8tensor.moe`; routers stay high precision).
    ``experts_filter_fn(experts_module, param_fqn) -> bool`` chooses which; return False
    for all to keep every expert in high precision. Their names join the summary and
    ``float8_converted_fqns``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_to_float8_training expects an nn.Module; got {type(module).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be a callable (module, fqn) -> bool or None; got {module_filter_fn!r}")
    config = _check_config(config)
    # Every converter appends the names it converted here; the summary reports them all.
    converted: list[str] = []
    skipped: dict[str, list[str]] = {}
    candidates = 0

    def convert_one(mod: nn.Module, fqn: str) -> nn.Module | None:
        """The FP8 replacement of ``mod``, or None (not a linear, or skipped)."""
        nonlocal candidates
        if isinstance(mod, Float8Linear):
            return None
        transposed = _is_transposed_linear(mod)
        if not (transposed or isinstance(mod, nn.Linear)):
            return None
        candidates += 1
        name = fqn or "<root>"
        if not transposed and type(mod).forward is not nn.Linear.forward:
            skipped.setdefault(_SKIP_FORWARD, []).append(name)
            return None
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            skipped.setdefault(_SKIP_FILTER, []).append(name)
            return None
        in_features, out_features = mod.weight.shape if transposed else (mod.in_features, mod.out_features)
        if not _dims_ok(in_features, out_features, config):
            logger.warning(
                "f8tensor: left %s (%d -> %d) in high precision: FP8 GEMMs need dimensions that are "
                "multiples of %d (set pad_inner_dim=True to pad instead)",
                name, in_features, out_features, _ALIGN,
            )
            skipped.setdefault(_SKIP_DIMS, []).append(name)
            return None
        if transposed and config.enable_fsdp_float8_all_gather:
            skipped.setdefault(_SKIP_FSDP, []).append(name)
            return None
        converted.append(fqn)
        return Float8Conv1D.from_conv1d(mod, config) if transposed else _convert_linear(mod, config)

    root = convert_one(module, "")
    if root is None:
        for fqn, mod in list(module.named_modules()):
            for name, child in list(mod.named_children()):
                new = convert_one(child, f"{fqn}.{name}" if fqn else name)
                if new is not None:
                    setattr(mod, name, new)
    # FP8 expert weights (3D parameters of MoE experts modules): their own converter.
    experts = [] if root is not None else _moe().convert_experts_to_float8(module, config, experts_filter_fn)
    converted.extend(experts)
    if root is None and config.enable_fsdp_float8_all_gather:
        _fsdp().keep_tied_weights_tied(module)
    result = module if root is None else root
    _report_conversion(converted, skipped, candidates, len(experts))
    result.float8_converted_fqns = tuple(converted)
    return result


def _report_conversion(converted: list[str], skipped: dict[str, list[str]], candidates: int, experts: int = 0) -> None:
    """One summary line; a warning (also through ``warnings``) when nothing converted."""

    def names(fqns: list[str]) -> str:
        return ", ".join(fqns[:4]) + (f", ... ({len(fqns) - 4} more)" if len(fqns) > 4 else "")

    reasons = "; ".join(f"{len(fqns)} {reason} [{names(fqns)}]" for reason, fqns in skipped.items())
    line = f"f8tensor: converted {len(converted) - experts} of {candidates} linear layers to FP8"
    line += f" and {experts} expert weights" if experts else ""
    line += f"; skipped {reasons}" if reasons else ""
    if converted:
        logger.info(line)
        return
    if not candidates:
        line += ": the model has no nn.Linear (or Hugging Face Conv1D) layer"
    logger.warning(line)
    warnings.warn(line + "; the model trains in high precision", UserWarning, stacklevel=3)
