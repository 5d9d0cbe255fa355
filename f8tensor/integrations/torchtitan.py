"""f8tensor in torchtitan (>= 0.3): FP8 linears chosen through torchtitan's config tree.

Two ways in: :class:`F8TensorLinearConverter` in a model's ``converters=[...]``, or the
override ``--override.imports f8tensor.integrations.torchtitan.f8tensor_float8_linear``
(the block linears of :data:`OVERRIDE_FQNS`). Each converted ``Linear.Config`` becomes an
:class:`F8TensorLinear.Config` building a ``Float8Linear``. ``filter_fqns`` match as
substrings; MoE router gates stay high precision unless ``convert_routers=True``.
torchtitan's TP runs converted layers with bf16 collectives; for FP8 gathers apply
f8tensor's styles yourself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

try:
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.linear import Linear
    from torchtitan.protocols.module import Module
except ModuleNotFoundError as exc:  # absent: say so and how to install it (README.md)
    if exc.name is None or not exc.name.startswith("torchtitan"):
        raise
    raise ModuleNotFoundError(
        "f8tensor.integrations.torchtitan needs torchtitan, which is not installed: "
        "pip install --no-deps torchtitan==0.3.0 (see README.md)",
        name="torchtitan",
    ) from exc

from f8tensor.gemm.rules import ALIGN
from f8tensor.nn.linear import Float8Linear
from f8tensor.quant.config import RECIPES, Float8LinearConfig

__all__ = ["OVERRIDE_FQNS", "F8TensorLinear", "F8TensorLinearConverter", "f8tensor_float8_linear"]

#: The linears the override converts (router gates excluded; fnmatch cannot exclude, hence a list).
OVERRIDE_FQNS = ["layers.*.attention.*", "layers.*.feed_forward.*", "layers.*.shared_experts.*"]

logger = logging.getLogger("f8tensor")


class F8TensorLinear(Float8Linear, Module):
    """An f8tensor ``Float8Linear`` built from a torchtitan config (a torchtitan ``Module``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """torchtitan's ``Linear.Config`` plus the FP8 config (set by the converter)."""

        # Leading underscore: torchtitan's to_dict leaves it out of logged configs.
        _float8_config: Float8LinearConfig | None = None

    def __init__(self, config: Config) -> None:
        Float8Linear.__init__(
            self, config.in_features, config.out_features, bias=config.bias, config=config._float8_config
        )


def _float8_config(
    recipe: str, pad_inner_dim: bool, enable_fsdp_float8_all_gather: bool, collect_stats: bool
) -> Float8LinearConfig:
    if recipe not in RECIPES:
        raise ValueError(f"unknown f8tensor recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return Float8LinearConfig.from_recipe(
        recipe,
        pad_inner_dim=pad_inner_dim,
        enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather,
        collect_stats=collect_stats,
    )


def _skip_reason(cfg: Linear.Config, float8: Float8LinearConfig) -> str | None:
    owner = type(cfg)._owner
    if owner is None or owner.forward is not nn.Linear.forward:
        return "overrides forward"
    aligned = cfg.in_features % ALIGN == 0 and cfg.out_features % ALIGN == 0
    if not (aligned or float8.pad_inner_dim):
        return f"dims not multiples of {ALIGN}"
    return None


class F8TensorLinearConverter(QuantizationConverter):
    """Replace the model's ``Linear.Config`` nodes with :class:`F8TensorLinear.Config`."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        """What to convert, and with which recipe (a torchtitan model's ``converters=[...]`` entry)."""

        recipe: str = "tensorwise"
        """f8tensor recipe: tensorwise, rowwise, rowwise_with_gw_hp or delayed."""

        filter_fqns: list[str] = field(default_factory=lambda: ["lm_head", "output"])
        """Linears whose dotted name contains any of these stay in high precision.
        Linears with a dimension not a multiple of 16 always do (unless pad_inner_dim)."""

        pad_inner_dim: bool = False
        """Pad dimensions that are not multiples of 16 with zeros instead of skipping."""

        enable_fsdp_float8_all_gather: bool = False
        """FSDP2 all-gathers the weights in FP8 (1 byte per element)."""

        collect_stats: bool = False
        """Record saturation/underflow telemetry (see f8tensor.float8_stats)."""

        convert_routers: bool = False
        """Also convert MoE router gates (linears inside a ``...Router.Config``). Off by
        default: an FP8 router changes which experts the tokens pick (top-k choices flip),
        and a router's GEMM is tiny; f8tensor's own converter keeps routers in high precision."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.float8_config = _float8_config(
            config.recipe, config.pad_inner_dim, config.enable_fsdp_float8_all_gather, config.collect_stats
        )
        self.converted_fqns: list[str] = []

    def convert(self, model_config: Module.Config) -> Module.Config:
        converted, skipped = [], []
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            reason = _skip_reason(cfg, self.float8_config)
            if reason is None and any(f in fqn for f in self.config.filter_fqns):
                reason = "filter_fqns"
            if reason is None and not self.config.convert_routers and "Router" in type(parent).__qualname__:
                reason = "MoE router: top-k choices stay high precision (convert_routers=True converts it)"
            if reason is not None:
                skipped.append(f"{fqn} ({reason})")
                continue
            new = derive(cfg, F8TensorLinear.Config, _float8_config=self.float8_config)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted.append(fqn)
        self.converted_fqns = converted
        line = (
            f"f8tensor: {self.config.recipe} FP8 for {len(converted)} of {len(converted) + len(skipped)} linear layers"
        )
        logger.info(line + (f"; kept in high precision: {', '.join(skipped)}" if skipped else ""))
        if not converted:
            logger.warning("f8tensor: the torchtitan converter found no linear layer to convert")
        return model_config


@override(
    target=Linear.Config,
    fqns=OVERRIDE_FQNS,
    exact=True,
    description="f8tensor FP8 linears in the transformer blocks",
)
def f8tensor_float8_linear(
    cfg: Linear.Config,
    *,
    recipe: str = "tensorwise",
    pad_inner_dim: bool = False,
    enable_fsdp_float8_all_gather: bool = False,
    collect_stats: bool = False,
) -> Linear.Config:
    """The override factory: one ``Linear.Config`` of a transformer block -> FP8."""
    float8 = _float8_config(recipe, pad_inner_dim, enable_fsdp_float8_all_gather, collect_stats)
    if _skip_reason(cfg, float8) is not None:
        return cfg
    return derive(cfg, F8TensorLinear.Config, _float8_config=float8)
