"""Weight casts reused across the micro-batches of one optimizer step.

Invariant: never stale. An entry holds only for the same weight object, version, storage,
dtype and config; steps, reloads and c10d writes drop entries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from f8tensor.compat import is_functorch_wrapped, version_counter, watch_c10d_writes

__all__ = ["WeightCasts", "reuse_weight_casts", "weight_casts_of"]

#: ``id(layer) -> (layer, casts)``, outside the layer so copies never carry casts.
_ACTIVE: dict[int, tuple[nn.Module, WeightCasts]] = {}
_LOCK = threading.Lock()
_OPEN = {"scopes": 0}
_UNWATCH: list[Callable[[], None]] = []


class WeightCasts:
    """One layer's cached weight casts, keyed by layout (``"forward"``, ``"backward"``)."""

    __slots__ = ("_entries", "hits", "misses")

    def __init__(self) -> None:
        self._entries: dict[str, tuple[torch.Tensor, object, tuple, Any]] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def cacheable(weight: torch.Tensor) -> bool:
        """Whether casts of ``weight`` may be kept (a plain tensor with a version counter)."""
        return (
            type(weight) in (torch.Tensor, nn.Parameter)
            and not weight.is_inference()
            and not is_functorch_wrapped(weight)
        )

    def get(self, layout: str, weight: torch.Tensor, config: object, make: Callable[[], Any]) -> Any:
        """The kept cast for ``layout`` if still valid, else ``make()``, kept."""
        state = (version_counter(weight), weight.data_ptr(), weight.dtype)
        entry = self._entries.get(layout)
        if entry is not None and entry[0] is weight and entry[1] is config and entry[2] == state:
            self.hits += 1
            return entry[3]
        self.misses += 1
        value = make()
        self._entries[layout] = (weight, config, state, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def drop_storages(self, storages: set[int]) -> None:
        """Forget the casts of weights whose storage address is in ``storages``."""
        for layout in [k for k, entry in self._entries.items() if entry[0].untyped_storage().data_ptr() in storages]:
            del self._entries[layout]

    def __len__(self) -> int:
        return len(self._entries)


def weight_casts_of(module: nn.Module) -> WeightCasts | None:
    """``module``'s cache inside a :func:`reuse_weight_casts` scope (eager), else ``None``."""
    if torch.compiler.is_compiling():  # first: dynamo never guards on the registry
        return None
    found = _ACTIVE.get(id(module))
    return found[1] if found is not None and found[0] is module else None


def drop_weight_casts(module: nn.Module) -> None:
    """Forget ``module``'s cached casts."""
    casts = weight_casts_of(module)
    if casts is not None:
        casts.clear()


def _drop_collective_writes(tensors: list[torch.Tensor]) -> None:
    """Forget casts of weights sharing storage with ``tensors``."""
    if not _ACTIVE:
        return
    storages = {t.untyped_storage().data_ptr() for t in tensors if type(t) in (torch.Tensor, nn.Parameter)}
    for _, casts in list(_ACTIVE.values()):
        if len(casts):
            casts.drop_storages(storages)


@contextlib.contextmanager
def reuse_weight_casts(model: nn.Module) -> Iterator[None]:
    """Cast each FP8 layer's weight once for all the forwards and backwards inside.

    Writes through ``weight.data`` are not seen: none inside. TypeError unless an ``nn.Module``.

    Example:
        >>> import f8tensor
        >>> model = f8tensor.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 64)))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with f8tensor.reuse_weight_casts(model):
        ...     for micro_batch in torch.randn(4, 8, 64):
        ...         model(micro_batch).sum().backward()
        >>> opt.step()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"reuse_weight_casts expects an nn.Module; got {type(model).__name__}")
    opened = [m for m in model.modules() if getattr(type(m), "reuses_weight_casts", False) and id(m) not in _ACTIVE]
    with _LOCK:
        for m in opened:
            _ACTIVE[id(m)] = (m, WeightCasts())
        _OPEN["scopes"] += 1
        if _OPEN["scopes"] == 1:
            _UNWATCH.append(watch_c10d_writes(_drop_collective_writes))

    def drop_all(*_: object) -> None:
        for m in opened:
            _ACTIVE[id(m)][1].clear()

    handle = register_optimizer_step_post_hook(drop_all)
    try:
        yield
    finally:
        handle.remove()
        with _LOCK:
            for m in opened:
                _ACTIVE.pop(id(m), None)
            _OPEN["scopes"] -= 1
            if _OPEN["scopes"] == 0:
                _UNWATCH.pop()()
