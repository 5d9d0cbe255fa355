"""The shared base of the high-precision weight wrappers (FSDP2 FP8 all-gather, FP8 experts).

A :class:`HighPrecisionWeight` behaves like the plain tensor it wraps for every op and
differs only where its subclass says so (FSDP2 hooks, FP8 products). Invariants:

- dispatch unwraps, runs and rewraps: an in-place op returns its wrapped argument; results
  of ``VIEWS`` (sharing the write count) and ``COPIES`` stay wrapped while high precision;
- every write into a wrapper or any view of it counts (:class:`WriteCount`);
- it pickles as the plain tensor (only its own elements).
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
    """Refuse ``param.data = new`` with a plain tensor (``model.double()``): the wrapper would lie about its dtype.

    Raises:
        TypeError: ``new`` is a plain tensor.
    """
    if isinstance(new, torch.Tensor) and not isinstance(new, HighPrecisionWeight):
        raise TypeError(
            f"{kind.__name__} holds a bf16, fp16 or fp32 weight (what FP8 casts start from); cannot set its data to a "
            f"plain {new.dtype} tensor (e.g. model.double()). Change the dtype before converting to FP8, or use "
            "model.to(torch.bfloat16 / torch.float16 / torch.float32)."
        )


class WriteCount:
    """How often the data under a wrapper and its views has been written.

    Not the autograd version counter: a view made in another subclass's dispatch (DTensor's
    ``detach``) gets a fresh one, yet writes through it change the weight.
    """

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class HighPrecisionWeight(torch.Tensor):
    """A plain high-precision tensor, wrapped.

    Fields: ``_hp``, the plain tensor; ``_writes``, the :class:`WriteCount` shared with its views.
    A subclass adds metadata (``_meta``), ``VIEWS``, ``COPIES`` and its ``__torch_function__``.
    """

    _hp: torch.Tensor
    _writes: WriteCount

    #: Ops whose result is a view of the weight.
    VIEWS: ClassVar[frozenset[Any]] = frozenset()
    #: Ops whose result is a new tensor standing for the weight.
    COPIES: ClassVar[frozenset[Any]] = frozenset()

    @staticmethod
    def _check_hp(kind: type, hp: torch.Tensor) -> None:
        """Refuse anything but a plain bf16/fp16/fp32 tensor."""
        if isinstance(hp, (HighPrecisionWeight, Float8Tensor)):
            raise TypeError(f"{kind.__name__} wraps a plain high-precision tensor; got a {type(hp).__name__}")
        if hp.dtype not in HP_DTYPES:
            raise TypeError(f"{kind.__name__} wraps a bf16, fp16 or fp32 tensor; got {hp.dtype}")

    @staticmethod
    def _wrap(kind: type, hp: torch.Tensor, writes: WriteCount | None) -> Any:
        """A new ``kind`` over ``hp``."""
        self = make_wrapper_subclass(kind, hp, dtype=hp.dtype, requires_grad=hp.requires_grad)
        self._hp = hp
        self._writes = writes if writes is not None else WriteCount()
        return self

    def _meta(self) -> tuple:
        """The subclass's constructor arguments after ``_hp``."""
        raise NotImplementedError

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        # Saved as the plain tensor (checkpoints load with weights_only=True, with or without the
        # wrapper); a piece of a larger buffer is copied first.
        hp = self._hp
        if hp.untyped_storage().nbytes() != hp.nbytes:
            hp = hp.clone()
        if isinstance(self, nn.Parameter):
            hp = nn.Parameter(hp, requires_grad=self.requires_grad)
        return hp.__reduce_ex__(protocol)

    def _stable_hash_for_caching(self) -> str:
        """A process-independent key for torch.compile's caches."""
        hp = self._hp
        key = (
            type(self).__qualname__,
            tuple(self.shape),
            self.stride(),
            str(self.dtype),
            self.requires_grad,
            tuple(hp.shape),
            hp.stride(),
            hp.storage_offset(),
            str(hp.dtype),
            hp.device.type,
            repr(self._meta()),
        )
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_hp"], self._meta()

    def data_ptr(self) -> int:
        """The plain tensor's address: code outside tells parameters apart by it (accelerate's FSDP2
        shard map); torch's 0 for wrappers would give them all one shard.
        """
        return self._hp.data_ptr()

    def __deepcopy__(self, memo: dict) -> Any:
        # What torch's deepcopy does for a wrapper subclass, with its own write count.
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
        out = func(
            *tree_map_only(HighPrecisionWeight, unwrap, args), **tree_map_only(HighPrecisionWeight, unwrap, kwargs)
        )
        for written in written_arguments(func, args, kwargs):
            if isinstance(written, HighPrecisionWeight):
                written._writes.n += 1
        first = next(iter(wrapped.values()))
        view, copy = func in first.VIEWS, func in first.COPIES

        def rewrap(t: torch.Tensor) -> torch.Tensor:
            same = wrapped.get(id(t))
            if same is not None and same._hp is t:
                return same
            if (view or copy) and t.dtype in HP_DTYPES:
                # Each subclass's __new__ takes (hp, *meta, writes=).
                return type(first)(t, *first._meta(), writes=first._writes if view else None)  # type: ignore[call-overload]
            return t

        return tree_map_only(torch.Tensor, rewrap, out)


