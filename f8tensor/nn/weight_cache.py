"""Weight casts reused across the micro-batches of one optimizer step.

With gradient accumulation every micro-batch casts every weight to FP8 again, although the
weights change only at ``optimizer.step()``. Inside :func:`reuse_weight_casts` a layer casts
its weight once (per layout: the forward's and, where it differs, the backward's) and serves
those bytes to the later micro-batches: bitwise the same numbers, one cast fewer per
micro-batch and layout.

A cast is never served stale. An entry is valid only for the weight it was made from: the
same tensor object, the same version counter (every in-place update made through autograd's
view of the tensor bumps it: ``optimizer.step()``'s foreach kernels, ``copy_`` in
``load_state_dict``, any ``with torch.no_grad(): w.mul_(...)``), the same storage address,
dtype and layer config. On top of that, every ``torch.optim.Optimizer.step()`` taken inside
the scope drops all entries (fused optimizers write the parameters without bumping their
version counters), as do ``load_state_dict`` and ``module.to(...)`` of a layer, and so does
every ``torch.distributed`` collective or receive (``dist.broadcast(weight)``,
``all_reduce``, ``scatter``, ...) whose tensors share storage with a cached weight: c10d
writes bump no version counter either, so the scope watches those ops while it is open
(:func:`~f8tensor.compat.watch_c10d_writes`). What no check can see is a write through
``weight.data`` by a plain op (autograd does not track it either): do not write weights that
way inside the scope. Leaving the scope drops every entry, so the FP8 copies live no longer
than the micro-batch loop.

The entries live in this module's registry, keyed by the layer object, never in the layer:
a copy of the model made inside the scope (``copy.deepcopy``, ``torch.save`` of the whole
module, ``pickle``) carries no casts, is not covered by the scope, and so never serves a
cast after its own weights change (an EMA copy updated through ``.data``).

Why a scope and not always on: outside one, ``weight.data`` writes are common (manual
update loops, adapter merges that add a delta to ``weight.data``), and a cast served after
one would silently compute with the old weights. The scope is the caller's statement that
the weights stay put between its forwards, the one fact this module cannot observe.

A layer opts in by defining ``reuses_weight_casts = True`` and reading its entries with
:func:`weight_casts_of`.
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

#: The layers an open scope covers: ``id(layer) -> (layer, its casts)``. Outside the layer
#: (not in its ``__dict__``) so that copies and pickles of a layer never carry casts; the
#: scope holds the layer, so its id is not reused while the entry lives.
_ACTIVE: dict[int, tuple[nn.Module, WeightCasts]] = {}
_LOCK = threading.Lock()
#: How many scopes are open, and the remover of the c10d watch they share.
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
        """Whether casts of ``weight`` may be kept: a plain tensor or Parameter (not a tensor
        subclass, a ``torch.func`` wrapper or an inference tensor, which has no version counter)."""
        return type(weight) in (torch.Tensor, nn.Parameter) and not weight.is_inference() and not is_functorch_wrapped(weight)

    def get(self, layout: str, weight: torch.Tensor, config: object, make: Callable[[], Any]) -> Any:
        """The cast for ``layout`` of ``weight`` under ``config``: served when the entry
        was made from this very tensor object (``is``: ids are reused after a tensor dies),
        at its current version, storage and dtype, under this config object; else made by
        ``make()`` and kept (``weight`` must be :meth:`cacheable`)."""
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
        """Forget the casts of weights whose storage (address) is in ``storages``."""
        for layout in [k for k, entry in self._entries.items() if entry[0].untyped_storage().data_ptr() in storages]:
            del self._entries[layout]

    def __len__(self) -> int:
        return len(self._entries)


def weight_casts_of(module: nn.Module) -> WeightCasts | None:
    """``module``'s cache while a :func:`reuse_weight_casts` scope covers it (never while
    compiling: a compiled graph casts inside its own kernels), else ``None``."""
    if torch.compiler.is_compiling():  # first: dynamo then never reads (and guards on) the registry
        return None
    found = _ACTIVE.get(id(module))
    return found[1] if found is not None and found[0] is module else None


def drop_weight_casts(module: nn.Module) -> None:
    """Forget ``module``'s cached casts (its weight was replaced or reloaded)."""
    casts = weight_casts_of(module)
    if casts is not None:
        casts.clear()


def _drop_collective_writes(tensors: list[torch.Tensor]) -> None:
    """A c10d op is about to run on ``tensors``: forget every cast of a weight that shares
    storage with one of them (a collective may write any of its tensors; a read only costs
    a cast)."""
    if not _ACTIVE:
        return
    storages = {t.untyped_storage().data_ptr() for t in tensors if type(t) in (torch.Tensor, nn.Parameter)}
    for _, casts in list(_ACTIVE.values()):
        if len(casts):
            casts.drop_storages(storages)


@contextlib.contextmanager
def reuse_weight_casts(model: nn.Module) -> Iterator[None]:
    """Cast each FP8 layer's weight once for all the forwards and backwards inside.

    For a gradient-accumulation loop: the micro-batches of one optimizer step share each
    weight's FP8 bytes (bitwise the same results as casting every time).

    Example:
        >>> import f8tensor
        >>> model = f8tensor.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(64, 64)))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with f8tensor.reuse_weight_casts(model):
        ...     for micro_batch in torch.randn(4, 8, 64):
        ...         model(micro_batch).sum().backward()
        >>> opt.step()

    An ``optimizer.step()`` inside the scope drops every cast, as does any tracked in-place
    update of a weight and any ``torch.distributed`` collective on it (``dist.broadcast``),
    so a scope around a whole training loop is correct too (it then saves nothing across
    steps). Writes through ``weight.data`` by plain ops are not seen: none inside. Copies of
    the model made inside (``copy.deepcopy``, ``torch.save``) carry no casts and are not
    covered.
    Layers covered: :class:`~f8tensor.Float8Linear` and its subclasses with an FP8 recipe
    whose weight cast is dynamic and rounds to nearest (delayed weights record an amax per
    forward, stochastic ones draw fresh noise per forward, FP4 and per-GEMM-format configs,
    FP8-gathered FSDP2 weights and DTensor weights cast as before). Nested scopes share the
    outer scope's entries. Under ``torch.compile`` the scope has no effect.
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
