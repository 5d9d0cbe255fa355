"""Weight casts made once per optimizer step (:func:`per_step_weight_casts`), not per call.

Invariant: an eager forward never multiplies a stale cast (it recasts a weight changed
since); steps of the handle's optimizer, loads and moves recast; a compiled forward cannot
tell, so other changes need ``refresh()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from f8tensor.compat import version_counter
from f8tensor.quant.config import DEFAULT_GEMM
from f8tensor.quant.quantizers import cast_operand, quantize, role_plan

__all__ = ["StepWeightCasts", "per_step_weight_casts"]

#: The buffers of a weight cast once per step: FP8 data (out, in) and fp32 (scale, 1 / scale[, delayed amax]).
PRECAST_BUFFERS = ("fp8_weight_data", "fp8_weight_scale")


class StepWeightCasts:
    """What :func:`per_step_weight_casts` returns: its layers, ``refresh()`` and ``remove()``."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self._hook: Any = None

    def refresh(self) -> None:
        """Cast every layer's weight now, into its buffers (in place: no new guard or recompile)."""
        for layer in self.layers:
            precast_weight(layer)

    def remove(self) -> None:
        """Back to casting the weights in every call; the buffers go."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for layer in self.layers:
            for name in PRECAST_BUFFERS:
                layer._buffers.pop(name, None)
            layer.__dict__.pop("_precast_version", None)
            layer.config = layer.config  # re-planned without the buffers
        self.layers = []


def per_step_weight_casts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> StepWeightCasts:
    """Cast each FP8 layer's weight once per optimizer step, not in every forward and backward.

    The casts live in each layer's non-persistent buffers ``fp8_weight_data`` (1 byte per
    weight element) and ``fp8_weight_scale`` (the scale and its inverse, which the products
    read; a delayed weight's amax third); forward and backward multiply them, with the bits
    a cast in the call would give (a delayed weight: one scale per step).
    They are cast now, after every ``optimizer.step()`` (a step post hook), ``load_state_dict``,
    ``Module.to()`` and a new config, and by an eager forward whose weight changed since; a
    compiled forward cannot tell: after any other change of a weight (an in-place write,
    another optimizer) call ``refresh()``, or it multiplies the old cast.

    Args:
        model: a module holding Float8Linear layers.
        optimizer: the optimizer whose steps trigger the recast; None: call ``refresh()``.
        module_filter_fn: ``fn(module, fqn) -> False`` leaves that layer casting per call.
    Returns:
        A :class:`StepWeightCasts` (``refresh()``, ``remove()``).
    Raises:
        TypeError: ``model`` not an ``nn.Module``.
        ValueError: a layer it cannot serve (the weight's cast not per tensor, a weight
            that is a DTensor or an FSDP2/FP8-gathered one, per-GEMM formats, telemetry),
            named; ``module_filter_fn`` leaves such layers out. Nothing changes then.

    Example:
        >>> import f8tensor
        >>> model = f8tensor.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 64)))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> casts = f8tensor.per_step_weight_casts(model, opt)
        >>> model(torch.randn(8, 64)).sum().backward()
        >>> opt.step()  # and the weights are cast again
        >>> model[0].fp8_weight_data.dtype
        torch.float8_e4m3fn
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"per_step_weight_casts expects an nn.Module; got {type(model).__name__}")
    layers = []
    for fqn, module in model.named_modules():
        if not getattr(type(module), "reuses_weight_casts", False):
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        refusal = precast_refusal(module)
        if refusal is not None:
            raise ValueError(
                f"per_step_weight_casts cannot serve {fqn or type(module).__name__}: {refusal}. It serves "
                "tensorwise weight casts (dynamic or delayed) of plain weights; leave the layer out with module_filter_fn"
            )
        layers.append(module)
    for layer in layers:
        for name in PRECAST_BUFFERS:  # allocated by the first refresh()
            layer.register_buffer(name, None, persistent=False)
        layer.config = layer.config  # re-planned with the buffers
    casts = StepWeightCasts(layers)
    if optimizer is not None:
        casts._hook = optimizer.register_step_post_hook(lambda *_: casts.refresh())
    casts.refresh()
    return casts


def precast_refusal(layer: Any, config: Any = None) -> str | None:
    """Why ``layer``'s weight cannot be cast once per step (with ``config``, default its own), or None."""
    config = layer.config if config is None else config
    weight = layer._parameters.get("weight")
    plan = role_plan(config.weight)
    if config.uses_gemm_formats:
        return "its config names per-GEMM formats"
    if config.collect_stats:
        return "it collects cast telemetry (collect_stats), which measures every cast"
    if not plan.tensorwise or plan.specs[1].rounding != "nearest":
        return f"its weight's cast is {config.weight!r}, not tensorwise with nearest rounding"
    if config.enable_fsdp_float8_all_gather or type(weight) is not nn.Parameter:
        return f"its weight is a {type(weight).__name__} (a DTensor, an FSDP2 or FP8-gathered weight)"
    if not getattr(type(layer), "precasts_weight", False):
        return "its forward multiplies something else than its weight"
    return None


def precast_weight(layer: Any) -> None:
    """Cast ``layer``'s weight into its per-step buffers, as its forward's cast would."""
    config, weight = layer.config, layer.weight
    plan = role_plan(config.weight)
    n_scales = 3 if plan.delayed else 2
    data, scale = layer._buffers[PRECAST_BUFFERS[0]], layer._buffers[PRECAST_BUFFERS[1]]
    if (
        data is None
        or scale is None
        or scale.dtype != torch.float32
        or scale.shape != (n_scales,)
        or data.device != weight.device
        or data.dtype != config.weight.dtype
        or data.shape != weight.shape
    ):
        # First cast, or moved or converted (Module.to() casts FP8 buffers too): fresh buffers.
        data = layer._buffers[PRECAST_BUFFERS[0]] = torch.empty(
            weight.shape, dtype=config.weight.dtype, device=weight.device
        )
        scale = layer._buffers[PRECAST_BUFFERS[1]] = torch.ones(n_scales, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        if plan.delayed:  # the forward's cast (the forward keeps its scale)
            f8, amax, _ = cast_operand(weight.detach(), plan, 1, DEFAULT_GEMM, config, layer.amax_history_weight)
            scale[2].copy_(amax)
        else:
            f8 = quantize(weight.detach(), plan.specs[1])[0]
        data.copy_(f8._data)
        scale[0].copy_(f8._scale)
        scale[1].copy_(f8._scale.reciprocal())  # the bits the products compute from it
    layer.__dict__["_precast_version"] = version_counter(weight)


def check_precast(layer: Any, weight: torch.Tensor) -> None:
    """Recast ``layer``'s per-step weight cast if its weight changed since (eager forwards)."""
    data = layer._buffers[PRECAST_BUFFERS[0]]
    if version_counter(weight) != layer.__dict__.get("_precast_version") or data.device != weight.device:
        precast_weight(layer)
