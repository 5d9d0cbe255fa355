"""Activations saved for backward in FP8: :func:`save_activations_in_float8`.

Each qualifying saved tensor is cast by its block quantizer (one fp32 scale per ``block``
elements of the last dim) and restored once per backward. Invariants: nothing that a
parameter's storage keeps alive, no per-row statistic, and no tensor changed in place since
its save is ever read back; a non-finite block comes back NaN. Details: docs/activations.rst.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from typing_extensions import Self

from f8tensor.compat import version_counter, view_base
from f8tensor.quant.block_quantizers import BlockQuantizer, activation_quantizer
from f8tensor.quant.formats import FLOAT8_DTYPES

__all__ = ["COMPRESSED_DTYPES", "DEFAULT_MIN_NUMEL", "save_activations_in_float8"]

#: Below this many elements a saved tensor is kept as is.
DEFAULT_MIN_NUMEL = 65536
#: The dtypes of the saved tensors that are compressed.
COMPRESSED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_EAGER_ONLY = (
    "save_activations_in_float8() is eager-only: its saved-tensor hooks cannot run inside a region "
    "torch.compile traces. Enter the context outside the compiled function (the tensors a compiled "
    "graph saves are then packed around it, in eager), or drop it from the compiled code"
)


class _Kept:
    """A saved tensor kept as is, with its version at save (unpack checks it: autograd does not here)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = version_counter(tensor)


def _modified(t: torch.Tensor, saved: int) -> RuntimeError:
    """The error autograd gives for a saved tensor changed in place since it was saved."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: a "
        f"{tuple(t.shape)} {t.dtype} tensor saved (under save_activations_in_float8) at version {saved} is now at "
        f"version {version_counter(t)}. Change it only after backward (an optimizer step or a weight update "
        "between forward and backward changes what backward reads)"
    )


class _Restored:
    """How many saves have not unpacked a packed tensor yet, and the copy restored for them."""

    __slots__ = ("pending", "tensor")

    def __init__(self) -> None:
        self.pending = 1
        self.tensor: torch.Tensor | None = None


@dataclass(frozen=True)
class _Packed:
    """A saved tensor in FP8: data, scales, its quantizer, and what the restore needs."""

    data: torch.Tensor
    scale: torch.Tensor
    quantizer: BlockQuantizer
    stride: tuple[int, ...]
    version: int
    # Weak: held only to read the version counter at unpack.
    refs: tuple[weakref.ReferenceType[torch.Tensor], ...]
    restored: _Restored


def _dense(t: torch.Tensor) -> bool:
    """Every element at its own address, nothing else between them."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _from_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one, a leaf autograd accumulates into, or autocast's copy of one."""
    base = view_base(t)
    # A view is judged by its base: a view a Function makes in forward looks like a grad leaf.
    return _parameter_or_copy(t if base is None else base)


def _parameter_or_copy(t: torch.Tensor) -> bool:
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    fn = t.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)
    return False


class _Cache(dict[tuple[Any, ...], tuple["weakref.ReferenceType[torch.Tensor]", _Packed]]):
    """The per-storage cache (a dict subclass: a plain dict cannot be weakly referenced)."""


class _Hooks:
    """The pack/unpack pair of one entered context, and its per-storage cache."""

    def __init__(self, float8_dtype: torch.dtype, block: int, min_numel: int) -> None:
        self.float8_dtype = float8_dtype
        self.block = block
        self.min_numel = min_numel
        self.cache: _Cache = _Cache()
        # Saved shapes minus the last dim: a tensor of such a shape is a per-row statistic, kept exact.
        self.rows: set[torch.Size] = set()
        self.kept_depth = 0

    def enter_kept(self, *_: Any) -> None:
        self.kept_depth += 1

    def leave_kept(self, *_: Any) -> None:
        self.kept_depth -= 1

    def _eligible(self, t: torch.Tensor) -> bool:
        return (
            type(t) is torch.Tensor
            and t.dtype in COMPRESSED_DTYPES
            and t.dim() > 0
            and t.numel() >= self.min_numel
            and t.shape[-1] >= self.block
            and not t.is_inference()
            and _dense(t)
            and not _from_parameter(t)
        )

    def pack(self, t: torch.Tensor) -> Any:
        if torch.compiler.is_compiling():
            raise RuntimeError(_EAGER_ONLY)
        if t.is_inference():
            return t  # no version counter
        if t.dim() > 1:
            self.rows.add(t.shape[:-1])
        if self.kept_depth or not self._eligible(t) or t.shape in self.rows:
            return _Kept(t)
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            version_counter(t),
        )
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is not None:
            hit[1].restored.pending += 1
            return hit[1]
        quantizer = activation_quantizer(self.float8_dtype, self.block, t.dim(), t.dtype)
        with torch.no_grad():
            data, scale = quantizer.quantize(t.detach())
        base = view_base(t)
        refs = (weakref.ref(t),) if base is None else (weakref.ref(t), weakref.ref(base))
        packed = _Packed(data, scale, quantizer, t.stride(), version_counter(t), refs, _Restored())
        # The entry lives while the storage's owner (a view's base) does.
        owner = t if base is None else base
        self.cache[key] = (weakref.ref(owner, self._forget(key)), packed)
        return packed

    def _forget(self, key: tuple[Any, ...]) -> Any:
        """The callback dropping ``key``'s entry when its storage's owner dies."""
        cache = weakref.ref(self.cache)

        def forget(ref: weakref.ReferenceType[torch.Tensor]) -> None:
            entries = cache()
            if entries is not None and key in entries and entries[key][0] is ref:
                del entries[key]

        return forget

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) is _Kept:
            if version_counter(packed.tensor) != packed.version:
                raise _modified(packed.tensor, packed.version)
            return packed.tensor
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[no-any-return]
        for ref in packed.refs:
            alive = ref()
            if alive is not None and version_counter(alive) != packed.version:
                raise _modified(alive, packed.version)
        restored = packed.restored
        hp = restored.tensor
        if hp is None:
            hp = _restore(packed)
        restored.pending -= 1
        restored.tensor = hp if restored.pending > 0 else None
        return hp


