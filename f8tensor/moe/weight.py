"""The FP8 expert weight: :class:`Float8ExpertWeight`, which behaves like the plain tensor it
wraps and routes the products models make with it (``F.linear``, ``torch.bmm``,
``torch.matmul``, ``grouped_mm`` and transformers' grouped fallback op) to the FP8 Functions
of ``autograd``; :func:`float8_grouped_mm`, the grouped product's entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from f8tensor.compat import GROUPED_MM_FUNCTIONS, is_op_of_namespace
from f8tensor.gemm.grouped import DELAYED_EXPERTS, validate_grouped_mm_args
from f8tensor.moe.autograd import _expert_loop, _ExpertBmmFn, _GroupedMMFn, per_expert_loop
from f8tensor.nn.linear_autograd import LinearArgs
from f8tensor.nn.linear_autograd import QuantizedLinearFn as _QuantizedLinearFn  # looked up at call time, here
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.tensor.weights import RecipeWeight
from f8tensor.tensor.weights import Unwrap as _Unwrap

__all__ = ["Float8ExpertWeight", "float8_grouped_mm"]

aten = torch.ops.aten


# ===================================================================== the parameter wrapper


def _plain(t: Any) -> Any:
    return _Unwrap.apply(t) if isinstance(t, Float8ExpertWeight) else t


def _route_grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    a, w, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
    if (
        isinstance(a, Float8ExpertWeight)
        or not isinstance(w, Float8ExpertWeight)
        or a.dim() != 2
        or w.dim() != 3
        or offs is None
    ):
        raise NotImplementedError(
            "FP8 expert weights take part in grouped_mm as mat_b, 3D (experts, K, N), with a 2D mat_a "
            f"and offs; got mat_a {tuple(a.shape)}, mat_b {tuple(w.shape)}, offs={'None' if offs is None else 'given'}"
        )
    if bound.get("bias") is not None:
        raise NotImplementedError("FP8 grouped_mm with bias is not supported (torch._scaled_grouped_mm takes none)")
    out_dtype = bound.get("out_dtype")
    y = float8_grouped_mm(a, w, offs)
    return y if out_dtype is None else y.to(out_dtype)


def _route_hf_fallback(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "offs"), args))
    bound.update(kwargs)
    return float8_grouped_mm(bound["input"], bound["weight"], bound["offs"])


def _route_bmm(args: tuple, kwargs: dict) -> torch.Tensor:
    a, b = (list(args) + [kwargs.get("mat2")])[:2] if len(args) < 2 else args[:2]
    config = (b if isinstance(b, Float8ExpertWeight) else a)._config
    if isinstance(a, Float8ExpertWeight) and isinstance(b, Float8ExpertWeight):
        raise NotImplementedError("bmm of two FP8 expert weights is not an expert GEMM")
    bmm = (
        (lambda x, w: _expert_loop(x, w, None, config))
        if per_expert_loop(config)
        else (lambda x, w: _ExpertBmmFn.apply(x, w, config))
    )
    if isinstance(b, Float8ExpertWeight):
        return bmm(a, _Unwrap.apply(b))
    # weight on the left (HF's default layout: w (B, N, K) @ x (B, K, 1)): transpose the product
    return bmm(b.transpose(1, 2), _Unwrap.apply(a).transpose(1, 2)).transpose(1, 2)


def _route_linear(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "bias"), args))
    bound.update(kwargs)
    x, w, bias = bound["input"], bound["weight"], bound.get("bias")
    if not isinstance(w, Float8ExpertWeight) or w.dim() != 2 or isinstance(x, Float8ExpertWeight):
        raise NotImplementedError(
            f"F.linear with an FP8 expert weight needs one expert's 2D matrix as weight; got {tuple(w.shape)}"
        )
    # One expert's matrix: exactly Float8Linear's three GEMMs (and its recipe, e5m2 gradients included).
    return _QuantizedLinearFn.apply(x, _Unwrap.apply(w), _plain(bias), LinearArgs(w._config))


def _route_matmul(args: tuple, kwargs: dict) -> torch.Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if isinstance(b, Float8ExpertWeight) and not isinstance(a, Float8ExpertWeight):
        if b.dim() == 2:  # x @ w[e].t()
            return _route_linear((a, b.transpose(0, 1)), {})
        if b.dim() == 3 and a.dim() == 3:
            return _route_bmm((a, b), {})
    if isinstance(a, Float8ExpertWeight) and not isinstance(b, Float8ExpertWeight) and a.dim() == 3 and b.dim() == 3:
        return _route_bmm((a, b), {})
    raise NotImplementedError(
        f"matmul with an FP8 expert weight supports x @ w[e].t() and batched 3D x 3D products; got "
        f"{tuple(a.shape)} @ {tuple(b.shape)}"
    )


_ROUTES: dict[Any, Callable[[tuple, dict], torch.Tensor]] = {
    **{fn: _route_grouped_mm for fn in GROUPED_MM_FUNCTIONS},
    torch.bmm: _route_bmm,
    torch.Tensor.bmm: _route_bmm,
    torch.nn.functional.linear: _route_linear,
    torch.matmul: _route_matmul,
    torch.Tensor.matmul: _route_matmul,
    torch.Tensor.__matmul__: _route_matmul,
}


def _register_hf_fallback() -> None:
    """transformers' compile-friendly grouped fallback op, when transformers registered it."""
    try:
        op = torch.ops.transformers.grouped_mm_fallback
    except (AttributeError, RuntimeError):
        return
    _ROUTES[op] = _route_hf_fallback
    _ROUTES[op.default] = _route_hf_fallback


