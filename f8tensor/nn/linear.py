"""Float8Linear and Float8Conv1D: linear layers whose three GEMMs run in FP8.

Each operand is cast per the :class:`Float8LinearConfig` in
:class:`f8tensor.nn.linear_autograd.QuantizedLinearFn`. The layers own their state
(delayed-scaling and telemetry buffers, an FP8 all-gather weight); on DTensors the forward
hands over to the product :mod:`f8tensor.distributed.dtensor` registers (:func:`set_dtensor_linear`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from f8tensor.compat import dtensor_local
from f8tensor.distributed.fsdp import DelayedWeightSource, DTensor, Float8AllGatherWeight, wrap_weight
from f8tensor.gemm.rules import ALIGN, FP4_ALIGN
from f8tensor.kernels import CAST_STATS_FIELDS
from f8tensor.nn.delayed_state import (
    DELAYED_BUFFERS,
    DELAYED_STATE_KEYS,
    adopt_part_buffers,
    check_delayed_state,
    delayed_buffer_shapes,
    delayed_part,
    delayed_state_of,
    fresh_delayed_buffer,
    load_delayed_state,
)
from f8tensor.nn.linear_autograd import LinearArgs, QuantizedLinearFn, linear_plan, plan_number, planned
from f8tensor.nn.weight_cache import WeightCasts, drop_weight_casts, weight_casts_of
from f8tensor.nn.weight_precast import PRECAST_BUFFERS, check_precast, precast_refusal, precast_weight
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.quant.formats import HP_DTYPES
from f8tensor.quant.quantizers import DelayedState, StatsBuffers, delayed_views
from f8tensor.tensor.float8 import Float8Tensor

__all__ = [
    "STATS_BUFFERS",
    "STATS_ROLES",
    "TRANSPOSED_LINEAR_CLASSES",
    "Float8Conv1D",
    "Float8Linear",
    "WeightFromMethod",
    "fresh_layer_buffer",
    "set_dtensor_linear",
]

# Telemetry: separate buffers, not rows of one (a row write in backward trips torch
# 2.13's default partitioner). Not persistent.
STATS_ROLES = ("input", "weight", "grad_output")
STATS_BUFFERS = StatsBuffers._fields


def fresh_layer_buffer(name: str, like: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A buffer as a newly built layer has it: NaN telemetry, or fresh delayed-scaling state."""
    if name in STATS_BUFFERS:
        return torch.full_like(like, torch.nan, device=device)
    return fresh_delayed_buffer(name, like, device)


#: Why an FP4 or per-GEMM-format layer refuses tensor/sequence parallel.
NOT_ON_DTENSORS = (
    "FP4 and per-GEMM-format configs do not run on DTensors (tensor or sequence parallel) yet; "
    "use an FP8 recipe for the parallelized layers, or leave them unparallelized"
)

#: The linear product on DTensors, registered from above by :mod:`f8tensor.distributed.dtensor`.
_DTENSOR_LINEAR: list[Callable[[Any, Any, Any, LinearArgs], torch.Tensor]] = []


def set_dtensor_linear(fn: Callable[[Any, Any, Any, LinearArgs], torch.Tensor]) -> None:
    """Register ``fn`` as the product a ``Float8Linear`` runs on DTensor operands."""
    _DTENSOR_LINEAR[:] = [fn]


def _dtensor_linear_of() -> Callable[[Any, Any, Any, LinearArgs], torch.Tensor]:
    if not _DTENSOR_LINEAR:
        raise RuntimeError(
            "Float8Linear got a DTensor operand but no DTensor product is registered: import "
            "f8tensor.distributed.dtensor (import f8tensor does)"
        )
    return _DTENSOR_LINEAR[0]


def _describe_cast(config: Float8LinearConfig) -> str:
    cast = config.input
    return f"{cast.dtype} {cast.granularity} {cast.scaling.value}"


def _is_own_input_cast(x: Float8Tensor, config: Float8LinearConfig) -> bool:
    """``x`` carries the FP8 dtype and blocks of ``config``'s (dynamic) input cast."""
    cast = config.input
    if cast.delayed or x._data.dtype != cast.dtype or x.dim() == 0:
        return False
    block = cast.operand_spec(x.dim() - 1, ndim=x.dim()).block
    return x._block == (block or (0,) * x.dim())


