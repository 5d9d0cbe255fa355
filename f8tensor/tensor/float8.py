"""Float8Tensor: raw FP8 data, its scale and the dtype it stands for.

The tensor is a plain container: it never decides a scale (``scaling.py`` does, inside
``kernels``' casts) and its ops live in a table filled by ``ops.py``. This module owns the
container, the casts that wrap ``kernels``' output in one (:func:`to_float8`), and the
autograd Functions into and out of it, whose backward passes the gradient through.

Checkpoints name ``f8tensor.tensor.Float8Tensor`` and ``f8tensor.tensor._rebuild_float8_tensor``.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import torch
from typing_extensions import TypeIs

from f8tensor.compat import WRAPPER_SUBCLASS, called_by_weights_only_load, is_fake

# By name: traced, a module reached two ways (here and by the quantizers) is a guard per read.
from f8tensor.kernels import CAST_STATS_FIELDS, GemmCast, cast_for_gemm, cast_with_stats
from f8tensor.kernels import cast as kernels_cast
from f8tensor.kernels import dequantize as kernels_dequantize
from f8tensor.quant.formats import E8M0, SCALE_DTYPES, check_hp_dtype
from f8tensor.quant.scaling import inverse_scale_of
from f8tensor.quant.specs import (
    DEFAULT_GEMM,
    BlockGranularity,
    CastSpec,
    GemmConfig,
    Granularity,
    axiswise_dim,
    is_blockwise,
    keyword_spec,
    layout_block,
)
from f8tensor.tensor.subclass import OpHandler, QuantizedTensor
from f8tensor.tensor.validation import (
    RETIRED_FORMAT,
    SERIAL_VERSION,
    check_given_scale,
    check_scale_values,
    check_unused_cast_args,
    checkpoint_fields,
    from_hp_spec,
    scale_from_number,
    serial_fields,
    validate_fields,
)

__all__ = [
    "CAST_STATS_FIELDS",
    "SCALE_DTYPES",
    "Float8Tensor",
    "cast_to_float8",
    "cast_to_float8_with_stats",
    "check_scale_values",
    "dequantize",
    "dequantize_fields",
    "from_gemm_cast",
    "is_float8",
    "scale_from_number",
    "to_float8",
    "to_float8_for_gemm",
    "to_float8_with_stats",
    "with_inverse_scale",
]


#: The checkpoint format :meth:`Float8Tensor.__reduce_ex__` writes (see ``validation.py``).
_SERIAL_VERSION = SERIAL_VERSION


class Float8Tensor(QuantizedTensor):
    """An FP8 tensor that behaves like the high-precision tensor it was cast from.

    Outer dtype: the original dtype; outer shape and strides: the data's. Fields:

    - ``_data``: the FP8 payload.
    - ``_block``: per dim of ``_data``, ``b > 0``: ``b`` consecutive elements share a scale
      (the last block may be partial); ``0``: the whole dim does.

      ===========  ==========  ===============================
      granularity  _block      _scale shape (sizes rounded up)
      ===========  ==========  ===============================
      tensorwise   (0, 0)      ()
      rowwise      (1, 0)      (M, 1)
      per column   (0, 1)      (1, K)
      1x128        (1, 128)    (M, K/128)
      128x128      (128, 128)  (M/128, K/128)
      MX 1x32      (1, 32)     (M, K/32), e8m0
      per expert   (1, 0, 0)   (E, 1, 1)
      ===========  ==========  ===============================

    - ``_scale``: fp32 or e8m0; ``_data = saturate(hp * _scale)``, ``hp ~= _data / _scale``.
    - ``_orig_dtype``: the high-precision dtype.
    - ``_gemm``: the :class:`GemmConfig` of its matrix products.

    Metadata is immutable, so flatten and unflatten are exact inverses.

    Raises:
        NotImplementedError: an op with no FP8 handler (it names the op).
        ValueError: operands on different devices; :attr:`axiswise_dim` of a block scale.

    Example:
        >>> from f8tensor import Float8Tensor
        >>> x8 = Float8Tensor.from_hp(torch.randn(8, 16), granularity="rowwise")
        >>> x8[2:4].shape, x8[2:4]._scale.shape, x8.to_hp().dtype
        (torch.Size([2, 16]), torch.Size([2, 1]), torch.float32)
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _block: tuple[int, ...]
    _gemm: GemmConfig

    # aten overload -> handler; filled by ops.py.
    _OPS: ClassVar[dict[Any, OpHandler]] = {}
    _UNSUPPORTED: ClassVar[str] = (
        "Float8Tensor does not support {func}. FP8 data only takes part in matrix "
        "products (mm, addmm, matmul, linear) and layout ops; call .to_hp() first to "
        "compute in high precision."
    )

    #: ``1 / _scale`` from the library's own cast (eager only): a cache, not a field, kept by
    #: :meth:`_replace` only while ``_scale`` is the same tensor, never on scales written in place.
    _inv_scale: torch.Tensor | None = None

    @staticmethod
    def __new__(  # noqa: PYI034 (staticmethod: no Self)
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        block: tuple[int, ...] | None = None,
        gemm: GemmConfig = DEFAULT_GEMM,
    ) -> Float8Tensor:
        # Unchecked on the hot path; only torch.load(weights_only=True) calling the class itself gets
        # the fields checked (never under compile: the frame test would graph-break).
        if not torch.compiler.is_compiling() and called_by_weights_only_load():
            if block is None and isinstance(data, torch.Tensor):
                block = layout_block((), data.dim())
            scale = validate_fields(data, scale, orig_dtype, block, gemm)
        return _built(cls, data, scale, orig_dtype, layout_block((), data.dim()) if block is None else block, gemm)

    # ----------------------------------------------------------------- construction

    @staticmethod
    def from_hp(
        hp: torch.Tensor,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        granularity: str | Granularity | BlockGranularity | tuple[int, ...] = "tensorwise",
        scale: torch.Tensor | float | None = None,
        gemm_config: GemmConfig | None = None,
        power_of_2_scale: bool = False,
        rounding: str = "nearest",
        generator: torch.Generator | None = None,
    ) -> Float8Tensor:
        """Cast a bf16/fp16/fp32 tensor to FP8 (saturating), differentiably.

        Args:
            hp: the tensor to cast.
            float8_dtype: the FP8 dtype.
            granularity: ``"tensorwise"``, ``"rowwise"``, a :class:`~f8tensor.BlockGranularity` or a block.
            scale: used as is when given; else the amax sets it.
            gemm_config: how matrix products with the result run.
            power_of_2_scale: round a computed scale down to a power of two.
            rounding: ``"nearest"`` or ``"stochastic"`` (with ``generator``).
            generator: the random source of stochastic rounding.

        Raises:
            TypeError: ``hp`` is not bf16/fp16/fp32, ``float8_dtype`` is not FP8, or a bad ``generator``.
            ValueError: an unknown granularity or rounding, a bad ``scale``, ``power_of_2_scale`` with a
                given ``scale``, or ``generator`` without stochastic rounding.

        Example:
            >>> from f8tensor import Float8Tensor
            >>> Float8Tensor.from_hp(torch.randn(64, 32), granularity="rowwise")._scale.shape
            torch.Size([64, 1])
        """
        if isinstance(hp, Float8Tensor):
            raise TypeError("from_hp expects a high-precision tensor; got a Float8Tensor (call .to_hp() first)")
        if not isinstance(hp, torch.Tensor):
            raise TypeError(f"from_hp expects a torch.Tensor; got {type(hp).__name__}")
        spec, gemm_config = from_hp_spec(hp, float8_dtype, granularity, power_of_2_scale, rounding, gemm_config)
        check_unused_cast_args(scale is not None and power_of_2_scale, rounding, generator)
        if scale is not None:
            scale = check_given_scale(scale, hp, spec.block, spec.scale_dtype)
        return _FromHP.apply(hp, spec, scale, gemm_config, generator)

    def to_hp(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize to a plain tensor in the original dtype (or ``dtype``), differentiably.

        Raises:
            TypeError: ``dtype`` is not bf16, fp16 or fp32.
        """
        if dtype is not None:
            check_hp_dtype(dtype, "to_hp dtype")
        return _ToHP.apply(self, dtype)

    # Python turns a TypeError inside Tensor.__matmul__ into NotImplemented; overriding both sides keeps ours.
    def __matmul__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        if not isinstance(other, torch.Tensor):
            return NotImplemented
        return torch.matmul(self, other)

    def __rmatmul__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        if not isinstance(other, torch.Tensor):
            return NotImplemented
        return torch.matmul(other, self)

    # ----------------------------------------------------------------- introspection

    @property
    def float8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def _scale_block(self) -> tuple[int, ...]:
        """The block in :class:`~f8tensor.quant.config.CastSpec`'s spelling: ``()`` for tensorwise."""
        # spec_block's rule, inlined: read by every product.
        return self._block if self._scale.dim() else ()

    @property
    def is_blockwise(self) -> bool:
        """True for a block scale (1x128, 128x128, MX, ...)."""
        if self._scale.dim() == 0:
            return False
        # specs.is_blockwise's rule, inlined: read by every product. Not all-zero (tensorwise),
        # not one 0 among 1s (axiswise).
        block = self._block
        zeros = block.count(0)
        return zeros != len(block) and not (zeros == 1 and block.count(1) == len(block) - 1)

    @property
    def block(self) -> tuple[int, ...]:
        """The per-dim block."""
        return self._block

    @property
    def granularity(self) -> Granularity | BlockGranularity:
        """``Granularity.TENSORWISE`` / ``ROWWISE``, else the :class:`BlockGranularity`."""
        if self.is_blockwise:
            return BlockGranularity(self._block, self._scale.dtype)
        return Granularity.TENSORWISE if self._scale.dim() == 0 else Granularity.ROWWISE

    @property
    def axiswise_dim(self) -> int | None:
        """``None`` for tensorwise, ``d`` for an axiswise block; raises for a block scale."""
        if self.is_blockwise:
            raise ValueError(
                f"a block-scaled Float8Tensor (block {self._block}) has no axiswise_dim; read ._block "
                f"(code written for tensorwise/rowwise scales does not apply to block scales)"
            )
        return axiswise_dim(self._scale_block)

    _axiswise_dim = axiswise_dim

    @property
    def gemm_config(self) -> GemmConfig:
        return self._gemm

    def _replace(self, **changes: Any) -> Float8Tensor:
        """The one way to rebuild: a new Float8Tensor with some fields changed."""
        fields: dict[str, Any] = {
            "data": self._data,
            "scale": self._scale,
            "orig_dtype": self._orig_dtype,
            "block": self._block,
            "gemm": self._gemm,
        }
        if "data" in changes and "block" not in changes and changes["data"].dim() != self._data.dim():
            raise ValueError("Float8Tensor._replace: new data of another ndim needs its block")
        fields.update(changes)
        # Only eager casts set the cache: traced tensors never carry one (no is_compiling() read).
        if self._inv_scale is None or fields["block"] is None:
            return Float8Tensor(**fields)
        new = _built(
            Float8Tensor, fields["data"], fields["scale"], fields["orig_dtype"], fields["block"], fields["gemm"]
        )
        if fields["scale"] is self._scale:
            new._inv_scale = self._inv_scale
        return new

    # ----------------------------------------------------------------- serialization

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:  # type: ignore[override]
        """Pickle as plain fields, the FP8 bytes as ``uint8`` (FP8 storages do not pickle everywhere)."""
        return (_rebuild_float8_tensor, (_SERIAL_VERSION, self._serial_fields()))

    def _serial_fields(self) -> dict[str, Any]:
        is_param = bool(self.__dict__.get("_is_param", False))
        return serial_fields(
            self._data, self._scale, self._orig_dtype, self._block, self._gemm, self.requires_grad, is_param
        )

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        fields = self._serial_fields()
        fields["data"] = fields["data"].clone()
        fields["scale"] = fields["scale"].clone()
        new = _rebuild_float8_tensor(_SERIAL_VERSION, fields)
        memo[id(self)] = new
        return new

    def __setstate__(self, state: Any) -> None:
        """Refuse a checkpoint of the pre-release format 0 (attributes restored into a wrapper)."""
        raise ValueError(RETIRED_FORMAT)

    def __repr__(self) -> str:  # type: ignore[override]
        block = self._scale_block
        if not block and not is_fake(self._scale):
            scale = f"scale={self._scale.item():.6g}"
        else:
            scale = f"scale_shape={tuple(self._scale.shape)}"
        if not block:
            gran = "tensorwise"
        elif is_blockwise(block):
            e8m0 = ", e8m0" if self._scale.dtype == E8M0 else ""
            gran = f"block={self._block}{e8m0}"
        else:
            gran = f"axiswise(dim={axiswise_dim(block)})"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"Float8Tensor({str(self._data.dtype).removeprefix('torch.')}, shape={tuple(self.shape)}, "
            f"orig_dtype={self._orig_dtype}, {gran}, {scale}{grad})"
        )

    # ----------------------------------------------------------------- compile support

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale"], (self._orig_dtype, self._block, self._gemm)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Float8Tensor:
        return Float8Tensor(inner["_data"], inner["_scale"], *meta)


