"""f8tensor with Hugging Face ``transformers``, ``accelerate`` and the ``Trainer``.

**Train** (accelerate's FP8 backends are a closed list, so f8tensor is not one of
them: convert the model yourself, *then* hand it over)::

    model = AutoModelForCausalLM.from_config(config)            # or from_pretrained
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"),
                               module_filter_fn=lambda m, fqn: fqn != "lm_head")
    # accelerate:
    accelerator = Accelerator(mixed_precision="bf16")            # not mixed_precision="fp8"
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # or the HF Trainer (it prepares the model itself):
    Trainer(model=model, args=TrainingArguments(..., bf16=True), ...).train()

Converting first matters: ``prepare`` may wrap the model (DDP, FSDP2), and the optimizer
must see the converted model's parameters (the same objects, in f8tensor's case).
Checkpoints keep plain weights, so ``save_pretrained`` output loads into an unconverted
model too.

**Load back with the scaling state.** With delayed scaling, ``save_pretrained`` writes
each converted layer's amax histories and scales next to its weights.
``from_pretrained`` builds plain ``nn.Linear`` layers, reports those entries as
unexpected keys and drops them. :func:`from_pretrained_float8` loads the model,
converts it with the same recipe and filter, then loads the FP8 scaling state from the
saved files, bit for bit::

    model = from_pretrained_float8(AutoModelForCausalLM, "out/checkpoint",
                                   config=Float8LinearConfig.from_recipe("delayed"),
                                   module_filter_fn=lambda m, fqn: fqn != "lm_head")
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from f8tensor.convert import convert_to_float8_training
from f8tensor.nn.linear import Float8Linear
from f8tensor.quant.config import Float8LinearConfig

__all__ = ["float8_state_dict", "from_pretrained_float8", "load_float8_state"]

_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def float8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 scaling state of ``model``: every persistent buffer of its Float8Linear
    layers (amax histories, scales), keyed as in ``model.state_dict()``."""
    state: dict[str, torch.Tensor] = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            for name, buf in mod.named_buffers(recurse=False):
                if name not in mod._non_persistent_buffers_set:
                    state[f"{fqn}.{name}" if fqn else name] = buf
    return state


def _read_safetensors(path: str | os.PathLike, keys: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = os.path.join(path, _SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted({weight_map[k] for k in keys if k in weight_map})
    elif os.path.isfile(os.path.join(path, _SAFETENSORS)):
        files = [_SAFETENSORS]
    else:
        raise FileNotFoundError(
            f"no {_SAFETENSORS} or {_SAFETENSORS_INDEX} in {os.fspath(path)!r}: pass the directory "
            f"save_pretrained wrote (safe_serialization=True, the default)"
        )
    found: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in keys.intersection(f.keys()):
                found[key] = f.get_tensor(key)
    return found


def load_float8_state(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> list[str]:
    """Load the FP8 scaling state saved by ``save_pretrained`` into a converted ``model``.

    Reads only the Float8Linear buffers (the weights are ``from_pretrained``'s business)
    from ``model.safetensors`` or a sharded ``model.safetensors.index.json`` checkpoint
    in the directory ``path``. ``strict``: every buffer must be in the files (a checkpoint
    saved from a model converted with the same recipe and filter); otherwise the missing
    ones keep their fresh state and are returned.

    Raises:
        KeyError: ``strict`` and some FP8 buffers of ``model`` are not in the files.
        ValueError: a saved buffer's shape differs from the model's (another
            ``delayed.history_len``).
    """
    wanted = float8_state_dict(model)
    found = _read_safetensors(path, set(wanted))
    missing = sorted(set(wanted) - set(found))
    if missing and strict:
        shown = ", ".join(missing[:4]) + (f", ... ({len(missing) - 4} more)" if len(missing) > 4 else "")
        raise KeyError(
            f"{len(missing)} FP8 scaling buffers are not in {os.fspath(path)!r}: {shown}. Was it saved from a model "
            f"converted with the same recipe and module_filter_fn? (strict=False keeps them fresh)"
        )
    with torch.no_grad():
        for key, value in found.items():
            buf = wanted[key]
            if buf.shape != value.shape:
                raise ValueError(
                    f"{key}: saved shape {tuple(value.shape)}, model has {tuple(buf.shape)} "
                    f"(a different delayed.history_len?)"
                )
            buf.copy_(value)  # the buffers are fp32 on both sides: a bitwise copy
    return missing


def from_pretrained_float8(
    model_cls: Any,
    path: str | os.PathLike,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    strict: bool = True,
    **from_pretrained_kwargs: Any,
) -> nn.Module:
    """``model_cls.from_pretrained(path)``, converted to FP8, with its scaling state.

    ``model_cls``: a transformers model class (``AutoModelForCausalLM``,
    ``LlamaForCausalLM``, ...). ``path``: a local directory written by
    ``save_pretrained``. ``config`` and ``module_filter_fn``: as when the model was
    converted for training. Dynamic recipes have no scaling state: this is then
    ``from_pretrained`` followed by :func:`~f8tensor.convert_to_float8_training`.
    """
    model = model_cls.from_pretrained(path, **from_pretrained_kwargs)
    model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    load_float8_state(model, path, strict=strict)
    return model
