"""A Float8Linear's delayed-scaling state (:data:`~f8tensor.quant.quantizers.DelayedState`):
two buffers, not persistent themselves; its parts are attributes (views) and state-dict entries."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from f8tensor.compat import dtensor_local, is_fake
from f8tensor.distributed.fsdp import DTensor
from f8tensor.quant.quantizers import DELAYED_CALLS, DELAYED_PARTS, DelayedState, delayed_views

__all__ = [
    "DELAYED_BUFFERS",
    "DELAYED_STATE_KEYS",
    "adopt_part_buffers",
    "check_delayed_state",
    "delayed_buffer_shapes",
    "delayed_part",
    "delayed_state_of",
    "fresh_delayed_buffer",
    "load_delayed_state",
]

#: The layer's two buffers: histories (3, history_len), step (2 + 3 * DELAYED_CALLS,).
DELAYED_BUFFERS = ("delayed_amax_history", "delayed_step")
#: The persistent parts, by state-dict name (the recorded calls are not saved).
DELAYED_STATE_KEYS = DELAYED_PARTS[:5]
_HISTORY_KEYS = DELAYED_PARTS[:3]


def delayed_buffer_shapes(history_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of :data:`DELAYED_BUFFERS` for histories of ``history_len``."""
    return (3, history_len), (2 + 3 * DELAYED_CALLS,)


def fresh_delayed_buffer(name: str, like: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Buffer ``name`` as a newly built layer has it: empty histories, unit scales, calls with no key (-1)."""
    state = torch.zeros(like.shape, dtype=torch.float32, device=like.device if device is None else device)
    if name == DELAYED_BUFFERS[1]:
        state.fill_(1.0)
        state[2:].view(-1, 3)[:, 0] = -1.0
    return state


def delayed_state_of(layer: nn.Module) -> DelayedState | None:
    """``layer``'s delayed-scaling buffers, or None."""
    histories, step = (layer._buffers.get(name) for name in DELAYED_BUFFERS)
    return None if histories is None or step is None else (histories, step)


def adopt_part_buffers(layer: nn.Module) -> None:
    """Move the parts of a layer pickled with one buffer per part (before the two) into the two.

    Its recorded calls start fresh (they link a forward to its recompute within one step).
    """
    old = (*DELAYED_STATE_KEYS, "delayed_call_keys", "delayed_call_scales")
    parts: dict[str, Any] = {name: layer._buffers.pop(name) for name in old if name in layer._buffers}
    layer._non_persistent_buffers_set.difference_update(old)
    if not parts:
        return
    histories = torch.stack([parts[name] for name in DELAYED_STATE_KEYS[:3]]).float()
    step_shape = delayed_buffer_shapes(histories.shape[1])[1]
    step = fresh_delayed_buffer(DELAYED_BUFFERS[1], torch.empty(step_shape), histories.device)
    step[:2] = torch.stack([parts["scale_input"], parts["scale_weight"]])
    for name, buffer in zip(DELAYED_BUFFERS, (histories, step)):
        layer.register_buffer(name, buffer, persistent=False)


def delayed_part(index: int) -> property:
    """The attribute of part ``index`` of :data:`DELAYED_PARTS`: a view; assigning copies in."""
    name = DELAYED_PARTS[index]

    def get(layer: nn.Module) -> torch.Tensor:
        state = delayed_state_of(layer)
        if state is None:  # Module.__getattr__ then says the layer has no such attribute
            raise AttributeError(name)
        return delayed_views(state)[index]

    def set_(layer: nn.Module, value: torch.Tensor) -> None:
        part = get(layer)
        if not isinstance(value, torch.Tensor) or value.shape != part.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} takes a tensor of shape {tuple(part.shape)}; got {shape}")
        with torch.no_grad():
            part.copy_(value)

    return property(get, set_, None, f"The layer's ``{name}`` (delayed scaling): a view of its state.")


def check_delayed_state(state_dict: dict, prefix: str) -> None:
    """Refuse a delayed-scaling state that would poison training (non-finite or negative).

    Read on the host (loading is no hot path); meta and fake tensors are skipped.

    Raises:
        ValueError: a history holds a non-finite or negative amax, or a scale is not positive and finite.
    """
    for name in DELAYED_STATE_KEYS:
        value = state_dict.get(prefix + name)
        if not isinstance(value, torch.Tensor) or value.device.type == "meta" or is_fake(value):
            continue
        v = (value.to_local() if isinstance(value, DTensor) else value).detach().float()
        history = name in _HISTORY_KEYS
        ok = torch.isfinite(v) & ((v >= 0) if history else (v >= torch.finfo(torch.float32).tiny))
        if not bool(ok.all()):
            bad = v[~ok].flatten()[0].item()
            allowed = "finite amaxes >= 0" if history else "a positive finite fp32 scale"
            raise ValueError(f"load_state_dict: {prefix + name} must hold {allowed}; got {bad!r}")


def load_delayed_state(
    state: DelayedState,
    parts: dict[str, Any],
    keys: list[str],
    fresh: bool,
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Copy the loaded ``parts`` (by state-dict ``keys``) into ``state``; fresh for a plain nn.Linear checkpoint.

    What is lacking goes to ``missing_keys``, a shape mismatch to ``error_msgs``.
    """
    with torch.no_grad():
        if fresh:
            for name, buffer in zip(DELAYED_BUFFERS, state):
                buffer.copy_(fresh_delayed_buffer(name, buffer))
            return
        for key, view in zip(keys, delayed_views(state)):
            if key not in parts:
                missing_keys.append(key)
                continue
            value = parts[key]
            value = dtensor_local(value) if isinstance(value, DTensor) else value
            view = dtensor_local(view) if isinstance(view, DTensor) else view  # a replicated buffer's
            if value.shape != view.shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                    f"the shape in current model is {view.shape}."
                )
                continue
            view.copy_(value)
