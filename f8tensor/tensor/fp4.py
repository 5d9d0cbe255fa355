"""Float4Tensor: packed E2M1 data with NVFP4 or MXFP4 block scales, and its layout ops.

A sibling of Float8Tensor, not a block spec of it: the payload's shape differs from the
tensor's (two elements a byte) and its scales are decode factors
(``x ~= e2m1 * block_scale * global_scale``), where Float8Tensor stores the reciprocal.
Layout ops move the scales with the data; a view or slice that would split a packed byte or
a block raises ``ValueError``, and any other op is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from typing_extensions import TypeIs

from f8tensor.compat import make_wrapper_subclass_shaped, return_and_correct_aliasing
from f8tensor.kernels.fp4 import FP4Spec, cast_fp4, dequantize_fp4, pack_e2m1, unpack_e2m1
from f8tensor.quant.formats import check_hp_dtype
from f8tensor.quant.specs import DEFAULT_GEMM, GemmConfig
from f8tensor.tensor.subclass import OpHandler, QuantizedTensor
from f8tensor.tensor.validation import check_unused_cast_args

__all__ = ["Float4Tensor", "from_hp_fp4", "is_float4", "to_float4", "to_float4_with_stats"]

aten = torch.ops.aten


def _outer_strides(data: torch.Tensor, pack_dim: int) -> tuple[int, ...]:
    # Strides in elements: a byte holds two, except along the packed dim itself.
    return tuple(s if d == pack_dim else 2 * s for d, s in enumerate(data.stride()))


class Float4Tensor(QuantizedTensor):
    """An FP4 tensor (NVFP4 or MXFP4) that stands for a high-precision one.

    Fields:

    - ``_data``: ``torch.float4_e2m1fn_x2`` bytes, the outer shape with ``_pack_dim`` halved
      (element ``2i`` in the low nibble).
    - ``_scale``: one decode factor per block, e4m3 (NVFP4) or e8m0 (MXFP4).
    - ``_global_scale``: 0-dim fp32 decode factor (1 for MXFP4).
    - ``_block``: elements per scale along each dim (they tile the tensor exactly).
    - ``_pack_dim``: the dim two elements share a byte along.
    - ``_kind``: ``"nvfp4"`` or ``"mxfp4"``; ``_orig_dtype``; ``_gemm``.
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _global_scale: torch.Tensor
    _orig_dtype: torch.dtype
    _block: tuple[int, ...]
    _pack_dim: int
    _kind: str
    _gemm: GemmConfig

    _OPS: ClassVar[dict[Any, OpHandler]] = {}
    _UNSUPPORTED: ClassVar[str] = (
        "Float4Tensor does not support {func}. FP4 data only takes part in matrix products (mm, addmm, "
        "matmul, linear) and layout ops that keep bytes and blocks whole; call .to_hp() first."
    )

    @staticmethod
    def __new__(  # noqa: PYI034 (staticmethod: no Self)
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor,
        orig_dtype: torch.dtype,
        block: tuple[int, ...],
        pack_dim: int,
        kind: str,
        gemm: GemmConfig = DEFAULT_GEMM,
    ) -> Float4Tensor:
        shape = tuple(2 * s if d == pack_dim else s for d, s in enumerate(data.shape))
        self = make_wrapper_subclass_shaped(
            cls, shape, _outer_strides(data, pack_dim), device=data.device, dtype=orig_dtype
        )
        self._data, self._scale, self._global_scale = data, scale, global_scale
        self._orig_dtype, self._block, self._pack_dim, self._kind, self._gemm = orig_dtype, block, pack_dim, kind, gemm
        return self

    def _replace(self, **changes: Any) -> Float4Tensor:
        """The one way to rebuild: a new Float4Tensor with some fields changed."""
        fields: dict[str, Any] = {
            "data": self._data,
            "scale": self._scale,
            "global_scale": self._global_scale,
            "orig_dtype": self._orig_dtype,
            "block": self._block,
            "pack_dim": self._pack_dim,
            "kind": self._kind,
            "gemm": self._gemm,
        }
        fields.update(changes)
        return Float4Tensor(**fields)

    @staticmethod
    def from_hp(
        hp: torch.Tensor,
        kind: str = "nvfp4",
        *,
        block: tuple[int, ...] | None = None,
        pack_dim: int = -1,
        scale_mode: str = "rceil",
        rounding: str = "nearest",
        four_over_six: bool = False,
        generator: torch.Generator | None = None,
    ) -> Float4Tensor:
        """Cast a bf16/fp16/fp32 tensor to FP4, differentiably.

        Args:
            block: default 16 (NVFP4) or 32 (MXFP4) elements along the last dim.
            pack_dim: the dim two elements share a byte along.

        Raises:
            TypeError: ``hp`` is not bf16/fp16/fp32; a bad ``four_over_six`` or ``generator``.
            ValueError: an unknown ``kind``, ``scale_mode`` or ``rounding``; a bad ``pack_dim`` or
                ``block`` (one int ``>= 0`` per dim, tiling the tensor); ``generator`` without
                stochastic rounding.
        """
        return from_hp_fp4(
            hp,
            kind,
            block=block,
            pack_dim=pack_dim,
            scale_mode=scale_mode,
            rounding=rounding,
            four_over_six=four_over_six,
            generator=generator,
        )

    def to_hp(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize to the original dtype (or ``dtype``), differentiably; a block with inf or NaN is NaN.

        Raises:
            TypeError: ``dtype`` is not bf16, fp16 or fp32.
        """
        if dtype is not None:
            check_hp_dtype(dtype, "to_hp dtype")
        return _ToHP4.apply(self, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``e2m1 * block_scale * global_scale`` in fp32, then ``dtype`` (no autograd)."""
        return dequantize_fp4(
            self._data, self._scale, self._global_scale, self._block, self._pack_dim, dtype or self._orig_dtype
        )

    def codes(self) -> torch.Tensor:
        """The E2M1 codes (uint8, 0..15), one per element, in the outer shape."""
        return unpack_e2m1(self._data, self._pack_dim)

    def repacked(self, pack_dim: int) -> Float4Tensor:
        """The same codes packed along ``pack_dim`` (lossless; the scales stay)."""
        pack_dim = pack_dim % self.dim()
        if pack_dim == self._pack_dim:
            return self
        return self._replace(data=pack_e2m1(self.codes(), pack_dim), pack_dim=pack_dim)

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def gemm_config(self) -> GemmConfig:
        return self._gemm

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"Float4Tensor({self._kind}, shape={tuple(self.shape)}, orig_dtype={self._orig_dtype}, "
            f"block={self._block}, pack_dim={self._pack_dim})"
        )

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale", "_global_scale"], (
            self._orig_dtype,
            self._block,
            self._pack_dim,
            self._kind,
            self._gemm,
        )

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Float4Tensor:
        return Float4Tensor(inner["_data"], inner["_scale"], inner["_global_scale"], *meta)