class Unwrap(torch.autograd.Function):
    """The plain tensor inside a :class:`HighPrecisionWeight`, gradient passed through."""

    @staticmethod
    def forward(ctx: Any, w: HighPrecisionWeight) -> torch.Tensor:  # type: ignore[override]
        # Through dispatch, not ``w._hp``: torch.export traces above the subclass, where ``_hp``
        # would be lifted as a constant.
        return w.view(w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class RecipeWeight(HighPrecisionWeight):
    """A wrapped weight that carries the recipe (a ``Float8LinearConfig``) its products use."""

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
        # A parameter comes back wrapped with its recipe; anything else pickles as the plain tensor.
        if not isinstance(self, nn.Parameter):
            return super().__reduce_ex__(protocol)
        hp = self._hp
        if hp.untyped_storage().nbytes() != hp.nbytes:
            hp = hp.clone()
        return (rebuild_recipe_parameter, (type(self), hp.detach(), self._config, self.requires_grad))

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Any:
        return cls(inner["_hp"], *meta)

    # FSDP2: the gathered weight is wrapped again with its recipe, else its products would
    # silently run in high precision.

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        hp = self._hp
        if mp_policy.param_dtype is not None and hp.dtype != mp_policy.param_dtype:
            hp = hp.to(mp_policy.param_dtype)
        # FSDP pads every shard along dim 0 to the first's size.
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
        if out is not None:
            out._config = self._config  # type: ignore[attr-defined]  # a recipe set since
            return None
        return type(self)(data, *self._meta()), (data,)

    @classmethod
    def _route(cls, func: Any) -> Any:
        """The FP8 handler ``(args, kwargs) -> result`` of ``func``, or None."""
        return None

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:  # type: ignore[override]
        route = cls._route(func)
        if route is not None:
            return route(args, kwargs or {})
        if _SET_DATA == func:  # a method-wrapper: compare by value
            check_dtype_change(cls, args[1])
        if torch.is_inference_mode_enabled():
            # Views made under inference_mode become inference tensors autograd cannot version: make them
            # outside it.
            with torch.inference_mode(False), torch.no_grad(), disable_torch_function_subclass():
                return func(*args, **(kwargs or {}))
        with disable_torch_function_subclass():
            return func(*args, **(kwargs or {}))


_SET_DATA = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # a getset descriptor at run time; the stubs declare a plain attribute


def set_recipe(weight: torch.Tensor, config: Any) -> None:
    """Run ``weight``'s products (a :class:`RecipeWeight` or a DTensor of one) with ``config``."""
    local = getattr(weight, "_local_tensor", weight)
    assert isinstance(local, RecipeWeight)  # callers pass the weights they wrapped
    local._config = config


def rebuild_recipe_parameter(kind: type, hp: torch.Tensor, config: Any, requires_grad: bool) -> nn.Parameter:
    """Unpickle a :class:`RecipeWeight` parameter."""
    return nn.Parameter(kind(hp, config), requires_grad=requires_grad)
