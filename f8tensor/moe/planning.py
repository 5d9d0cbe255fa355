"""Converting a model's experts: which 3D parameters are expert weights, and wrapping them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from torch import nn

from f8tensor.gemm.grouped import DELAYED_EXPERTS
from f8tensor.gemm.rules import ALIGN, FP4_ALIGN
from f8tensor.moe.autograd import expert_path
from f8tensor.moe.state import _EXPERT_CONFIGS, _plain_expert_state, _rewrap_after_load
from f8tensor.moe.weight import Float8ExpertWeight, _register_hf_fallback
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.tensor.weights import set_recipe

__all__ = [
    "check_expert_config",
    "convert_experts_to_float8",
    "expert_configs",
    "plan_experts",
    "set_expert_config",
    "wrap_experts",
]

logger = logging.getLogger("f8tensor")


# ===================================================================== the converter


def _expert_params(module: nn.Module) -> Iterator[tuple[nn.Module, str, str, nn.Parameter]]:
    """(module, fqn prefix, name, param) per 3D (num_experts, ., .) parameter of an experts module."""
    for mod_fqn, mod in module.named_modules():
        n = getattr(mod, "num_experts", None)
        if not isinstance(n, int) or isinstance(n, bool):
            continue
        for name, p in mod.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == n:
                yield mod, mod_fqn, name, p


def expert_align(config: Float8LinearConfig) -> int:
    """What an expert weight's last two dims must be multiples of under ``config``."""
    return FP4_ALIGN if config.any_fp4 else ALIGN


def plan_experts(
    module: nn.Module,
    config: Float8LinearConfig,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> tuple[list[tuple[nn.Module, str, str]], dict[str, list[str]]]:
    """What :func:`convert_experts_to_float8` would do, without changing ``module``.

    Returns the ``(experts module, parameter name, fqn)`` to wrap and the skipped fqns by
    reason. Every ``experts_filter_fn`` call happens here, so a filter that raises leaves
    the model untouched. Already wrapped weights are neither (the converter counts them).
    """
    todo: list[tuple[nn.Module, str, str]] = []
    skipped: dict[str, list[str]] = {}
    for mod, mod_fqn, name, p in list(_expert_params(module)):
        fqn = f"{mod_fqn}.{name}" if mod_fqn else name
        if isinstance(p, Float8ExpertWeight):
            continue
        if config.any_delayed:
            skipped.setdefault("expert weights (delayed scaling is not supported for experts)", []).append(fqn)
            continue
        if experts_filter_fn is not None and not experts_filter_fn(mod, fqn):
            skipped.setdefault("rejected by experts_filter_fn", []).append(fqn)
            continue
        align = expert_align(config)
        if p.shape[1] % align or p.shape[2] % align:
            logger.warning(
                "f8tensor: left %s %s in high precision: %s expert GEMMs need its last two dims to be multiples of %d",
                fqn,
                tuple(p.shape),
                "FP4" if config.any_fp4 else "FP8",
                align,
            )
            skipped.setdefault(f"expert weights with dims not multiples of {align}", []).append(fqn)
            continue
        todo.append((mod, name, fqn))
    return todo, skipped


def wrap_experts(todo: list[tuple[nn.Module, str, str]], config: Float8LinearConfig) -> list[str]:
    """Wrap the weights :func:`plan_experts` chose, in place; returns their fqns."""
    if todo:
        _register_hf_fallback()
    for mod, name, _ in todo:
        p = getattr(mod, name)
        setattr(mod, name, nn.Parameter(Float8ExpertWeight(p.data, config), requires_grad=p.requires_grad))
        if not hasattr(mod, _EXPERT_CONFIGS):
            setattr(mod, _EXPERT_CONFIGS, {})
            mod.register_state_dict_post_hook(_plain_expert_state)
            mod.register_load_state_dict_post_hook(_rewrap_after_load)
        getattr(mod, _EXPERT_CONFIGS)[name] = config
    return [fqn for _, _, fqn in todo]


def expert_configs(module: nn.Module) -> dict[str, Float8LinearConfig]:
    """``{parameter name: recipe}`` of the expert weights wrapped in ``module`` itself."""
    return dict(getattr(module, _EXPERT_CONFIGS, {}))


def check_expert_config(module: nn.Module, name: str, config: Float8LinearConfig) -> None:
    """Raise ValueError if ``config`` cannot run expert weight ``name`` of ``module``."""
    if config.any_delayed:
        raise ValueError(DELAYED_EXPERTS)
    shape = module._parameters[name].shape  # type: ignore[union-attr]  # a wrapped weight is there
    align = expert_align(config)
    if shape[1] % align or shape[2] % align:
        raise ValueError(
            f"{'FP4' if config.any_fp4 else 'FP8'} expert GEMMs need the last two dims of {tuple(shape)} to be multiples of {align}"
        )


def set_expert_config(module: nn.Module, name: str, config: Float8LinearConfig) -> None:
    """Run ``module``'s expert weight ``name`` with ``config`` (the caller checked)."""
    getattr(module, _EXPERT_CONFIGS)[name] = config
    set_recipe(module._parameters[name], config)  # type: ignore[arg-type]  # a wrapped weight is there


def convert_experts_to_float8(
    module: nn.Module,
    config: Float8LinearConfig,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> list[str]:
    """Wrap every expert weight of ``module`` as a :class:`Float8ExpertWeight`, in place.

    An expert weight is a 3D parameter whose first dim is its module's ``num_experts``. Weights
    whose last two dims are not multiples of 16, and all under a delayed recipe, stay high
    precision (logged).

    Args:
        module: the model.
        config: the recipe.
        experts_filter_fn: ``(experts_module, param_fqn) -> bool``, which to convert.

    Returns:
        The converted parameter names.

    Raises:
        TypeError: ``experts_filter_fn`` is neither None nor callable.
    """
    if experts_filter_fn is not None and not callable(experts_filter_fn):
        raise TypeError(
            f"experts_filter_fn must be a callable (module, fqn) -> bool or None; got {experts_filter_fn!r}"
        )
    todo, skipped = plan_experts(module, config, experts_filter_fn)
    for reason, fqns in skipped.items():
        if reason.startswith("expert weights (delayed"):
            logger.warning(
                "f8tensor: %d expert weights left in high precision: delayed scaling is not supported for experts",
                len(fqns),
            )
    converted = wrap_experts(todo, config)
    if converted:
        logger.info(
            "f8tensor: %d expert weights run in FP8: %s; path: %s",
            len(converted),
            ", ".join(converted),
            expert_path(config, module.get_parameter(converted[0]).device),
        )
    return converted