def is_float4(x: object) -> TypeIs[Float4Tensor]:
    """Whether ``x`` is a Float4Tensor (a type check narrows ``x`` by it)."""
    return isinstance(x, Float4Tensor)


# ===================================================================== casts


def to_float4(
    hp: torch.Tensor,
    spec: FP4Spec,
    *,
    gemm: GemmConfig = DEFAULT_GEMM,
    orig_dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Float4Tensor:
    """``hp`` cast per ``spec`` (``kernels.fp4.cast_fp4``), unchecked and without autograd."""
    data, scale, global_scale = cast_fp4(hp, spec, generator=generator)
    return Float4Tensor(
        data, scale, global_scale, orig_dtype or hp.dtype, spec.block, spec.pack_dim % hp.dim(), spec.kind, gemm
    )


def to_float4_with_stats(
    hp: torch.Tensor,
    spec: FP4Spec,
    *,
    gemm: GemmConfig = DEFAULT_GEMM,
    orig_dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Float4Tensor, torch.Tensor]:
    """:func:`to_float4` and the cast's telemetry vector (``CAST_STATS_FIELDS`` layout)."""
    data, scale, global_scale, stats = cast_fp4(hp, spec, generator=generator, stats=True)
    out = Float4Tensor(
        data, scale, global_scale, orig_dtype or hp.dtype, spec.block, spec.pack_dim % hp.dim(), spec.kind, gemm
    )
    return out, stats


_DEFAULT_BLOCK = {"nvfp4": 16, "mxfp4": 32}


def from_hp_fp4(
    hp: torch.Tensor,
    kind: str = "nvfp4",
    *,
    block: tuple[int, ...] | None = None,
    pack_dim: int = -1,
    scale_mode: str = "rceil",
    rounding: str = "nearest",
    four_over_six: bool = False,
    generator: torch.Generator | None = None,
) -> Float4Tensor:
    """The checked, differentiable cast behind :meth:`Float4Tensor.from_hp`."""
    if not isinstance(hp, torch.Tensor) or is_float4(hp):
        raise TypeError(f"from_hp expects a high-precision torch.Tensor; got {type(hp).__name__}")
    check_hp_dtype(hp.dtype, "Float4Tensor.from_hp input")
    if kind not in _DEFAULT_BLOCK:
        raise ValueError(f"kind must be 'nvfp4' or 'mxfp4'; got {kind!r}")
    ndim = hp.dim()
    if ndim == 0:
        raise ValueError("FP4 packs along a dim: a 0-dim tensor cannot be cast")
    if isinstance(pack_dim, bool) or not isinstance(pack_dim, int) or not -ndim <= pack_dim < ndim:
        raise ValueError(
            f"pack_dim must be an int in [{-ndim}, {ndim - 1}] (a dim of the {ndim}-D input); got {pack_dim!r}"
        )
    pack_dim %= ndim
    if hp.shape[pack_dim] % 2:
        raise ValueError(
            f"FP4 packs two values per byte along pack_dim={pack_dim}: its size must be even; got shape "
            f"{tuple(hp.shape)}"
        )
    if block is None:
        block = (1,) * (ndim - 1) + (_DEFAULT_BLOCK[kind],)
    if (
        not isinstance(block, (tuple, list))
        or len(block) != ndim
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in block)
    ):
        raise ValueError(
            f"block must be a tuple of {ndim} ints >= 0, one per dim of the input (0: the whole dim); got {block!r}"
        )
    block = tuple(block)
    if any(size % (b or size or 1) for size, b in zip(hp.shape, block)):
        raise ValueError(
            f"block {block} must tile the input exactly (each entry divides its dim; partial blocks are not "
            f"supported); got shape {tuple(hp.shape)}"
        )
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic'; got {rounding!r}")
    if scale_mode not in ("rceil", "floor"):
        raise ValueError(f"scale_mode must be 'rceil' or 'floor'; got {scale_mode!r}")
    if not isinstance(four_over_six, bool):
        raise TypeError(f"four_over_six must be a bool; got {four_over_six!r}")
    if four_over_six and kind != "nvfp4":
        raise ValueError("four_over_six is an NVFP4 option (MXFP4's power-of-two scales cannot map a block to 4)")
    check_unused_cast_args(False, rounding, generator)
    spec = FP4Spec(kind, block, pack_dim, scale_mode, rounding, four_over_six)
    return _FromHP4.apply(hp, spec, generator)


