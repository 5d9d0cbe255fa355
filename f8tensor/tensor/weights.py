"""The shared base of the high-precision weight wrappers (FSDP2 FP8 all-gather, FP8 experts).

A :class:`HighPrecisionWeight` is a parameter that behaves like the plain bf16/fp16/fp32
tensor it wraps for every op (optimizer steps, ``copy_``, ``zero_``, views, sharding,
checkpoints) and differs only where its subclass says so: the FSDP2 all-gather hooks
(``distributed/fsdp.py``) or the matrix products its ``__torch_function__`` routes to FP8
(``f8tensor.moe``). What they share lives here:

- dispatch: unwrap, run on the plain tensors, rewrap. An in-place op returns its wrapped
  argument; a new result stays wrapped for the subclass's ``VIEWS`` (sharing the write
  count of the wrapper they view) and ``COPIES`` (a count of their own), if it is still of
  a high-precision dtype (so ``.to(bf16)`` follows the dtype); anything else is plain;
- write tracking: every op that writes into a wrapper or any view of it counts
  (:class:`WriteCount`), whichever subclass dispatched it;
- pickling as the plain tensor (checkpoints hold ordinary tensors and load with
  ``weights_only=True``), a view of a larger storage (a shard, a slice) cloned first so
  that only its own elements are written;
- flatten/unflatten for torch.compile (``_hp`` and the subclass's metadata).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, ClassVar

import torch
from torch import nn

from f8tensor.compat import disable_torch_function_subclass, make_wrapper_subclass, tree_map_only, written_arguments
from f8tensor.quant.formats import HP_DTYPES
from f8tensor.tensor.float8 import Float8Tensor

__all__ = ["HighPrecisionWeight", "Unwrap", "WriteCount", "check_dtype_change"]


def check_dtype_change(kind: type, new: Any) -> None:
    """Refuse ``param.data = new`` when ``new`` would make a ``kind`` wrapper lie about its
    dtype (``model.double()`` sets ``.data`` to a plain float64 tensor: the wrapper would
    claim float64 and keep its old ``_hp``). bf16/fp16/fp32 conversions rebuild the wrapper
    (``Module._apply`` swaps a wrapper result in) and never get here with a plain tensor."""
    if isinstance(new, torch.Tensor) and not isinstance(new, HighPrecisionWeight):
        raise TypeError(
            f"{kind.__name__} holds a bf16, fp16 or fp32 weight (what FP8 casts start from); cannot set its data to a "
            f"plain {new.dtype} tensor (e.g. model.double()). Change the dtype before converting to FP8, or use "
            "model.to(torch.bfloat16 / torch.float16 / torch.float32)."
        )


class WriteCount:
    """How often the data under a wrapper and its views has been written.

    Not the autograd version counter: a view made inside another subclass's dispatch (a
    DTensor's ``detach``, as in ``state_dict``) gets a fresh version counter, yet writes
    through it (a checkpoint load) change the weight all the same.
    """

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class HighPrecisionWeight(torch.Tensor):
    """A plain high-precision tensor, wrapped (see the module docstring).

    Fields: ``_hp``, the plain tensor (or a view/piece of it); ``_writes``, the
    :class:`WriteCount` shared with every wrapper viewing the same data. A subclass adds its
    metadata (what ``_meta`` returns, passed back to its constructor after ``_hp``), sets
    ``VIEWS`` and ``COPIES``, and chooses its ``__torch_function__``.
    """

    _hp: torch.Tensor
    _writes: WriteCount

    #: Ops whose result is a view of the weight (stays wrapped, shares the write count).
    VIEWS: ClassVar[frozenset[Any]] = frozenset()
    #: Ops whose result is a new tensor still standing for the weight (stays wrapped).
    COPIES: ClassVar[frozenset[Any]] = frozenset()

    @staticmethod
    def _check_hp(kind: type, hp: torch.Tensor) -> None:
        """``hp`` is a plain bf16/fp16/fp32 tensor (the subclass's ``__new__`` checks first)."""
        if isinstance(hp, (HighPrecisionWeight, Float8Tensor)):
            raise TypeError(f"{kind.__name__} wraps a plain high-precision tensor; got a {type(hp).__name__}")
        if hp.dtype not in HP_DTYPES:
            raise TypeError(f"{kind.__name__} wraps a bf16, fp16 or fp32 tensor; got {hp.dtype}")

    @staticmethod
    def _wrap(kind: type, hp: torch.Tensor, writes: WriteCount | None) -> Any:
        """A new ``kind`` over ``hp`` (the subclass's ``__new__`` calls it after its checks)."""
        self = make_wrapper_subclass(kind, hp, dtype=hp.dtype, requires_grad=hp.requires_grad)
        self._hp = hp
        self._writes = writes if writes is not None else WriteCount()
        return self

    def _meta(self) -> tuple:
        """The subclass's metadata: its constructor's arguments after ``_hp``."""
        raise NotImplementedError

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        # Serialized (torch.save, torch.distributed.checkpoint, pickle) as the plain tensor it
        # wraps: checkpoints hold ordinary tensors, load with weights_only=True, and move
        # freely between models with and without the wrapper. Loading into a wrapper goes
        # through copy_ like any other write. A piece that views a larger (padded, sliced)
        # buffer is copied first so that only its own elements are written.
        hp = self._hp
        if hp.untyped_storage().nbytes() != hp.nbytes:
            hp = hp.clone()
        if isinstance(self, nn.Parameter):
            hp = nn.Parameter(hp, requires_grad=self.requires_grad)
        return hp.__reduce_ex__(protocol)

    def _stable_hash_for_caching(self) -> str:
        """A process-independent key of this weight for torch.compile's caches (AOT autograd
        asks traceable subclasses for one): the wrapper's type, shape, strides and dtype,
        the plain tensor's layout and the subclass's metadata (frozen configs, whose repr
        is their value)."""
        hp = self._hp
        key = (
            type(self).__qualname__, tuple(self.shape), self.stride(), str(self.dtype), self.requires_grad,
            tuple(hp.shape), hp.stride(), hp.storage_offset(), str(hp.dtype), hp.device.type, repr(self._meta()),
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_hp"], self._meta()

    def data_ptr(self) -> int:
        """The address of the plain tensor's first element: a wrapper stands for its data.

        A wrapper subclass has no storage of its own (torch's ``data_ptr`` gives 0 for it),
        yet code outside the package tells parameters apart by address: accelerate maps an
        optimizer's parameters to their FSDP2 shards by ``data_ptr()``, and with every
        wrapped weight at 0 it handed all of them the same shard. torch itself reads
        ``data_ptr() == 0`` as "a wrapper subclass" in ``deepcopy`` and ``__reduce_ex__``:
        both are defined here instead."""
        return self._hp.data_ptr()

    def __deepcopy__(self, memo: dict) -> Any:
        # What torch's deepcopy does for a wrapper subclass: a copy of the data, wrapped, its
        # own write count, requires_grad and grad kept, the rest of __dict__ deep-copied
        # (metadata, _is_param; within a model copy, references to the copied modules).
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = type(self)(copy.deepcopy(self._hp, memo), *self._meta())
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        rest = {k: v for k, v in self.__dict__.items() if k not in ("_hp", "_writes")}
        new.__dict__.update(copy.deepcopy(rest, memo))
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        wrapped: dict[int, HighPrecisionWeight] = {}

        def unwrap(w: HighPrecisionWeight) -> torch.Tensor:
            wrapped.setdefault(id(w._hp), w)
            return w._hp

        kwargs = kwargs or {}
        out = func(*tree_map_only(HighPrecisionWeight, unwrap, args), **tree_map_only(HighPrecisionWeight, unwrap, kwargs))
        for written in written_arguments(func, args, kwargs):
            if isinstance(written, HighPrecisionWeight):
                written._writes.n += 1
        first = next(iter(wrapped.values()))
        view, copy = func in first.VIEWS, func in first.COPIES

        def rewrap(t: torch.Tensor) -> torch.Tensor:
            same = wrapped.get(id(t))
            if same is not None and same._hp is t:
                return same  # an in-place op returns its (wrapped) argument
            if (view or copy) and t.dtype in HP_DTYPES:
                # Each subclass's __new__ takes (hp, *meta, writes=); torch's stubs know Tensor's only.
                return type(first)(t, *first._meta(), writes=first._writes if view else None)  # type: ignore[call-overload]
            return t

        return tree_map_only(torch.Tensor, rewrap, out)


class Unwrap(torch.autograd.Function):
    """The plain tensor inside a :class:`HighPrecisionWeight`, with the gradient passed
    through: how the routes of a :class:`RecipeWeight` hand its data to the FP8 products."""

    @staticmethod
    def forward(ctx: Any, w: HighPrecisionWeight) -> torch.Tensor:  # type: ignore[override]
        # Through dispatch (view.dtype is in no subclass's VIEWS or COPIES: the result is the
        # plain alias of _hp), not through the attribute: torch.export traces above the
        # subclass, where ``w._hp`` would be an untracked tensor (lifted as a constant).
        return w.view(w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class RecipeWeight(HighPrecisionWeight):
    """A wrapped weight that carries the recipe its products use (a ``Float8LinearConfig``):
    the shared constructor, metadata and pickling of the expert and attention weights."""

    _config: Any

    @staticmethod
    def __new__(cls, hp: torch.Tensor, config: Any, *, writes: WriteCount | None = None) -> Any:
        HighPrecisionWeight._check_hp(cls, hp)
        self = HighPrecisionWeight._wrap(cls, hp, writes)
        self._config = config
        return self

    def _meta(self) -> tuple:
        return (self._config,)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._hp!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # type: ignore[override]
        # A parameter (whole-model pickle, torch.save(model), deepcopy) comes back wrapped,
        # with its recipe: the copy runs its products in FP8 as the original does. Anything
        # else (a state_dict, which holds the plain tensors, an optimizer state) pickles as
        # the plain tensor (HighPrecisionWeight.__reduce_ex__).
        if not isinstance(self, nn.Parameter):
            return super().__reduce_ex__(protocol)
        hp = self._hp
        if hp.untyped_storage().nbytes() != hp.nbytes:
            hp = hp.clone()
        return (rebuild_recipe_parameter, (type(self), hp.detach(), self._config, self.requires_grad))

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Any:
        return cls(inner["_hp"], *meta)

    # ----------------------------------------------------------------- FSDP2 extension
    # High-precision all-gather (in mp_policy.param_dtype): the gathered weight is wrapped
    # again with its recipe, so the unsharded weight still multiplies in FP8. Without these
    # hooks FSDP2 would gather a plain tensor and the products would silently run in high
    # precision. Plain methods FSDP2 looks up on the parameter: nothing from torch.distributed.
    # The subclass's COPIES keep new_zeros / new_empty (FSDP2 allocates the padded shard so).

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        hp = self._hp
        if mp_policy.param_dtype is not None and hp.dtype != mp_policy.param_dtype:
            hp = hp.to(mp_policy.param_dtype)
        # FSDP pads every shard along dim 0 to the size of the first (ceil(rows / world)).
        rows = -(-outer_size[0] // mesh.size())
        if hp.shape[0] < rows:
            hp = torch.nn.functional.pad(hp, [0, 0] * (hp.dim() - 1) + [0, rows - hp.shape[0]])
        return (hp.contiguous(),), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (data,) = all_gather_outputs
        if out is not None:  # the gathered values already sit in out's storage
            return None
        return type(self)(data, *self._meta()), (data,)

    @classmethod
    def _route(cls, func: Any) -> Any:
        """The handler ``(args, kwargs) -> result`` of a call this weight's products take
        (``F.linear`` and friends, in FP8), or None: the call runs on the plain tensor."""
        return None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:  # type: ignore[override]
        route = cls._route(func)
        if route is not None:
            return route(args, kwargs or {})
        if _SET_DATA == func:  # a method-wrapper: a new object per access, equal by value
            check_dtype_change(cls, args[1])
        if torch.is_inference_mode_enabled():
            # A view of a (normal) parameter made under inference_mode becomes an inference
            # tensor whose version counter autograd cannot set: views and copies of the
            # weight are made outside it (without grad), the product itself runs inside.
            with torch.inference_mode(False), torch.no_grad(), disable_torch_function_subclass():
                return func(*args, **(kwargs or {}))
        with disable_torch_function_subclass():
            return func(*args, **(kwargs or {}))


_SET_DATA = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # a getset descriptor at run time; the stubs declare a plain attribute


def rebuild_recipe_parameter(kind: type, hp: torch.Tensor, config: Any, requires_grad: bool) -> nn.Parameter:
    """Unpickling a :class:`RecipeWeight` parameter."""
    return nn.Parameter(kind(hp, config), requires_grad=requires_grad)
