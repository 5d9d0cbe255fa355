"""Expert weights in checkpoints: state-dict hooks (plain tensors out, wrapped again after
``assign=True``) and the rebuild old pickles name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from f8tensor.moe.weight import Float8ExpertWeight
from f8tensor.quant.config import Float8LinearConfig


def _rebuild_expert_parameter(hp: torch.Tensor, config: Float8LinearConfig, requires_grad: bool) -> nn.Parameter:
    """Unpickle a :class:`Float8ExpertWeight` parameter of an earlier release."""
    return nn.Parameter(Float8ExpertWeight(hp, config), requires_grad=requires_grad)


_EXPERT_CONFIGS = "_float8_expert_configs"  # experts module attribute: {param name: config}


def _plain_expert_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: FP8 expert weights saved as the plain tensors they wrap."""
    for name in getattr(module, _EXPERT_CONFIGS, {}):
        value = state_dict.get(prefix + name)
        if isinstance(value, Float8ExpertWeight) and not isinstance(value, nn.Parameter):
            state_dict[prefix + name] = value._hp.detach()


def _rewrap_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: expert weights replaced by ``assign=True`` are wrapped again."""
    for name, config in getattr(module, _EXPERT_CONFIGS, {}).items():
        p = module._parameters.get(name)
        if p is not None and not isinstance(p, Float8ExpertWeight):
            module._parameters[name] = nn.Parameter(Float8ExpertWeight(p.data, config), requires_grad=p.requires_grad)