def _restore(packed: _Packed) -> torch.Tensor:
    """The saved tensor back in its dtype and strides."""
    hp = packed.quantizer.dequantize(packed.data, packed.scale)
    if hp.stride() == packed.stride:
        return hp
    if all(a == b or n == 1 for a, b, n in zip(hp.stride(), packed.stride, hp.shape)):
        # Only size-1 dims' strides differ: the same storage serves.
        return hp.as_strided(hp.shape, packed.stride)
    return torch.empty_strided(hp.shape, packed.stride, dtype=hp.dtype, device=hp.device).copy_(hp)


class save_activations_in_float8:
    """Store the tensors autograd saves for backward in FP8 while the context is active.

    Args:
        float8_dtype: an FP8 dtype (default e4m3fn).
        block: elements per fp32 scale along the last dim (default 128).
        min_numel: the smallest tensor compressed (default :data:`DEFAULT_MIN_NUMEL`).
        model, module_filter_fn: ``fn(module, fqn) -> False`` keeps what that module saves as is.
    Raises:
        ValueError: a bad ``float8_dtype``, ``block`` or ``min_numel``, or a filter without ``model``.
        TypeError: ``model`` not an ``nn.Module`` or ``module_filter_fn`` not callable.
        RuntimeError: entered inside a region torch.compile traces (eager only).

    >>> import torch, f8tensor
    >>> lin = torch.nn.Linear(256, 256)
    >>> x = torch.randn(512, 256)
    >>> with f8tensor.save_activations_in_float8():
    ...     y = torch.nn.functional.gelu(lin(x))
    >>> y.sum().backward()  # backward may run outside the context
    >>> lin.weight.grad.shape
    torch.Size([256, 256])
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    >>> keep_last = lambda module, fqn: fqn != "2"  # the second linear's input stays high precision
    >>> with f8tensor.save_activations_in_float8(model=mlp, module_filter_fn=keep_last):
    ...     loss = mlp(x).sum()
    >>> loss.backward()
    """

    def __init__(
        self,
        *,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        block: int = 128,
        min_numel: int = DEFAULT_MIN_NUMEL,
        model: nn.Module | None = None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    ) -> None:
        if float8_dtype not in FLOAT8_DTYPES:
            allowed = ", ".join(str(d) for d in FLOAT8_DTYPES)
            raise ValueError(f"float8_dtype must be one of {allowed}; got {float8_dtype!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block must be a positive int (elements per scale along the last dim); got {block!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0; got {min_numel!r}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None; got {type(model).__name__}")
        if module_filter_fn is not None and not callable(module_filter_fn):
            raise TypeError(
                f"module_filter_fn must be a callable (module, fqn) -> bool or None; got {module_filter_fn!r}"
            )
        if module_filter_fn is not None and model is None:
            raise ValueError("module_filter_fn needs model= (the module whose submodules it chooses among)")
        self.model = model
        self.module_filter_fn = module_filter_fn
        self.float8_dtype = float8_dtype
        self.block = block
        self.min_numel = min_numel
        self._entered: list[tuple[_Hooks, saved_tensors_hooks, list[Any]]] = []

    def __enter__(self) -> Self:
        if torch.compiler.is_compiling():
            raise RuntimeError(_EAGER_ONLY)
        hooks = _Hooks(self.float8_dtype, self.block, self.min_numel)
        handles = self._policy_hooks(hooks)
        manager = saved_tensors_hooks(hooks.pack, hooks.unpack)
        manager.__enter__()
        self._entered.append((hooks, manager, handles))
        return self

    def _policy_hooks(self, hooks: _Hooks) -> list[Any]:
        """Forward hooks on the outermost modules ``module_filter_fn`` rejects: while one of
        them runs, ``hooks`` packs nothing (their submodules need no hooks of their own)."""
        if self.model is None or self.module_filter_fn is None:
            return []
        rejected: list[str] = []
        handles: list[Any] = []
        try:
            for fqn, module in self.model.named_modules():
                if self.module_filter_fn(module, fqn):
                    continue
                if any(fqn.startswith(outer + ".") or outer == "" for outer in rejected):
                    continue
                rejected.append(fqn)
                handles.append(module.register_forward_pre_hook(hooks.enter_kept))
                handles.append(module.register_forward_hook(hooks.leave_kept, always_call=True))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hooks, manager, handles = self._entered.pop()
        for handle in handles:
            handle.remove()
        hooks.cache.clear()
        hooks.rows.clear()
        manager.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return (
            f"save_activations_in_float8(float8_dtype={self.float8_dtype}, block={self.block}, "
            f"min_numel={self.min_numel}"
            + ("" if self.module_filter_fn is None else f", module_filter_fn={self.module_filter_fn!r}")
            + ")"
        )