class _FromHP4(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hp: torch.Tensor, spec: FP4Spec, generator: torch.Generator | None
    ) -> Float4Tensor:
        return to_float4(hp, spec, generator=generator)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad, None, None


class _ToHP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, f4: Float4Tensor, dtype: torch.dtype | None) -> torch.Tensor:  # type: ignore[override]
        return f4.dequantize(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


# ===================================================================== layout ops


def _transposed(x: Float4Tensor, d0: int, d1: int) -> Float4Tensor:
    n = x.dim()
    d0, d1 = d0 % n, d1 % n
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    block = tuple(x._block[p] for p in perm)
    pack = perm.index(x._pack_dim)
    return x._replace(data=x._data.transpose(d0, d1), scale=x._scale.transpose(d0, d1), block=block, pack_dim=pack)


def transpose_2d(x: Float4Tensor) -> Float4Tensor:
    """``x.t()`` built directly (for library code; not an autograd view)."""
    return _transposed(x, 0, 1)


@Float4Tensor.implements([aten.t.default])
def _t(func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    x = args[0]
    if x.dim() != 2:
        raise ValueError(f"t() expects a 2D tensor; got {x.dim()}D")
    return return_and_correct_aliasing(func, args, kwargs, _transposed(x, 0, 1))


@Float4Tensor.implements([aten.transpose.int])
def _transpose(func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    x, d0, d1 = args
    return return_and_correct_aliasing(func, args, kwargs, _transposed(x, d0, d1))


@Float4Tensor.implements([aten.detach.default, aten.alias.default])
def _detach(func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    x = args[0]
    out = x._replace(data=func(x._data), scale=func(x._scale), global_scale=func(x._global_scale))
    return return_and_correct_aliasing(func, args, kwargs, out)


@Float4Tensor.implements([aten.clone.default])
def _clone(func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    x = args[0]
    return x._replace(data=x._data.clone(), scale=x._scale.clone(), global_scale=x._global_scale.clone())


@Float4Tensor.implements([aten.slice.Tensor])
def _slice(func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.dim()
    start = args[2] if len(args) > 2 else kwargs.get("start", None)
    end = args[3] if len(args) > 3 else kwargs.get("end", None)
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    size = x.shape[dim]
    start = 0 if start is None else max(0, start + size if start < 0 else start)
    end = size if end is None else min(size, end + size if end < 0 else end)
    end = max(end, start)
    b = x._block[dim] or size
    if step != 1:
        raise ValueError(f"a Float4Tensor slice with step {step} would split blocks and packed bytes; only step 1")
    if start % b or (end % b and end != size):
        raise ValueError(
            f"slicing a Float4Tensor along dim {dim} at [{start}:{end}] would split a block of {b} elements "
            f"(slice at multiples of {b})"
        )
    if dim == x._pack_dim and (start % 2 or end % 2):
        raise ValueError(f"slicing a Float4Tensor along its packed dim {dim} at [{start}:{end}] would split a byte")
    pk = 2 if dim == x._pack_dim else 1
    data = aten.slice.Tensor(x._data, dim, start // pk, end // pk)
    scale = aten.slice.Tensor(x._scale, dim, start // b, -(-end // b))
    return return_and_correct_aliasing(func, args, kwargs, x._replace(data=data, scale=scale))


@Float4Tensor.implements([aten.view.default, aten._unsafe_view.default])
def _view(func: Any, types: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Merges and splits of unblocked leading dims (block 1) in front of the packed last dim."""
    x, dims = args[0], list(args[1])
    n = x.dim()
    if -1 in dims:
        known = 1
        for s in dims:
            if s != -1:
                known *= s
        dims[dims.index(-1)] = x.numel() // max(known, 1)
    shape = tuple(dims)
    if shape == tuple(x.shape):
        out = x._replace(data=func(x._data, list(x._data.shape)), scale=func(x._scale, list(x._scale.shape)))
        return return_and_correct_aliasing(func, args, kwargs, out)
    leading_unblocked = all(b == 1 for b in x._block[:-1])
    if x._pack_dim != n - 1 or not leading_unblocked or not shape or shape[-1] != x.shape[-1]:
        raise ValueError(
            f"a Float4Tensor view from {tuple(x.shape)} to {shape} would split a packed byte or a block "
            f"(block {x._block}, packed along dim {x._pack_dim}); only views that merge or split leading "
            f"dims of block 1 in front of the packed last dim keep them whole"
        )
    data = func(x._data, list(shape[:-1]) + [x._data.shape[-1]])
    scale = func(x._scale, list(shape[:-1]) + [x._scale.shape[-1]])
    out = x._replace(data=data, scale=scale, block=(1,) * (len(shape) - 1) + (x._block[-1],), pack_dim=len(shape) - 1)
    return return_and_correct_aliasing(func, args, kwargs, out)