# Products reaching dispatch would run in high precision: refused.
_GEMMS = frozenset(
    {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default}
)


class Float8ExpertWeight(RecipeWeight):
    """A high-precision expert weight (E, N, K) whose matrix products run in FP8.

    Fields: ``_hp``, the plain tensor (or a piece of it); ``_config``, the
    :class:`Float8LinearConfig` of its GEMMs (dynamic scaling). Views, expert selection and
    copies stay wrapped so the product they reach runs in FP8; a ``state_dict`` holds the plain
    tensor, a parameter pickles wrapped.

    Raises:
        ValueError: a delayed ``config`` (its products would have no amax history).
        NotImplementedError: a product it cannot run in FP8 (named), never a silent upcast.
        TypeError: its data set to another dtype (``model.double()``).
    """

    _config: Float8LinearConfig

    @staticmethod
    def __new__(cls, hp: torch.Tensor, config: Float8LinearConfig, *, writes: Any = None) -> Any:
        if writes is None and config.any_delayed:  # a view shares a checked weight's config
            raise ValueError(f"Float8ExpertWeight: {DELAYED_EXPERTS}")
        return RecipeWeight.__new__(cls, hp, config, writes=writes)

    VIEWS = frozenset(
        {
            aten.detach.default,
            aten.alias.default,
            aten.view.default,
            aten._unsafe_view.default,
            aten.as_strided.default,
            aten.slice.Tensor,
            aten.select.int,
            aten.transpose.int,
            aten.t.default,
            aten.permute.default,
            aten.expand.default,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.split.Tensor,
            aten.split_with_sizes.default,
            aten.unbind.int,
        }
    )
    COPIES = frozenset(
        {
            aten.index.Tensor,
            aten.clone.default,
            aten._to_copy.default,
            aten.empty_like.default,
            aten.new_empty.default,
            aten.new_zeros.default,
            aten._pin_memory.default,
        }
    )

    @classmethod
    def _route(cls, func: Any) -> Any:
        route = _ROUTES.get(func)
        if route is None and is_op_of_namespace(func, "transformers"):
            _register_hf_fallback()  # weights wrapped by hand
            route = _ROUTES.get(func)
        return route

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _GEMMS or is_op_of_namespace(func, "transformers"):
            raise NotImplementedError(
                f"{func} with an FP8 expert weight would run in high precision. Expert weights multiply "
                f"through F.linear(x, w[e]), torch.bmm, torch.matmul or torch._grouped_mm / F.grouped_mm; "
                f"use w._hp for a high-precision product."
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


def float8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: Float8LinearConfig | None = None
) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` in FP8, differentiable in ``x`` and ``w``.

    Args:
        x: (M, K) tokens sorted by expert.
        w: (G, K, N), a plain tensor or a :class:`Float8ExpertWeight` (then its config).
        offs: (G,) cumulative token counts, an integer tensor or list; groups may be empty.
        config: the recipe for a plain ``w`` (default: tensorwise).

    Raises:
        TypeError: ``x``/``w`` not bf16/fp16/fp32, a bad ``offs`` or ``config``.
        ValueError: a delayed recipe; bad shapes; K or N not a multiple of 16; ``offs``
            decreasing or outside [0, M] (on CUDA and under compile by an asynchronous assert).

    Example:
        >>> from f8tensor import float8_grouped_mm
        >>> x = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(3, 32, 64, dtype=torch.bfloat16, requires_grad=True)
        >>> offs = torch.tensor([16, 16, 48], dtype=torch.int32)  # expert 1 gets no token
        >>> float8_grouped_mm(x, w, offs).shape
        torch.Size([48, 64])
    """
    if isinstance(w, Float8ExpertWeight):
        config = w._config if config is None else config
        w = _Unwrap.apply(w)
    elif config is None:
        config = Float8LinearConfig()
    offs = validate_grouped_mm_args(x, w, offs, config)
    if per_expert_loop(config):
        return _expert_loop(x.to(w.dtype), w, offs, config)
    return _GroupedMMFn.apply(x.to(w.dtype), w, offs, config)
