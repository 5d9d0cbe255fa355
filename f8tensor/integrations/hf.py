"""f8tensor with Hugging Face ``transformers``, ``accelerate`` and the ``Trainer``.

Convert the model first, then hand it to ``accelerator.prepare`` or the ``Trainer`` with
bf16 (accelerate's FP8 backends are a closed list). ``from_pretrained`` drops delayed
scaling's state; :func:`from_pretrained_float8` converts and loads it back, bit for bit.
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
    """The state ``model``'s Float8Linear layers add to ``state_dict()`` (live views), keyed as there."""
    state: dict[str, torch.Tensor] = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            for name, view in mod.float8_state().items():
                state[f"{fqn}.{name}" if fqn else name] = view
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

    Args:
        model: the converted model.
        path: a directory with ``model.safetensors`` or a sharded index.
        strict: every buffer must be in the files; otherwise missing ones keep their fresh state.

    Returns:
        The missing buffer names.

    Raises:
        KeyError: ``strict`` and FP8 buffers missing from the files.
        ValueError: a saved buffer's shape differs (another ``delayed.history_len``).
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
            buf.copy_(value)  # fp32 on both sides: a bitwise copy
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

    Args:
        model_cls: a transformers model class.
        path: a local directory written by ``save_pretrained``.
        config, module_filter_fn: as when the model was converted for training.
        strict: as in :func:`load_float8_state`.
    """
    model = model_cls.from_pretrained(path, **from_pretrained_kwargs)
    model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    load_float8_state(model, path, strict=strict)
    return model
