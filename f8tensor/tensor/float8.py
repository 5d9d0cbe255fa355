"""Float8Tensor: raw FP8 data, its scale and the dtype it stands for.

The tensor is a plain container: it never decides a scale (``scaling.py`` does, inside the
casts of ``kernels``) and its ops live in a table filled by ``ops.py``. This module owns the
container (fields, flatten/unflatten, the dispatch table, pickling and the checkpoint
rebuild), the casts that wrap ``kernels``' raw data and scales in one
(:func:`to_float8`, and the keyword adapters :func:`cast_to_float8` /
:func:`cast_to_float8_with_stats`), and the autograd Functions into and out of it, whose
backward passes the gradient through unchanged.

Checkpoints name ``f8tensor.tensor.float8._rebuild_float8_tensor`` (and, before it existed,
``f8tensor.tensor.float8.Float8Tensor``): both stay defined here.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import torch
from typing_extensions import TypeIs

from f8tensor import kernels
from f8tensor.compat import called_by_weights_only_load, is_fake, make_wrapper_subclass
from f8tensor.kernels import CAST_STATS_FIELDS
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
    spec_block,
)
from f8tensor.tensor.subclass import OpHandler, QuantizedTensor
from f8tensor.tensor.validation import (
    SERIAL_VERSION,
    check_given_scale,
    check_scale_values,
    checkpoint_fields,
    from_hp_spec,
    legacy_state_fields,
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
    "is_float8",
    "scale_from_number",
    "to_float8",
    "to_float8_for_gemm",
    "to_float8_with_stats",
    "with_inverse_scale",
]

# SCALE_DTYPES (fp32, e8m0fnu for MX) is defined in formats.py, next to E8M0, and
# re-exported here: the dtypes a Float8Tensor's ``_scale`` may have. check_scale_values and
# scale_from_number live in validation.py and are re-exported for the same reason.

#: The checkpoint format :meth:`Float8Tensor.__reduce_ex__` writes (see ``validation.py``).
_SERIAL_VERSION = SERIAL_VERSION


class Float8Tensor(QuantizedTensor):
    """An FP8 tensor that behaves like the high-precision tensor it was cast from.

    Outer (visible) dtype: the original dtype (bf16, fp16 or fp32); outer shape and
    strides: those of the data. Fields:

    - ``_data``: the FP8 payload, any of the four torch float8 dtypes.
    - ``_block``: which elements share one scale, one entry per dim of ``_data``: ``b > 0``
      means ``b`` consecutive elements along that dim share a scale (the last block of a dim
      may be partial), ``0`` that the whole dim shares it (so slicing along it keeps the
      block). Every granularity is a block:

      ========================  ==================  ==========================
      granularity               ``_block``          ``_scale`` shape
      ========================  ==================  ==========================
      tensorwise                ``(0, 0)``          ``()`` (0-dim)
      rowwise on (M, K)         ``(1, 0)``          ``(M, 1)``
      per column (axis 0)       ``(0, 1)``          ``(1, K)``
      1x128 (activations)       ``(1, 128)``        ``(M, ceil(K/128))``
      128x128 (weights)         ``(128, 128)``      ``(ceil(M/128), ceil(K/128))``
      MX 1x32                   ``(1, 32)``         ``(M, ceil(K/32))``, e8m0
      per expert (E, N, K)      ``(1, 0, 0)``       ``(E, 1, 1)``
      ========================  ==================  ==========================

    - ``_scale``: fp32, or ``torch.float8_e8m0fnu`` (MX: powers of two). Tensorwise: a 0-dim
      tensor; otherwise same ndim as ``_data`` with ``ceil(size / b)`` entries along a dim
      with block ``b`` and 1 along a dim with block 0. One rule per block:
      ``_data = saturate(hp.float() * _scale)``, ``hp ~= _data.float() / _scale``. An e8m0
      scale stores this same multiplier (the reciprocal of the OCP spec's shared scale X).
    - ``_orig_dtype``: the high-precision dtype (also the outer dtype).
    - ``_gemm``: the :class:`GemmConfig` used when this tensor enters a matrix product.

    Derived, read-only: :attr:`_scale_block` (the block in :class:`~f8tensor.quant.config.CastSpec`'s
    spelling, ``()`` for tensorwise: what the predicates of ``config`` read), and the
    public :attr:`granularity`, :attr:`axiswise_dim` (the old spelling: ``None`` for
    tensorwise, ``d`` for a block that is 0 at ``d`` and 1 elsewhere; block-scaled tensors
    raise, so no code written for the old granularities mistakes a block scale for a per-row
    one), :attr:`is_blockwise` and :attr:`block`.

    Build one with :meth:`from_hp`; get the high-precision values back with :meth:`to_hp`.
    Metadata is immutable and compares by value, so ``__tensor_flatten__`` and
    ``__tensor_unflatten__`` are exact inverses (torch.compile relies on it).

    Raises:
        NotImplementedError: an op with no FP8 handler (it names the op; call :meth:`to_hp`
            first for a high-precision result), instead of a silent dequantization.
        IndexError: an index outside ``[-size, size)``.
        ValueError: an FP8 matrix product of operands (or a bias) on different devices;
            :attr:`axiswise_dim` of a block-scaled tensor.

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

    # The op table: aten overload -> handler(func, types, args, kwargs). Filled by ops.py;
    # read by QuantizedTensor.__torch_dispatch__, which refuses any other op with this message.
    _OPS: ClassVar[dict[Any, OpHandler]] = {}
    _UNSUPPORTED: ClassVar[str] = (
        "Float8Tensor does not support {func}. FP8 data only takes part in matrix "
        "products (mm, addmm, matmul, linear) and layout ops; call .to_hp() first to "
        "compute in high precision."
    )

    #: ``1 / _scale`` as the GEMMs read it, when the library's own cast computed it (once
    #: for every product of the tensor: :func:`with_inverse_scale`; or in the fused cast
    #: kernel's pass: :func:`to_float8_for_gemm`; eager only, else None).
    #: A cache, not a field: never flattened, pickled or compared, and carried by
    #: :meth:`_replace` only while ``_scale`` stays the very same tensor. Only fresh
    #: temporaries of a training step carry one (never a tensor whose scale may later be
    #: written in place, such as an FSDP2 gather's output).
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
        # The library builds through here with fields that are right by construction:
        # unchecked (the eager hot path). Only torch.load(weights_only=True) calling the class
        # itself (possible once a user allowlists it: add_safe_globals([Float8Tensor])) would
        # build one from a checkpoint's fields: those are checked like the safe path's. Never
        # under compile (the frame test is skipped there, so it does not graph-break).
        if not torch.compiler.is_compiling() and called_by_weights_only_load():
            if block is None and isinstance(data, torch.Tensor):
                block = layout_block((), data.dim())
            scale = validate_fields(data, scale, orig_dtype, block, gemm)
        self = make_wrapper_subclass(cls, data, dtype=orig_dtype, requires_grad=False)
        self._data = data
        self._scale = scale
        self._orig_dtype = orig_dtype
        # None: tensorwise, for data of any ndim.
        self._block = layout_block((), data.dim()) if block is None else block
        self._gemm = gemm
        return self

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

        ``granularity``: ``"tensorwise"`` (one scale), ``"rowwise"`` (one scale per row,
        along the last dim), or a block: :data:`~f8tensor.BLOCK_1x128`,
        :data:`~f8tensor.BLOCK_128x128`, :data:`~f8tensor.MX_1x32` (e8m0 scales), any
        :class:`~f8tensor.BlockGranularity`, or a tuple such as ``(1, 128)`` (fp32 scales;
        applied to the trailing dims, leading dims get 1). Sizes that are not multiples of
        the block get a partial last block. ``scale``: used as is when given (a float, a
        0-dim tensor, or a tensor of the granularity's scale shape, see the class
        docstring); otherwise the current amax sets it. ``gemm_config``: how matrix products
        with this tensor run. ``power_of_2_scale``: round a computed fp32 scale down to a
        power of two. ``rounding``: ``"nearest"`` (round to nearest even) or ``"stochastic"``
        (unbiased; ``generator`` makes it reproducible). The gradient flows to ``hp`` unchanged.

        Raises:
            TypeError: ``hp`` is not bf16/fp16/fp32 (or is already a Float8Tensor), or
                ``float8_dtype`` is not an FP8 dtype.
            ValueError: an unknown granularity or rounding, or a ``scale`` of the wrong
                shape or with non-finite or non-positive values.

        Example:
            >>> from f8tensor import Float8Tensor
            >>> w = torch.randn(64, 32, dtype=torch.bfloat16)
            >>> w8 = Float8Tensor.from_hp(w)
            >>> w8.shape, w8.dtype, w8._data.dtype, w8._scale.shape
            (torch.Size([64, 32]), torch.bfloat16, torch.float8_e4m3fn, torch.Size([]))
            >>> Float8Tensor.from_hp(w, granularity="rowwise")._scale.shape
            torch.Size([64, 1])
            >>> (torch.randn(8, 32, dtype=torch.bfloat16) @ w8.t()).shape
            torch.Size([8, 64])
        """
        if isinstance(hp, Float8Tensor):
            raise TypeError("from_hp expects a high-precision tensor; got a Float8Tensor (call .to_hp() first)")
        if not isinstance(hp, torch.Tensor):
            raise TypeError(f"from_hp expects a torch.Tensor; got {type(hp).__name__}")
        spec, gemm_config = from_hp_spec(hp, float8_dtype, granularity, power_of_2_scale, rounding, gemm_config)
        if scale is not None:
            scale = check_given_scale(scale, hp, spec.block, spec.scale_dtype)
        return _FromHP.apply(hp, spec, scale, gemm_config, generator)

    def to_hp(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize to a plain tensor in the original dtype (or ``dtype``), differentiably.

        Raises:
            TypeError: ``dtype`` is not bf16, fp16 or fp32.

        Example:
            >>> from f8tensor import Float8Tensor, sqnr
            >>> w = torch.randn(64, 32)
            >>> back = Float8Tensor.from_hp(w).to_hp()
            >>> back.dtype, type(back) is torch.Tensor, sqnr(w, back) > 25
            (torch.float32, True, True)
        """
        if dtype is not None:
            check_hp_dtype(dtype, "to_hp dtype")
        return _ToHP.apply(self, dtype)

    # Python's `@` turns a TypeError raised inside Tensor.__matmul__ (our message for, say,
    # an int operand) into NotImplemented and then into "unsupported operand type(s)".
    # Overriding both sides on the subclass makes Python call them first, and our error
    # comes through as raised.
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
        """The block in :class:`~f8tensor.quant.config.CastSpec`'s spelling: ``()`` for a tensorwise
        (0-dim) scale, else ``_block``. What the predicates of ``config`` read, and what a
        cast that reproduces this tensor's granularity is given."""
        return spec_block(self._block, self._scale.dim())

    @property
    def is_blockwise(self) -> bool:
        """True for a true block scale (1x128, 128x128, MX, ...), False for tensorwise/axiswise."""
        return is_blockwise(self._scale_block)

    @property
    def block(self) -> tuple[int, ...]:
        """The per-dim block (see the class docstring)."""
        return self._block

    @property
    def granularity(self) -> Granularity | BlockGranularity:
        """``Granularity.TENSORWISE`` / ``ROWWISE`` (any axis) for the old granularities, else
        the :class:`BlockGranularity` (full per-dim block, scale dtype)."""
        if self.is_blockwise:
            return BlockGranularity(self._block, self._scale.dtype)
        return Granularity.TENSORWISE if self._scale.dim() == 0 else Granularity.ROWWISE

    @property
    def axiswise_dim(self) -> int | None:
        """The old spelling of the block: ``None`` for tensorwise, ``d`` for an axiswise block
        (0 at ``d``, 1 elsewhere). Raises for a true block."""
        if self.is_blockwise:
            raise ValueError(
                f"a block-scaled Float8Tensor (block {self._block}) has no axiswise_dim; read ._block "
                f"(code written for tensorwise/rowwise scales does not apply to block scales)"
            )
        return axiswise_dim(self._scale_block)

    #: The name ``axiswise_dim`` had before it was public (kept for code that reads it).
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
        new = Float8Tensor(**fields)
        if fields["scale"] is self._scale and not torch.compiler.is_compiling():
            new._inv_scale = self._inv_scale
        return new

    # ----------------------------------------------------------------- serialization

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:  # type: ignore[override]
        """Pickle (``torch.save``, ``pickle``, ``copy.deepcopy``) as plain fields rebuilt by
        :func:`_rebuild_float8_tensor`, the one validating way back.

        The FP8 bytes travel as a ``uint8`` tensor holding exactly this tensor's elements (a
        slice or ``split`` piece is copied out of its larger storage; a dense layout keeps
        its strides): ``uint8`` pickles everywhere, where FP8 storages do not always.
        Attributes other than the fields (and ``nn.Parameter``'s mark) are not saved.
        """
        return (_rebuild_float8_tensor, (_SERIAL_VERSION, self._serial_fields()))

    def _serial_fields(self) -> dict[str, Any]:
        is_param = bool(self.__dict__.get("_is_param", False))
        return serial_fields(self._data, self._scale, self._orig_dtype, self._block, self._gemm, self.requires_grad, is_param)

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
        """Checkpoints written before :meth:`__reduce_ex__` existed: a wrapper rebuilt from its
        outer size and strides, then its attributes. Every field is validated here."""
        outer = (self.dtype, tuple(self.shape), self.stride(), self.storage_offset(), self.device)
        data, scale, orig_dtype, block, gemm, is_param = legacy_state_fields(state, outer)
        self._data, self._scale = data, scale
        self._orig_dtype, self._block, self._gemm = orig_dtype, block, gemm
        if is_param:
            self._is_param = True
        if type(self) is not Float8Tensor:  # _LegacyFloat8Tensor, see there
            self.__class__ = Float8Tensor

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
    """Unpickle a Float8Tensor (``torch.load``, with ``weights_only=True`` too; ``pickle``;
    ``copy.deepcopy``): every field is validated (``validation.checkpoint_fields``) before
    the tensor exists. Checkpoints name this function: it stays defined in this module.
    Returns the Float8Tensor, or an ``nn.Parameter`` over it when one was saved."""
    data, scale, orig_dtype, block, gemm, requires_grad, is_param = checkpoint_fields(version, fields)
    out = Float8Tensor(data, scale, orig_dtype, block, gemm)
    if is_param:
        return torch.nn.Parameter(out, requires_grad=requires_grad)
    return out.requires_grad_(requires_grad)


class _LegacyFloat8Tensor(Float8Tensor):
    """What ``weights_only=True`` loading knows as ``f8tensor.tensor.float8.Float8Tensor``.

    Checkpoints written before :meth:`Float8Tensor.__reduce_ex__` name the class: they
    rebuild an empty wrapper of it and restore its attributes through ``__setstate__``,
    which validates them and turns the object into a Float8Tensor. Constructing the class
    directly (pickle's NEWOBJ), which would skip that validation, is refused.
    """

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        raise TypeError("a Float8Tensor is loaded through its validating rebuild, never constructed from a checkpoint")

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> NoReturn:
        raise RuntimeError("a Float8Tensor from a checkpoint was used before its fields were restored (a malformed checkpoint)")


def is_float8(x: object) -> TypeIs[Float8Tensor]:
    """Whether ``x`` is a Float8Tensor (a type check narrows ``x`` by it)."""
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
    """``hp`` cast per ``spec`` (``kernels.cast``), unchecked and without autograd: the cast
    library code calls. ``scale``: used as is when given (dynamic otherwise); ``gemm``:
    the product config the result carries; ``orig_dtype``: what it stands for (default
    ``hp``'s dtype)."""
    data, scale = kernels.cast(hp, spec, scale, generator=generator)
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
    """:func:`to_float8` through ``kernels.cast_for_gemm``: the FP8 tensor and, with
    ``layouts="both"``, its column-major twin (config ``column_major_gemm``, default
    ``gemm``), else None. ``layouts="column_major"``: the tensor's own bytes column-major.
    Both carry the scale's inverse where the cast computed it (``kernels.cast_for_gemm``;
    see :func:`with_inverse_scale`)."""
    out = kernels.cast_for_gemm(hp, spec, scale, layouts=layouts)
    block = layout_block(spec.block, hp.dim())
    f8 = Float8Tensor(out.data, out.scale, hp.dtype, block, gemm)
    twin = None
    if out.column_major is not None:
        twin = Float8Tensor(out.column_major, out.scale, hp.dtype, block, gemm if column_major_gemm is None else column_major_gemm)
    if out.inverse is not None:
        f8._inv_scale = out.inverse
        if twin is not None:
            twin._inv_scale = out.inverse
    return f8, twin


def with_inverse_scale(f8: Float8Tensor) -> Float8Tensor:
    """``f8`` (a fresh cast of the library's own) carrying ``1 / f8._scale``, computed once
    here for every product that reads it instead of once per product, when its scale is
    per tensor (a tensor that two GEMMs of a step read, transposed or not; an axiswise or
    block scale serves one GEMM, whose operand preparation computes its inverse). Eager
    only: under torch.compile it returns ``f8`` as is (inductor places the reciprocal)."""
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
    """:func:`to_float8`, also measuring what the cast did (see :func:`cast_to_float8_with_stats`)."""
    data, scale, stats = kernels.cast_with_stats(hp, spec, scale, amax=amax, generator=generator)
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
    """The cast itself, unchecked and without autograd, in keywords (a spec is built and
    :func:`to_float8` called).

    Granularity: ``block`` (a full per-dim block, see :class:`Float8Tensor`), or the old
    spelling ``axiswise_dim`` (``None``: tensorwise). With ``scale=None`` the scale is
    dynamic (the current amax of ``hp``, per block). ``scale_dtype``/``scale_mode``: fp32 or
    e8m0 scales (and the e8m0 exponent rule); ``rounding``: ``"nearest"`` or ``"stochastic"``.
    """
    spec = keyword_spec(hp.dim(), float8_dtype, axiswise_dim, block, power_of_2_scale, scale_dtype, scale_mode, rounding)
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
    """:func:`cast_to_float8`, also measuring what the cast did to ``hp``: bitwise the same
    Float8Tensor, and a float64 vector laid out as :data:`CAST_STATS_FIELDS` (what each
    entry means: :func:`f8tensor.kernels.cast_with_stats`)."""
    spec = keyword_spec(hp.dim(), float8_dtype, axiswise_dim, block, power_of_2_scale, scale_dtype, scale_mode, rounding)
    return to_float8_with_stats(hp, spec, scale=scale, amax=amax, gemm=gemm, orig_dtype=orig_dtype, generator=generator)


def dequantize(f8: Float8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_data / _scale`` in fp32 per block, then cast to ``dtype`` (default: the original dtype)."""
    return kernels.dequantize(f8._data, f8._scale, f8._block, dtype or f8._orig_dtype)


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
            # An explicit scale skips the amax pass that would otherwise catch inf inputs:
            # keep them non-finite (NaN) rather than saturating them to a finite max.
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



# Checkpoints name the class and the rebuild function by their path before the package was
# cut by concern (f8tensor.tensor re-exports both).
Float8Tensor.__module__ = "f8tensor.tensor"
_rebuild_float8_tensor.__module__ = "f8tensor.tensor"