def _check_input(x: object, weight: torch.Tensor, layer: Float8Linear) -> None:
    """What nn.Linear takes, restricted to what FP8 GEMMs can take; said at the entry."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Float8Linear expects a tensor input; got {type(x).__name__}")
    f8 = dtensor_local(x) if isinstance(x, DTensor) and isinstance(dtensor_local(x), Float8Tensor) else x
    if isinstance(f8, Float8Tensor):
        # Only as this layer's own input cast writes it (distributed.tp); never re-cast. The
        # layer's config, not its plan's: traced, the plan is a constant whose methods dynamo
        # cannot call.
        config = layer._config
        if not _is_own_input_cast(f8, config):
            raise TypeError(
                "Float8Linear casts its input itself: pass a high-precision tensor (call .to_hp() first). "
                f"Got a Float8Tensor ({f8._data.dtype}, blocks {f8._block}) where this layer's input cast is "
                f"{_describe_cast(config)}; an input gathered by PrepareFloat8ModuleInput must be cast "
                "as its consumers cast it: pass config= this layer's Float8LinearConfig to "
                "PrepareFloat8ModuleInput (or leave config unset: it then follows the module's layers)"
            )
        return
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
    # The weight's shape, not the layer's in_features: traced, a module attribute read is a
    # guard per layer. Also fixes in_features under dynamic=True: torch 2.11's dynamo asserts
    # if first read inside the autograd Function.
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"Float8Linear input must have in_features={weight.shape[1]} as its last dimension; got shape {tuple(x.shape)}"
        )
    if weight.dtype not in HP_DTYPES:  # e.g. after model.double()
        allowed = ", ".join(str(d) for d in HP_DTYPES)
        raise TypeError(f"Float8Linear weight must have dtype {allowed}; got {weight.dtype}")


def _weight_casts(layer: Float8Linear) -> tuple[WeightCasts, torch.Tensor] | None:
    """(cache, parameter) inside a reuse_weight_casts scope for a cacheable weight; else None."""
    casts = weight_casts_of(layer)
    if casts is None:
        return None
    param = layer.weight
    if not WeightCasts.cacheable(param):
        return None
    return casts, param


class WeightFromMethod:
    """Mixin for a Float8Linear whose forward multiplies ``self.weight_matrix()``, not ``self.weight``."""

    precasts_weight = False

    def weight_matrix(self) -> torch.Tensor:
        """The (out, in) matrix the forward multiplies."""
        raise NotImplementedError


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose forward and backward GEMMs run in FP8.

    Parameters are ``nn.Linear``'s, so state dicts move freely between the two. Delayed
    scaling adds fp32 buffers ``amax_history_{input,weight,grad_output}`` and
    ``scale_{input,weight}``, saved so a resumed run continues bit for bit; histories grow
    once per backward, never in forward. ``config.collect_stats`` adds non-persistent
    ``float8_stats_*`` buffers, NaN until measured (:func:`f8tensor.float8_stats`,
    :meth:`set_collect_stats`).

    Raises:
        TypeError: ``config`` is not a :class:`~f8tensor.Float8LinearConfig`, or a weight dtype
            other than bf16, fp16 or fp32.
        ValueError: dimensions not multiples of 16 without ``pad_inner_dim``.

    Example:
        >>> from f8tensor import Float8Linear, Float8LinearConfig
        >>> layer = Float8Linear(32, 64, config=Float8LinearConfig.from_recipe("rowwise"))
        >>> layer(torch.randn(8, 32)).shape
        torch.Size([8, 64])
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
        self.config = check_config(config)
        _check_dims(in_features, out_features, self.config)
        if self.config.any_delayed:
            self._register_delayed_buffers(device)
        if self.config.collect_stats:
            self._register_stats_buffers(device)
        if self.config.enable_fsdp_float8_all_gather:
            self.weight = wrap_weight(self.weight, self.config.weight, self._delayed_source())

    @property
    def config(self) -> Float8LinearConfig:
        """The layer's :class:`~f8tensor.Float8LinearConfig`.

        Assigning one re-plans the calls and adds or drops the delayed and telemetry buffers it
        reads (fresh, as a newly built layer has them; kept where the new config reads them alike).
        Raises ValueError, before anything changes, for dims the config cannot take, or for a
        change of ``enable_fsdp_float8_all_gather`` (or, while on, of the weight's cast).
        """
        return self._config

    @config.setter
    def config(self, config: Float8LinearConfig) -> None:
        # The plan is all a call reads of the config: derived here, never per call.
        config = check_config(config)
        old: Float8LinearConfig | None = self.__dict__.get("_config")
        changed = old is not None and old != config
        if changed:
            self.check_new_config(config)
        precast = PRECAST_BUFFERS[0] in self._buffers
        refusal = precast_refusal(self, config) if precast else None
        if refusal is not None:
            raise ValueError(
                f"{type(self).__name__}.config: per_step_weight_casts serves this layer and cannot with the new "
                f"config ({refusal}); call remove() on its handle first"
            )
        self._config = config
        self._plan_number = plan_number(config, precast)
        if changed:
            self._match_buffers(config)
            if precast:
                precast_weight(self)

    def check_new_config(self, config: Float8LinearConfig) -> None:
        """Raise ValueError if ``config`` cannot replace this built layer's (nothing changes).

        Refused: dims its GEMMs cannot take, FP8 all-gather that does not match the weight
        (wrapped or not), or, while wrapped, another weight cast or delayed setting.
        """
        _check_dims(self.in_features, self.out_features, config)
        weight = self._parameters.get("weight")
        local = dtensor_local(weight) if isinstance(weight, DTensor) else weight
        wrapped = isinstance(local, Float8AllGatherWeight)
        if config.enable_fsdp_float8_all_gather != wrapped or (
            wrapped and (config.weight != self.config.weight or config.delayed != self.config.delayed)
        ):
            raise ValueError(
                f"{type(self).__name__}.config: FP8 all-gather wraps the weight with its cast when the layer is "
                f"built; enable_fsdp_float8_all_gather (the weight is {'' if wrapped else 'not '}wrapped) and, "
                f"while it is on, the weight's cast cannot change afterwards. Build the layer with the new config "
                f"(Float8Linear.from_float of an nn.Linear)"
            )

    def _match_buffers(self, config: Float8LinearConfig) -> None:
        """The delayed and telemetry buffers ``config`` reads, as a newly built layer has them (kept if alike)."""
        device = self.weight.device
        histories = self._buffers.get(DELAYED_BUFFERS[0])
        if histories is not None and (not config.any_delayed or histories.shape[1] != config.delayed.history_len):
            for name in DELAYED_BUFFERS:
                delattr(self, name)
        if config.any_delayed and DELAYED_BUFFERS[0] not in self._buffers:
            self._register_delayed_buffers(device)
        if config.collect_stats != (STATS_BUFFERS[0] in self._buffers):
            for name in STATS_BUFFERS:
                if name in self._buffers:
                    delattr(self, name)
            if config.collect_stats:
                self._register_stats_buffers(device)
        drop_weight_casts(self)

    def _register_delayed_buffers(self, device: torch.device | str | None) -> None:
        for name, shape in zip(DELAYED_BUFFERS, delayed_buffer_shapes(self.config.delayed.history_len)):
            self.register_buffer(name, fresh_delayed_buffer(name, torch.empty(shape, device=device)), persistent=False)

    def _register_stats_buffers(self, device: torch.device | str | None) -> None:
        for name in STATS_BUFFERS:
            empty = torch.full((len(CAST_STATS_FIELDS),), torch.nan, dtype=torch.float64, device=device)
            self.register_buffer(name, empty, persistent=False)

    def set_collect_stats(self, enabled: bool = True) -> None:
        """Switch cast telemetry on (fresh NaN buffers) or off; call between steps, not in forward."""
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
        """A Float8Linear sharing ``linear``'s Parameter objects (an existing optimizer keeps working)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float expects an nn.Linear; got {type(linear).__name__}")
        if linear.weight.dtype not in HP_DTYPES:
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            raise TypeError(f"from_float: FP8 casts start from {allowed} weights; got {linear.weight.dtype}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        if new.config.enable_fsdp_float8_all_gather:
            new.weight = wrap_weight(linear.weight, new.config.weight, new._delayed_source())
        else:
            new.weight = linear.weight
        new.bias = linear.bias
        device = linear.weight.device
        for name, buf in list(new.named_buffers(recurse=False)):
            setattr(new, name, fresh_layer_buffer(name, buf, device))
        new.train(linear.training)
        return new

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization, and fresh buffers (for meta-device deferred init)."""
        super().reset_parameters()
        with torch.no_grad():
            for name, buf in self._buffers.items():  # empty while nn.Linear.__init__ calls this
                if buf is not None and (name in DELAYED_BUFFERS or name in STATS_BUFFERS):
                    buf.copy_(fresh_layer_buffer(name, buf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Float8Conv1D's weight is (in, out): the GEMMs see a transposed view, so the gradient
        # lands in the parameter's own layout. A type test, not a method: traced, each method
        # looked up on a layer is a guard.
        if isinstance(self, Float8Conv1D):
            weight = self.weight.t()
        elif isinstance(self, WeightFromMethod):
            weight = self.weight_matrix()
        else:
            weight = self.weight
        bias: torch.Tensor | None = self.bias  # type: ignore[assignment]  # not typing.cast: a call, and traced a guard
        # Not for meta; not while compiling (torch 2.11 cannot trace is_autocast_available).
        compiling = torch.compiler.is_compiling()
        if isinstance(x, torch.Tensor):
            device_type = x.device.type
            available = device_type != "meta" if compiling else torch.amp.is_autocast_available(device_type)
            if available and torch.is_autocast_enabled(device_type) and x.is_floating_point():
                # As nn.Linear under autocast; the weight is cast to FP8 from its own dtype, the
                # bias to the input's below.
                with torch.autocast(device_type, enabled=False):
                    return self.forward(x.to(torch.get_autocast_dtype(device_type)))
        plan = planned(self._plan_number)
        if plan.uses_gemm_formats and compiling:
            # Per-GEMM formats call the config's methods, which dynamo cannot on a constant:
            # traced, their plan is derived from the config (guarded field by field).
            plan = linear_plan(self._config)
        _check_input(x, weight, self)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if weight.numel() == 0:
            # An empty product: nn.Linear's, in high precision.
            return nn.functional.linear(x, weight.to(x.dtype), bias)
        delayed: DelayedState | None = None
        if plan.any_delayed:  # not getattr: traced, Module.__getattr__ guards three dicts
            buffers = self._buffers
            delayed = (buffers["delayed_amax_history"], buffers["delayed_step"])  # type: ignore[assignment]  # registered
        stats = StatsBuffers(*(getattr(self, name) for name in STATS_BUFFERS)) if plan.collect_stats else None
        on_dtensors = isinstance(x, DTensor) or isinstance(weight, DTensor) or isinstance(bias, DTensor)
        if plan.uses_gemm_formats:
            if on_dtensors:
                raise NotImplementedError(f"Float8Linear: {NOT_ON_DTENSORS}")
            return QuantizedLinearFn.apply(x, weight, bias, LinearArgs(plan.config, None, stats, None, None, plan))
        # A delayed weight gathered in FP8 by FSDP2: its shard's amax, left here by the gather.
        weight_amax = self.__dict__.get("fsdp_weight_amax") if plan.gathers_delayed_weight else None
        if on_dtensors:
            return _dtensor_linear_of()(
                x, weight, bias, LinearArgs(self._config, delayed, stats, weight_amax, None, None)
            )
        casts = _weight_casts(self) if plan.caches_weight and not compiling else None  # an eager cache
        precast: Any = None
        if plan.precast_weight:  # cast once per step (per_step_weight_casts)
            buffers = self._buffers  # not getattr: traced, Module.__getattr__ guards three dicts
            precast = (buffers["fp8_weight_data"], buffers["fp8_weight_scale"])
            if not compiling:
                check_precast(self, weight)
        return QuantizedLinearFn.apply(
            x, weight, bias, LinearArgs(plan.config, delayed, stats, weight_amax, casts, plan, precast)
        )

    #: Opts in to f8tensor.reuse_weight_casts.
    reuses_weight_casts = True
    #: Opts in to f8tensor.per_step_weight_casts (its forward multiplies ``self.weight``).
    precasts_weight = True

    amax_history_input = delayed_part(0)
    amax_history_weight = delayed_part(1)
    amax_history_grad_output = delayed_part(2)
    scale_input = delayed_part(3)
    scale_weight = delayed_part(4)
    delayed_calls = delayed_part(5)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A module never learns whether the load is strict. A plain nn.Linear checkpoint (weight,
        # no delayed state) starts the buffers fresh, not missing, so a strict load works;
        # otherwise what is lacking stays and is reported missing (a partial load touches
        # nothing it does not name). Fresh buffers go where the loaded weight is (assign=True on meta).
        loaded = state_dict.get(prefix + "weight")
        device = loaded.device if isinstance(loaded, torch.Tensor) else None
        state = delayed_state_of(self)
        keys = [prefix + name for name in DELAYED_STATE_KEYS] if state is not None else []
        fresh = prefix + "weight" in state_dict and not any(key in state_dict for key in keys)
        check_delayed_state(state_dict, prefix)
        # The delayed state's parts, loaded below (not buffers: super would call them unexpected).
        parts = {key: state_dict.pop(key) for key in keys if key in state_dict}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if device is not None and local_metadata.get("assign_to_params_buffers", False):
            for name in self._non_persistent_buffers_set & set(self._buffers):
                kept = self._buffers[name]
                if kept is not None and kept.device != device:
                    self._buffers[name] = fresh_layer_buffer(name, kept, device)
        if state is not None:  # read again: assign=True may have replaced the buffers above
            load_delayed_state(delayed_state_of(self), parts, keys, fresh, missing_keys, error_msgs)  # type: ignore[arg-type]
        self._keep_fsdp_weight()
        drop_weight_casts(self)
        if PRECAST_BUFFERS[0] in self._buffers:
            precast_weight(self)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # Copies, each its own tensor as a buffer would be (views of one storage are refused by
        # safetensors); keep_vars: the live views.
        for name, view in self.float8_state().items():
            destination[prefix + name] = view if keep_vars else view.detach().clone()

    def float8_state(self) -> dict[str, torch.Tensor]:
        """The layer's state-dict entries beyond ``nn.Linear``'s (delayed scaling's), as live views."""
        state = delayed_state_of(self)
        return {} if state is None else dict(zip(DELAYED_STATE_KEYS, delayed_views(state)))

    def _keep_fsdp_weight(self) -> None:
        """Re-wrap a weight replaced by a plain tensor: FP8 all-gather must not silently turn off."""
        weight = self._parameters.get("weight")
        if isinstance(weight, Float8AllGatherWeight) and weight._source is not None:
            # A copied or unpickled layer: its weight reads this layer's history, not the original's.
            weight._source = self._delayed_source()
        # A DTensor (after fully_shard) is FSDP's to manage.
        managed = isinstance(weight, (Float8AllGatherWeight, DTensor))
        if self.config.enable_fsdp_float8_all_gather and weight is not None and not managed:
            self.weight = wrap_weight(weight, self.config.weight, self._delayed_source())

    def _delayed_source(self) -> DelayedWeightSource | None:
        """What an FP8 all-gather of a delayed-scaled weight reads (this layer's history)."""
        if not self.config.weight.delayed:
            return None
        return DelayedWeightSource(self, self.config.delayed.reduction, self.config.delayed.margin)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        adopt_part_buffers(self)
        # A layer pickled before the plan keeps its config in __dict__: re-plan from it either way
        # (a pickled plan number is another process's).
        self.__dict__.pop("_plan", None)
        self.config = self.__dict__.pop("config", None) or self._config
        self._keep_fsdp_weight()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Float8Linear:
        # Delayed state stays fp32 through model.to(dtype) (a bf16 history rounds the amax,
        # _scaled_mm refuses a bf16 scale): it follows device moves only.
        state = {name: buf for name in DELAYED_BUFFERS if (buf := self._buffers.get(name)) is not None}
        self._check_weight_dtype_change(fn)
        drop_weight_casts(self)
        super()._apply(fn, recurse)
        for name, old in state.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        if PRECAST_BUFFERS[0] in self._buffers:
            precast_weight(self)  # moved or converted: cast again, FP8 buffers fresh
        return self

    def _check_weight_dtype_change(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Refuse, before anything changes, converting an FP8 all-gather weight to a non-hp dtype.

        ``fn`` is probed on an empty tensor of the weight's dtype and device.
        """
        weight = self._parameters.get("weight")
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        if not isinstance(local, Float8AllGatherWeight):
            return
        probe = fn(torch.empty(0, dtype=local.dtype, device=local.device))
        if isinstance(probe, torch.Tensor) and probe.dtype != local.dtype and probe.dtype not in HP_DTYPES:
            raise TypeError(
                f"{type(self).__name__}: its weight is an FP8 all-gather weight (enable_fsdp_float8_all_gather=True) "
                f"that holds a bf16, fp16 or fp32 tensor (what FP8 casts start from); cannot convert it to "
                f"{probe.dtype} (e.g. model.double()). Allowed: model.to(torch.bfloat16 / torch.float16 / "
                "torch.float32), or change the dtype before converting to FP8."
            )

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


def check_config(config: Float8LinearConfig | None) -> Float8LinearConfig:
    if config is None:
        return Float8LinearConfig()
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(
            f"config must be a Float8LinearConfig (e.g. Float8LinearConfig.from_recipe('rowwise')); got {type(config).__name__}"
        )
    return config


def dims_ok(in_features: int, out_features: int, config: Float8LinearConfig) -> bool:
    if config.any_fp4:
        return in_features % FP4_ALIGN == 0 and out_features % FP4_ALIGN == 0
    return config.pad_inner_dim or (in_features % ALIGN == 0 and out_features % ALIGN == 0)


def _check_dims(in_features: int, out_features: int, config: Float8LinearConfig) -> None:
    if not dims_ok(in_features, out_features, config):
        if config.any_fp4:
            raise ValueError(
                f"Float8Linear({in_features}, {out_features}): FP4 casts need in_features and out_features "
                f"to be multiples of {FP4_ALIGN} (whole NVFP4/MXFP4 blocks); keep this layer out of the conversion"
            )
        raise ValueError(
            f"Float8Linear({in_features}, {out_features}): FP8 GEMMs need in_features and out_features "
            f"to be multiples of {ALIGN}; pass a config with pad_inner_dim=True to pad them with zeros"
        )


# Linear maps with an (in, out) weight, named by module: the core imports none of them.
TRANSPOSED_LINEAR_CLASSES: frozenset[tuple[str, str]] = frozenset({("transformers.pytorch_utils", "Conv1D")})


def is_transposed_linear(mod: nn.Module) -> bool:
    cls = type(mod)
    if (cls.__module__, cls.__qualname__) not in TRANSPOSED_LINEAR_CLASSES:
        return False
    weight = getattr(mod, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


class Float8Conv1D(Float8Linear):
    """Hugging Face ``Conv1D`` in FP8: ``y = x @ weight + bias``, ``weight`` (in, out).

    The Parameter keeps Conv1D's layout (the very same object); the GEMMs see its transpose.
    """

    precasts_weight = False

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: Float8LinearConfig | None = None) -> Float8Conv1D:
        if not is_transposed_linear(conv):
            raise TypeError(f"from_conv1d expects a transformers Conv1D; got {type(conv).__name__}")
        weight, bias = cast(nn.Parameter, conv.weight), cast("nn.Parameter | None", conv.bias)
        in_features, out_features = weight.shape
        with torch.device("meta"):
            new = cls(in_features, out_features, bias=bias is not None, config=config)
        if new.config.enable_fsdp_float8_all_gather:
            raise ValueError(
                "Float8Conv1D: FP8 all-gather needs an (out, in) weight; use enable_fsdp_float8_all_gather=False"
            )
        new.weight, new.bias = weight, bias  # type: ignore[assignment]  # nn.Linear's bias may be None
        device = weight.device
        for name, buf in list(new.named_buffers(recurse=False)):
            setattr(new, name, fresh_layer_buffer(name, buf, device))
        new.train(conv.training)
        return new
