"""Activations saved for backward in FP8: :func:`save_activations_in_float8`.

Under ``with f8tensor.save_activations_in_float8():`` every tensor that autograd saves for
backward (through ``torch.autograd.graph.saved_tensors_hooks``) and that qualifies is
stored as FP8 data with one fp32 scale per ``block`` consecutive elements of its last dim,
and dequantized to its own dtype when backward reads it. Each tensor is cast by its block
quantizer (:func:`f8tensor.quant.block_quantizers.activation_quantizer`: a block of ``(1, ...,
1, block)``, ``data = saturate(x * scale)``, dynamic scale ``float8_max / block amax``,
round to nearest), through f8tensor's one block cast (:func:`f8tensor.kernels.cast`), and
comes back through the same quantizer (:func:`f8tensor.kernels.dequantize`). On CUDA
each is one fused Triton kernel (blocks of up to 1,024 elements; the data and scales of a
dense tensor in any dim order are laid out in its memory order), with the reference's bits;
elsewhere the reference's torch ops.

One restored copy per packed tensor: the saves that share an FP8 copy (below) share the
tensor its first unpack restores, held until the last of them has unpacked it (what
autograd does with the saved tensor itself without the context), so a backward
dequantizes each packed tensor once. (A backward that runs the graph again, with
``retain_graph=True``, restores it again.)

Which tensors are compressed: plain ``torch.Tensor`` s (not a subclass) of dtype fp32,
bf16 or fp16, with at least ``min_numel`` elements, a last dim of at least ``block``
elements and a dense layout (no broadcast strides). A last dim that is not a multiple of
``block`` ends in one shorter block with its own scale (the scale zero-padding would give,
without storing the padding). Left alone (saved as autograd saves them):

- integer, bool, fp64 and FP8 tensors; tensor subclasses (``Float8Tensor``, ``DTensor``,
  ``nn.Parameter``): f8tensor's own Functions already save FP8 data there, and a
  tensor already FP8 is never quantized again;
- parameters and their views, and every leaf that requires grad (what autograd
  accumulates into: its storage is kept alive by its owner anyway, so a copy would add
  memory, not save it);
- autocast's low-precision copies of parameters (the output of a ``_to_copy`` whose
  input is a leaf that requires grad) and views of them (the transposed copy a linear
  saves): they are recomputed by every autocast forward and read by the input-gradient
  products, which they would make less exact;
- per-row statistics: a tensor whose shape is that of a tensor saved before it (under
  the same context) with the last dim dropped, as attention's logsumexp (B, H, L) is of
  its q (B, H, L, E), or a ``logsumexp``'s result of its input. Backward exponentiates
  them against the activations they reduce: the error of an FP8 copy would reach every
  gradient through the attention;
- tensors with fewer than ``min_numel`` elements (default :data:`DEFAULT_MIN_NUMEL`,
  65,536: below it a tensor saves at most 64 KiB, less than what two extra kernel
  launches and the bookkeeping cost) and tensors whose last dim is shorter than
  ``block`` (a scale per few elements would cost more than it saves; LayerNorm's
  per-row mean and rstd are such tensors).

One FP8 copy per storage: a tensor that several ops save (q, k and v projections reading
the same normed input) is packed once. The copies are looked up by (device, storage
address, storage offset, shape, strides, dtype, version counter), and only while the
tensor first packed, or the base it is a view of, is alive (then its storage is too, so the
address cannot have been reused by another tensor; a linear's 2D view of a 3D input is a
new view object at every call, its base the same tensor). An in-place change bumps the
version: a tensor changed after it was saved is packed again when saved again, and
backward refuses to read a copy whose tensor (or the base it is a view of) was changed in
place since, with the error autograd gives without the context. (A change made only through
another view, after the saved tensor and its base were both freed, cannot be seen: nothing
of theirs is held.)

Every tensor saved under the context is checked so (autograd skips its own version check
under saved-tensor hooks): one left as it is, a weight included, raises at unpack when it
was changed in place after the save (a weight updated between forward and backward),
as autograd does without the context.

Non-finite values stay non-finite: a block holding an inf or a NaN has a non-finite amax
and comes back NaN as a whole (one element's NaN reaches the other elements of its
block; no finite value is ever made from it).

Per-module policy: ``save_activations_in_float8(model=model, module_filter_fn=fn)`` calls
``fn(module, fqn) -> bool`` once per module of ``model`` when the context is entered (``fqn``
as ``model.named_modules()`` spells it, ``""`` for ``model`` itself), as the converter's
``module_filter_fn`` does: ``True`` compresses what is saved while that module's forward
runs, ``False`` keeps it as autograd saves it (bf16 stays bf16), and with it everything its
submodules save. A tensor is attributed to the modules whose forwards are running when an op
saves it (a linear's input to the linear that reads it, not to the module that made it).
The policy is read from forward hooks the context puts on the rejected modules while it is
active (removed at exit, also on an exception): it follows modules whose forward runs in
eager; the tensors outside every rejected module, and those of a compiled module's graph
(packed around the graph), follow the context's other rules.

Backward may run outside the context (the packed copies carry everything they need);
contexts nest (the innermost one applies, as for any ``saved_tensors_hooks``); activation
checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``) composes: a
checkpointed region saves nothing but its inputs, and its recomputation in backward keeps
its tensors under checkpoint's own hooks.

Eager only: entering the context inside a region torch.compile traces, or a pack hook
called while tracing, raises a RuntimeError that says so. A compiled module called from
eager code under the context is compiled as usual; the tensors its compiled graph saves
are then packed by the context like any other saved tensor (in eager, around the graph).
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

#: Below this many elements a saved tensor is kept as is (see the module docstring).
DEFAULT_MIN_NUMEL = 65536
#: The dtypes of the saved tensors that are compressed.
COMPRESSED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_EAGER_ONLY = (
    "save_activations_in_float8() is eager-only: its saved-tensor hooks cannot run inside a region "
    "torch.compile traces. Enter the context outside the compiled function (the tensors a compiled "
    "graph saves are then packed around it, in eager), or drop it from the compiled code"
)


class _Kept:
    """A saved tensor kept as it is, with its version at save: autograd skips its own
    version check under saved-tensor hooks, so unpack makes it."""

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
    """The mutable part of a packed tensor: how many saves have not unpacked it yet, and
    the copy restored for them (held only while some have not)."""

    __slots__ = ("pending", "tensor")

    def __init__(self) -> None:
        self.pending = 1
        self.tensor: torch.Tensor | None = None


@dataclass(frozen=True)
class _Packed:
    """A saved tensor in FP8: ``data`` (the tensor's shape, laid out as the cast lays it
    out), ``scale`` (fp32, one per block of the last dim), the quantizer that cast them (the
    way back, to the tensor's dtype), and what the restore needs."""

    data: torch.Tensor
    scale: torch.Tensor
    quantizer: BlockQuantizer
    stride: tuple[int, ...]
    version: int
    # The tensor that was saved, and its base if it is a view (weak: held only to read
    # their shared version counter at unpack).
    refs: tuple[weakref.ReferenceType[torch.Tensor], ...]
    restored: _Restored


def _dense(t: torch.Tensor) -> bool:
    """Every element at its own address and the storage holding nothing else between them."""
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
    """A parameter, a view of one, any leaf autograd accumulates into, or autocast's copy
    of one of these (see the module docstring)."""
    base = view_base(t)
    # A view is judged by what it views (the transposed bf16 weight a linear saves), never
    # by its own flags: a view an autograd Function makes of its input inside forward (the
    # 2D input f8tensor's linear Functions save) is a leaf that requires grad without being
    # one autograd accumulates into.
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
        # The shapes of every saved tensor with its last dim dropped: a tensor of one of these
        # shapes is a per-row statistic of another (attention's logsumexp of its q), kept exact.
        self.rows: set[torch.Size] = set()
        # How many forwards of modules the policy keeps in high precision are running.
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
            return t  # no version counter (autograd refuses to save one for backward anyway)
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
        # The entry lives while the storage's owner does: the base of a view (views of it made
        # later hit the entry), else the tensor.
        owner = t if base is None else base
        self.cache[key] = (weakref.ref(owner, self._forget(key)), packed)
        return packed

    def _forget(self, key: tuple[Any, ...]) -> Any:
        """The callback that drops ``key``'s entry when its storage's owner dies: a context
        that spans many steps holds no copy longer than the tensor it was made from (or its
        base) lives (backward holds its own reference to the copies it reads)."""
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
        # Held for the saves still to unpack it, dropped by the last.
        restored.tensor = hp if restored.pending > 0 else None
        return hp


def _restore(packed: _Packed) -> torch.Tensor:
    """The saved tensor back in its dtype and strides."""
    hp = packed.quantizer.dequantize(packed.data, packed.scale)
    if hp.stride() == packed.stride:
        return hp
    if all(a == b or n == 1 for a, b, n in zip(hp.stride(), packed.stride, hp.shape)):
        # Only the strides of size-1 dims differ: they address nothing, the same storage serves.
        return hp.as_strided(hp.shape, packed.stride)
    return torch.empty_strided(hp.shape, packed.stride, dtype=hp.dtype, device=hp.device).copy_(hp)


class save_activations_in_float8:
    """Store the tensors autograd saves for backward in FP8 while the context is active.

    ``float8_dtype``: one of :data:`f8tensor.FLOAT8_DTYPES` (default e4m3fn). ``block``:
    elements per fp32 scale along the last dim (default 128, a positive int).
    ``min_numel``: the smallest tensor compressed (default :data:`DEFAULT_MIN_NUMEL`,
    an int >= 0). ``model`` and ``module_filter_fn(module, fqn) -> bool``: the per-module
    policy (``False`` keeps what that module and its submodules save as it is; see
    :mod:`f8tensor.nn.activations`). Which tensors are compressed, what is left alone and why:
    see the module docstring of :mod:`f8tensor.nn.activations`.

    Reusable and re-entrant: each ``with`` installs a fresh pair of hooks and its own
    per-storage cache; the cache is dropped at exit (the packed copies live on in the
    graph until backward has read them).

    Raises ``ValueError`` for a ``float8_dtype`` that is not FP8, a ``block`` that is not a
    positive int, a negative ``min_numel`` or a ``module_filter_fn`` without a ``model``;
    ``TypeError`` for a ``model`` that is not an ``nn.Module`` or a ``module_filter_fn`` that
    is not callable; ``RuntimeError`` when entered inside a region torch.compile traces
    (eager-only).

    >>> import torch, f8tensor
    >>> lin = torch.nn.Linear(256, 256)
    >>> x = torch.randn(512, 256)
    >>> with f8tensor.save_activations_in_float8():
    ...     y = torch.nn.functional.gelu(lin(x))  # lin's input and GELU's input: FP8 copies
    >>> y.sum().backward()  # backward may run outside the context
    >>> lin.weight.grad.shape
    torch.Size([256, 256])

    Keeping chosen modules' activations in high precision (here the second linear's input):

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    >>> keep_last = lambda module, fqn: fqn != "2"
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
            raise TypeError(f"module_filter_fn must be a callable (module, fqn) -> bool or None; got {module_filter_fn!r}")
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