def _rebuild_float8_tensor(version: object, fields: object) -> torch.Tensor:
    """Unpickle a Float8Tensor (or its ``nn.Parameter``), validating every field first."""
    data, scale, orig_dtype, block, gemm, requires_grad, is_param = checkpoint_fields(version, fields)
    out = Float8Tensor(data, scale, orig_dtype, block, gemm)
    if is_param:
        return torch.nn.Parameter(out, requires_grad=requires_grad)
    return out.requires_grad_(requires_grad)


class _LegacyFloat8Tensor(Float8Tensor):
    """What ``weights_only=True`` loading knows as ``f8tensor.tensor.Float8Tensor``: only the
    pre-release format 0 names the class, and ``__setstate__`` refuses it; direct construction
    is refused too."""

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        raise TypeError("a Float8Tensor is loaded through its validating rebuild, never constructed from a checkpoint")

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> NoReturn:
        raise RuntimeError(
            "a Float8Tensor from a checkpoint was used before its fields were restored (a malformed checkpoint)"
        )


class _RetiredCheckpointType:
    """What the config types a pre-release (format 0) checkpoint names load as: a refusal."""

    def __new__(cls, *args: object) -> NoReturn:
        raise ValueError(RETIRED_FORMAT)


def is_float8(x: object) -> TypeIs[Float8Tensor]:
    """Whether ``x`` is a Float8Tensor."""
    return isinstance(x, Float8Tensor)


