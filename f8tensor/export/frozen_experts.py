"""A checkpoint's FP8 expert weights held as they are in the file: never trainable, multiplied as stored.

:class:`FrozenFloat8ExpertWeight` is the frozen counterpart of
:class:`~f8tensor.moe.Float8ExpertWeight`: a (num_experts, N, K) Float8Tensor of the file's
bytes (one scale set per expert) carrying the recipe of its products. The products Hugging
Face experts make with it (``F.linear(x, w[e])``, ``torch._grouped_mm`` / ``F.grouped_mm``,
transformers' grouped fallback and ``torch.bmm``) run per expert through ``Float8Linear``'s
Function with that expert's bytes as the weight operand (no grouped kernel multiplies held
bytes). Where the recipe's weight granularity is not the held one, each product re-casts
the dequantized expert (transient). Inputs get their gradients; the weight none.
"""

from __future__ import annotations

from typing import Any

import torch

from f8tensor.compat import (
    GROUPED_MM_FUNCTIONS,
    disable_torch_function_subclass,
    is_op_of_namespace,
    tree_map_only,
)
from f8tensor.export.frozen import FrozenFloat8Weight, recipe_reads
from f8tensor.nn.linear_autograd import LinearArgs, QuantizedLinearFn
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.quant.specs import DEFAULT_GEMM, GemmConfig
from f8tensor.tensor.float8 import Float8Tensor, dequantize

__all__ = ["CHECKPOINT_SCALE", "FrozenFloat8ExpertWeight", "expert_matrix"]

#: The experts module's non-persistent buffer beside each frozen expert tensor: the file's
#: multipliers (written back by ``save_fp8_pretrained`` while the tensor holds the file's bytes).
CHECKPOINT_SCALE = "{}_checkpoint_scale"


class FrozenFloat8ExpertWeight(FrozenFloat8Weight):
    """FP8 expert weights (E, N, K), or a view or piece of them, with ``_config``, the recipe of their products.

    Blocks: ``(1, 0, 0)`` one scale per expert, ``(1, 1, 0)`` per row, ``(1, 128, 128)``,
    ``(1, 1, 32)`` (e8m0). Ops run as on a Float8Tensor and come back as this class; the
    products listed in the module docstring run in FP8; other products are refused by name.
    """

    _config: Float8LinearConfig

    @staticmethod
    def __new__(  # noqa: PYI034 (staticmethod: no Self)
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        block: tuple[int, ...] | None,
        config: Float8LinearConfig,
        gemm: GemmConfig = DEFAULT_GEMM,
    ) -> FrozenFloat8ExpertWeight:
        self = Float8Tensor.__new__(cls, data, scale, orig_dtype, block, gemm)
        self._config = config  # type: ignore[attr-defined]
        return self  # type: ignore[return-value]

    @classmethod
    def of(cls, f8: Float8Tensor, config: Float8LinearConfig) -> FrozenFloat8ExpertWeight:
        """``f8``'s fields (shared) with ``config``."""
        return cls(f8._data, f8._scale, f8._orig_dtype, f8._block, config, f8._gemm)

    def plain(self) -> Float8Tensor:
        """The same fields as a plain Float8Tensor (a scale shared by a whole matrix is 0-dim)."""
        scale = self._scale
        if self.dim() == 2 and not any(self._block) and scale.dim():
            scale = scale.reshape(())
        return Float8Tensor(self._data, scale, self._orig_dtype, self._block, self._gemm)

    def expert(self, e: int) -> Float8Tensor:
        """Expert ``e``'s (N, K) matrix of a 3D tensor, as a plain Float8Tensor."""
        piece = self[e]
        assert isinstance(piece, FrozenFloat8ExpertWeight)  # views of one stay one
        return piece.plain()

    def _replace(self, **changes: Any) -> FrozenFloat8ExpertWeight:
        # View ops must return this class (aliasing checks the type); the recipe goes along.
        return type(self).of(super()._replace(**changes), self._config)

    def detach(self) -> FrozenFloat8ExpertWeight:  # type: ignore[override]
        return type(self).of(self, self._config)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        new = type(self)(
            self._data.clone(), self._scale.clone(), self._orig_dtype, self._block, self._config, self._gemm
        )
        out = torch.nn.Parameter(new, requires_grad=False) if self.__dict__.get("_is_param", False) else new
        memo[id(self)] = out
        return out

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale"], (self._orig_dtype, self._block, self._config, self._gemm)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> FrozenFloat8ExpertWeight:
        return FrozenFloat8ExpertWeight(inner["_data"], inner["_scale"], *meta)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FrozenFloat8ExpertWeight(shape={tuple(self.shape)}, block={self._block}, dtype={self._orig_dtype})"

    @classmethod
    def __torch_function__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is None and is_op_of_namespace(func, "transformers") and "grouped_mm" in str(func):
            route = _route_hf_fallback  # transformers' grouped fallback op
        if route is not None:
            return route(args, kwargs)
        if func in _REFUSED:
            raise NotImplementedError(
                f"{getattr(func, '__name__', func)} with frozen FP8 expert weights is not supported; they multiply "
                f"through F.linear(x, w[e]), torch._grouped_mm / F.grouped_mm or torch.bmm"
            )
        found: list[FrozenFloat8ExpertWeight] = []
        tree_map_only(FrozenFloat8ExpertWeight, found.append, (args, kwargs))
        config = found[0]._config  # this __torch_function__ runs only with one among the arguments
        with disable_torch_function_subclass():
            out = func(*args, **kwargs)
        return tree_map_only(Float8Tensor, lambda t: t if isinstance(t, cls) else cls.of(t, config), out)


