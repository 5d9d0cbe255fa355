"""Expert weights in checkpoints: the state-dict hooks that save the plain tensors and wrap
them again after ``load_state_dict(assign=True)``, and the rebuild that pickles of earlier
releases name (``f8tensor.moe._rebuild_expert_parameter``, re-exported by the package).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from f8tensor.moe.weight import Float8ExpertWeight
from f8tensor.quant.config import Float8LinearConfig


def _rebuild_expert_parameter(hp: torch.Tensor, config: Float8LinearConfig, requires_grad: bool) -> nn.Parameter:
    """Unpickling a :class:`Float8ExpertWeight` parameter pickled before
    :class:`~f8tensor.tensor.weights.RecipeWeight` (whole-model pickles of earlier releases)."""
    return nn.Parameter(Float8ExpertWeight(hp, config), requires_grad=requires_grad)


_EXPERT_CONFIGS = "_float8_expert_configs"  # experts module attribute: {param name: config}


def _plain_expert_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook of an experts module: its FP8 expert weights are saved as the
    plain tensors they wrap (what transformers' ``save_pretrained`` and every checkpoint
    writer expect: ordinary storages). ``keep_vars=True`` gives the parameters as they are."""
    for name in getattr(module, _EXPERT_CONFIGS, {}):
        value = state_dict.get(prefix + name)
        if isinstance(value, Float8ExpertWeight) and not isinstance(value, nn.Parameter):
            state_dict[prefix + name] = value._hp.detach()


def _rewrap_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook of an experts module: ``assign=True`` replaces parameters by
    the loaded (plain) tensors; each expert weight that was FP8 is wrapped again, with its
    recipe, so the model keeps training its experts in FP8 (``float8_converted_fqns`` stays
    true)."""
    for name, config in getattr(module, _EXPERT_CONFIGS, {}).items():
        p = module._parameters.get(name)
        if p is not None and not isinstance(p, Float8ExpertWeight):
            module._parameters[name] = nn.Parameter(Float8ExpertWeight(p.data, config), requires_grad=p.requires_grad)