# ===================================================================== casts


def to_float8(
    hp: torch.Tensor,
    spec: CastSpec,
    *,
    scale: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    orig_dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Float8Tensor:
    """``hp`` cast per ``spec``, unchecked and without autograd (the library's cast)."""
    data, scale = kernels_cast(hp, spec, scale, generator=generator)
    return Float8Tensor(data, scale, orig_dtype or hp.dtype, layout_block(spec.block, hp.dim()), gemm)


def to_float8_for_gemm(
    hp: torch.Tensor,
    spec: CastSpec,
    *,
    scale: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    layouts: str = "natural",
    column_major_gemm: GemmConfig | None = None,
) -> tuple[Float8Tensor, Float8Tensor | None]:
    """:func:`to_float8` and, with ``layouts='both'``, the column-major twin (else None)."""
    out = cast_for_gemm(hp, spec, scale, layouts=layouts, products_only=False)
    return from_gemm_cast(out, hp.dtype, spec.block or (0,) * hp.dim(), gemm, column_major_gemm)


def _built(
    cls: type[Float8Tensor],
    data: torch.Tensor,
    scale: torch.Tensor,
    orig_dtype: torch.dtype,
    block: tuple[int, ...],
    gemm: GemmConfig,
) -> Float8Tensor:
    """A ``cls`` of these fields, unchecked: the library's own casts and rebuilds (and ``__new__``)."""
    # make_wrapper_subclass's body, inlined: every FP8 tensor is built here.
    self = WRAPPER_SUBCLASS(
        cls,
        data.shape,
        strides=data.stride(),
        storage_offset=data.storage_offset(),
        dtype=orig_dtype,
        layout=data.layout,
        device=data.device,
        requires_grad=False,
    )
    self._data = data
    self._scale = scale
    self._orig_dtype = orig_dtype
    self._block = block
    self._gemm = gemm
    return self


def from_gemm_cast(
    out: GemmCast,
    orig_dtype: torch.dtype,
    block: tuple[int, ...],
    gemm: GemmConfig,
    column_major_gemm: GemmConfig | None = None,
) -> tuple[Float8Tensor, Float8Tensor | None]:
    """The Float8Tensor of a :func:`~f8tensor.kernels.cast_for_gemm` result and its twin (or None).

    Args:
        block: the data's ``_block`` (a spec's block, or zeros for tensorwise).
        column_major_gemm: the twin's GEMM config (default ``gemm``).
    """
    # Eager (the cast or a kept inverse says so without asking): built without __new__'s load
    # check, which dynamo traces only as a class call.
    twin_gemm = gemm if column_major_gemm is None else column_major_gemm
    twin = None
    if out.eager or out.inverse is not None or (out.eager is None and not torch.compiler.is_compiling()):
        f8 = _built(Float8Tensor, out.data, out.scale, orig_dtype, block, gemm)
        if out.column_major is not None:
            twin = _built(Float8Tensor, out.column_major, out.scale, orig_dtype, block, twin_gemm)
    else:
        f8 = Float8Tensor(out.data, out.scale, orig_dtype, block, gemm)
        if out.column_major is not None:
            twin = Float8Tensor(out.column_major, out.scale, orig_dtype, block, twin_gemm)
    if out.inverse is not None:
        f8._inv_scale = out.inverse
        if twin is not None:
            twin._inv_scale = out.inverse
    return f8, twin


def with_inverse_scale(f8: Float8Tensor) -> Float8Tensor:
    """``f8`` carrying ``1 / f8._scale`` for a per-tensor scale, computed once for every product.

    Eager only: under torch.compile ``f8`` is returned as is.
    """
    if f8._scale.dim() == 0 and not torch.compiler.is_compiling():
        f8._inv_scale = inverse_scale_of(f8._scale)
    return f8


def to_float8_with_stats(
    hp: torch.Tensor,
    spec: CastSpec,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    orig_dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Float8Tensor, torch.Tensor]:
    """:func:`to_float8`, also returning the cast's statistics."""
    data, scale, stats = cast_with_stats(hp, spec, scale, amax=amax, generator=generator)
    return Float8Tensor(data, scale, orig_dtype or hp.dtype, layout_block(spec.block, hp.dim()), gemm), stats


def cast_to_float8(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    axiswise_dim: int | None = None,
    block: tuple[int, ...] | None = None,
    scale: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    power_of_2_scale: bool = False,
    orig_dtype: torch.dtype | None = None,
    scale_dtype: torch.dtype = torch.float32,
    scale_mode: str = "rceil",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Float8Tensor:
    """The cast in keywords, unchecked and without autograd.

    Granularity: ``block``, or ``axiswise_dim`` (``None``: tensorwise). ``scale=None``: dynamic.
    """
    spec = keyword_spec(
        hp.dim(), float8_dtype, axiswise_dim, block, power_of_2_scale, scale_dtype, scale_mode, rounding
    )
    return to_float8(hp, spec, scale=scale, gemm=gemm, orig_dtype=orig_dtype, generator=generator)


def cast_to_float8_with_stats(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    axiswise_dim: int | None = None,
    block: tuple[int, ...] | None = None,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    power_of_2_scale: bool = False,
    orig_dtype: torch.dtype | None = None,
    scale_dtype: torch.dtype = torch.float32,
    scale_mode: str = "rceil",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[Float8Tensor, torch.Tensor]:
    """:func:`cast_to_float8`, also returning a float64 vector laid out as :data:`CAST_STATS_FIELDS`."""
    spec = keyword_spec(
        hp.dim(), float8_dtype, axiswise_dim, block, power_of_2_scale, scale_dtype, scale_mode, rounding
    )
    return to_float8_with_stats(hp, spec, scale=scale, amax=amax, gemm=gemm, orig_dtype=orig_dtype, generator=generator)


def dequantize(f8: Float8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_data / _scale`` in fp32 per block, cast to ``dtype`` (default: the original)."""
    return kernels_dequantize(f8._data, f8._scale, f8._block, dtype or f8._orig_dtype)


def dequantize_fields(
    data: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize` of a Float8Tensor's fields (as an op takes them apart)."""
    return kernels_dequantize(data, scale, block, dtype)


class _FromHP(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hp: torch.Tensor,
        spec: CastSpec,
        scale: torch.Tensor | None,
        gemm: GemmConfig,
        generator: torch.Generator | None,
    ) -> Float8Tensor:
        if scale is not None:
            # No amax pass here to catch inf: make it NaN rather than saturate it.
            hp = torch.where(torch.isinf(hp), torch.nan, hp)
        return to_float8(hp, spec, scale=scale, gemm=gemm, generator=generator)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        return grad, None, None, None, None


class _ToHP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, f8: Float8Tensor, dtype: torch.dtype | None) -> torch.Tensor:  # type: ignore[override]
        return dequantize(f8, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


# Checkpoints name these by their old path.
Float8Tensor.__module__ = "f8tensor.tensor"
_rebuild_float8_tensor.__module__ = "f8tensor.tensor"