def expert_matrix(w: FrozenFloat8ExpertWeight) -> torch.Tensor:
    """The (N, K) weight operand of one expert's product: its bytes where the recipe reads them, else
    their dequantized values (the recipe casts them per call)."""
    w8 = w.plain()
    if recipe_reads(w8, w._config.weight):
        return w8
    return dequantize(w8, torch.float32).to(w8._orig_dtype)  # transient, via fp32 deliberately


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.t() + bias`` for one expert's (N, K) matrix, through Float8Linear's Function."""
    assert isinstance(w, FrozenFloat8ExpertWeight)  # views of one stay one (__torch_function__)
    return QuantizedLinearFn.apply(x, expert_matrix(w), bias, LinearArgs(w._config))


def _plain_operand(t: Any, what: str) -> None:
    if isinstance(t, Float8Tensor):
        raise NotImplementedError(f"frozen FP8 expert weights multiply high-precision {what}; got a {type(t).__name__}")


def _route_linear(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "bias"), args))
    bound.update(kwargs)
    x, w, bias = bound["input"], bound["weight"], bound.get("bias")
    if not isinstance(w, FrozenFloat8ExpertWeight) or w.dim() != 2:
        raise NotImplementedError(
            f"F.linear with frozen FP8 expert weights needs one expert's 2D matrix as weight; got {tuple(w.shape)}"
        )
    _plain_operand(x, "inputs")
    _plain_operand(bias, "biases")
    return _linear(x, w, bias)


def _grouped(x: torch.Tensor, w: FrozenFloat8ExpertWeight, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of g] @ w[g]`` per expert, w (G, K, N); rows past ``offs[-1]`` give zeros."""
    ends = offs.tolist()  # this path's one host sync
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(_linear(x[start:end], w[g].t(), None))
        start = max(start, end)
    if start < x.shape[0] or not pieces:
        pieces.append(x.new_zeros(x.shape[0] - start, w.shape[2]))
    return torch.cat(pieces)


def _route_grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args))
    bound.update(kwargs)
    a, w, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
    if not isinstance(w, FrozenFloat8ExpertWeight) or w.dim() != 3 or a.dim() != 2 or offs is None:
        raise NotImplementedError(
            f"frozen FP8 expert weights take part in grouped_mm as mat_b (experts, K, N) with a 2D high-precision "
            f"mat_a and offs; got mat_a {tuple(a.shape)}, mat_b {tuple(w.shape)}, offs={offs is not None}"
        )
    _plain_operand(a, "inputs")
    if bound.get("bias") is not None:
        raise NotImplementedError("grouped_mm with frozen FP8 expert weights and a bias is not supported")
    out_dtype = bound.get("out_dtype")
    y = _grouped(a, w, offs)
    return y if out_dtype is None else y.to(out_dtype)


def _route_hf_fallback(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "offs"), args))
    bound.update(kwargs)
    return _route_grouped_mm((bound["input"], bound["weight"], bound["offs"]), {})


def _route_bmm(args: tuple, kwargs: dict) -> torch.Tensor:
    a, b = (*args, kwargs.get("mat2"))[:2]
    if isinstance(a, FrozenFloat8ExpertWeight) == isinstance(b, FrozenFloat8ExpertWeight) or a.dim() != 3:
        raise NotImplementedError("torch.bmm with frozen FP8 expert weights needs one 3D weight and one 3D input")
    if isinstance(b, FrozenFloat8ExpertWeight):  # x (B, M, K) @ w (B, K, N)
        _plain_operand(a, "inputs")
        pieces = [_linear(a[i], b[i].t(), None) for i in range(a.shape[0])]
        return torch.stack(pieces) if pieces else a.new_zeros(0, a.shape[1], b.shape[2])
    _plain_operand(b, "inputs")  # w (B, N, K) @ x (B, K, M): the transposed product
    pieces = [_linear(b[i].t(), a[i], None).t() for i in range(b.shape[0])]
    return torch.stack(pieces) if pieces else b.new_zeros(0, a.shape[1], b.shape[2])


_ROUTES: dict[Any, Any] = {
    **{fn: _route_grouped_mm for fn in GROUPED_MM_FUNCTIONS},
    torch.nn.functional.linear: _route_linear,
    torch.bmm: _route_bmm,
    torch.Tensor.bmm: _route_bmm,
}
# Products that would not run through a route: refused, never multiplied another way.
_REFUSED = frozenset(
    {
        torch.mm,
        torch.Tensor.mm,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
    }
)
