"""Float8Tensor: raw FP8 data, its scale and the dtype it stands for.

The tensor is a plain container: it never decides a scale (``scaling.py`` does) and its
ops live in a table filled by ``ops.py``. The casts into and out of it are autograd
Functions whose backward passes the gradient through unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NamedTuple

import torch

from f8tensor.config import (
    DEFAULT_GEMM,
    ROUNDING_MODES,
    BlockGranularity,
    GemmConfig,
    Granularity,
    axiswise_block,
    block_scale_shape,
    parse_granularity,
)
from f8tensor.formats import E8M0, FORMATS, check_float8_dtype, check_hp_dtype, saturated_cast, saturation_bound
from f8tensor.scaling import (
    amax_to_e8m0_scale,
    amax_to_scale,
    block_amax,
    dynamic_scale,
    expand_block_scale,
    stochastic_round,
    tensor_amax,
)

__all__ = ["CAST_STATS_FIELDS", "Float8Tensor", "cast_to_float8", "cast_to_float8_with_stats", "dequantize"]

_NO_KWARGS = types.MappingProxyType({})
OpHandler = Callable[[Any, Any, tuple, dict], Any]


class Float8Tensor(torch.Tensor):
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

    Derived, read-only: ``_axiswise_dim`` (the old spelling: ``None`` for tensorwise, ``d``
    for a block that is 0 at ``d`` and 1 elsewhere; block-scaled tensors raise, so no code
    written for the old granularities mistakes a block scale for a per-row one), and the
    public :attr:`granularity`, :attr:`axiswise_dim` and :attr:`block`.

    Build one with :meth:`from_hp`; get the high-precision values back with :meth:`to_hp`.
    Metadata is immutable and compares by value, so ``__tensor_flatten__`` and
    ``__tensor_unflatten__`` are exact inverses (torch.compile relies on it).
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _block: tuple[int, ...]
    _gemm: GemmConfig

    # The op table: aten overload -> handler(func, types, args, kwargs). Filled by ops.py.
    _OPS: ClassVar[dict[Any, OpHandler]] = {}

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        block: tuple[int, ...] | None = None,
        gemm: GemmConfig = DEFAULT_GEMM,
    ) -> Float8Tensor:
        self = torch.Tensor._make_wrapper_subclass(
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
        # None: tensorwise (all zeros) for data of any ndim.
        self._block = (0,) * data.dim() if block is None else block
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
        """
        if isinstance(hp, Float8Tensor):
            raise TypeError("from_hp expects a high-precision tensor; got a Float8Tensor (call .to_hp() first)")
        if not isinstance(hp, torch.Tensor):
            raise TypeError(f"from_hp expects a torch.Tensor; got {type(hp).__name__}")
        check_hp_dtype(hp.dtype, "Float8Tensor.from_hp input")
        check_float8_dtype(float8_dtype)
        gran = parse_granularity(granularity)
        if gran is Granularity.ROWWISE and hp.dim() == 0:
            raise ValueError("rowwise scaling needs at least one dimension; got a 0-dim tensor")
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {ROUNDING_MODES}; got {rounding!r}")
        if isinstance(gran, BlockGranularity):
            block, scale_dtype, scale_mode = gran.full_block(hp.dim()), gran.scale_dtype, gran.scale_mode
        else:
            block = axiswise_block(hp.dim() - 1 if gran is Granularity.ROWWISE else None, hp.dim())
            scale_dtype, scale_mode = torch.float32, "rceil"
        tensorwise = gran is Granularity.TENSORWISE
        if gemm_config is None:
            gemm_config = DEFAULT_GEMM
        elif not isinstance(gemm_config, GemmConfig):
            raise TypeError(f"gemm_config must be a GemmConfig; got {type(gemm_config).__name__}")
        else:
            gemm_config.validated()
        if scale is not None:
            scale = _check_given_scale(scale, hp, block, tensorwise, scale_dtype)
        cast = _CastSpec(None if tensorwise else block, scale_dtype, scale_mode, power_of_2_scale, rounding)
        return _FromHP.apply(hp, float8_dtype, cast, scale, gemm_config, generator)

    def to_hp(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize to a plain tensor in the original dtype (or ``dtype``), differentiably."""
        if dtype is not None:
            check_hp_dtype(dtype, "to_hp dtype")
        return _ToHP.apply(self, dtype)

    # ----------------------------------------------------------------- introspection

    @property
    def float8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def _axiswise_dim(self) -> int | None:
        """The old spelling of the block (read-only): ``None`` for tensorwise, ``d`` for an
        axiswise block (0 at ``d``, 1 elsewhere). Raises for a true block."""
        axis = _block_axis(self._block, self._scale.dim())
        if axis == -1:
            raise ValueError(
                f"a block-scaled Float8Tensor (block {self._block}) has no axiswise_dim; read ._block "
                f"(code written for tensorwise/rowwise scales does not apply to block scales)"
            )
        return axis

    @property
    def is_blockwise(self) -> bool:
        """True for a true block scale (1x128, 128x128, MX, ...), False for tensorwise/axiswise."""
        return _block_axis(self._block, self._scale.dim()) == -1

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
        return Granularity.TENSORWISE if self._axiswise_dim is None else Granularity.ROWWISE

    @property
    def axiswise_dim(self) -> int | None:
        return self._axiswise_dim

    @property
    def gemm_config(self) -> GemmConfig:
        return self._gemm

    def _replace(self, **changes: Any) -> Float8Tensor:
        """The one way to rebuild: a new Float8Tensor with some fields changed."""
        fields = {
            "data": self._data,
            "scale": self._scale,
            "orig_dtype": self._orig_dtype,
            "block": self._block,
            "gemm": self._gemm,
        }
        if "axiswise_dim" in changes:
            # The old spelling, translated for the (possibly new) data's ndim.
            axis = changes.pop("axiswise_dim")
            changes["block"] = axiswise_block(axis, changes.get("data", self._data).dim())
        elif "data" in changes and "block" not in changes and changes["data"].dim() != self._data.dim():
            raise ValueError("Float8Tensor._replace: new data of another ndim needs its block")
        fields.update(changes)
        return Float8Tensor(**fields)

    def __repr__(self) -> str:  # type: ignore[override]
        axis = _block_axis(self._block, self._scale.dim())
        if axis is None and not _is_fake(self._scale):
            scale = f"scale={self._scale.item():.6g}"
        else:
            scale = f"scale_shape={tuple(self._scale.shape)}"
        if axis is None:
            gran = "tensorwise"
        elif axis == -1:
            e8m0 = ", e8m0" if self._scale.dtype == E8M0 else ""
            gran = f"block={self._block}{e8m0}"
        else:
            gran = f"axiswise(dim={axis})"
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

    # ----------------------------------------------------------------- dispatch

    @classmethod
    def implements(cls, ops: Iterable[Any]) -> Callable[[OpHandler], OpHandler]:
        """Register a handler for aten ops; registering an op twice is an error."""

        def register(handler: OpHandler) -> OpHandler:
            for op in ops:
                if op in cls._OPS:
                    raise RuntimeError(f"Float8Tensor: {op} already has a handler ({cls._OPS[op].__name__})")
                cls._OPS[op] = handler
            return handler

        return register

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        handler = cls._OPS.get(func)
        if handler is not None:
            return handler(func, types, args, kwargs if kwargs is not None else _NO_KWARGS)
        raise NotImplementedError(
            f"Float8Tensor does not support {func}. FP8 data only takes part in matrix "
            f"products (mm, addmm, matmul, linear) and layout ops; call .to_hp() first to "
            f"compute in high precision."
        )


def _block_axis(block: tuple[int, ...], scale_ndim: int) -> int | None:
    """``None`` (tensorwise: 0-dim scale), ``d`` (0 at ``d``, 1 elsewhere; an all-0 block
    with a non-0-dim scale counts as axiswise along the last dim) or -1 (a true block)."""
    if scale_ndim == 0:
        return None
    zeros = [d for d, b in enumerate(block) if b == 0]
    if len(zeros) == len(block):
        return len(block) - 1
    if len(zeros) == 1 and all(b in (0, 1) for b in block):
        return zeros[0]
    return -1


class _CastSpec(NamedTuple):
    """How a cast scales and rounds: the per-dim block (``None``: tensorwise), the scale's
    dtype, the e8m0 exponent rule, power-of-two fp32 scales, and the rounding mode."""

    block: tuple[int, ...] | None
    scale_dtype: torch.dtype = torch.float32
    scale_mode: str = "rceil"
    power_of_2_scale: bool = False
    rounding: str = "nearest"


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or t.device.type == "meta"


def _check_given_scale(
    scale: torch.Tensor | float, hp: torch.Tensor, block: tuple[int, ...], tensorwise: bool, scale_dtype: torch.dtype
) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or an fp32 tensor; got {type(scale).__name__}")
        if not (0.0 < float(scale) < float("inf")):
            raise ValueError(f"scale must be a positive finite number; got {scale!r}")
        scale = torch.tensor(float(scale), dtype=torch.float32, device=hp.device)
    if scale.dtype != scale_dtype:
        want = "float32" if scale_dtype == torch.float32 else f"{scale_dtype} (MX granularity)"
        raise TypeError(f"scale must be {want}; got {scale.dtype}")
    if tensorwise:
        if scale.numel() != 1:
            raise ValueError(f"a tensorwise scale has one element; got shape {tuple(scale.shape)}")
        return scale.reshape(())
    expected = block_scale_shape(tuple(hp.shape), block)
    if tuple(scale.shape) != expected:
        kind = "rowwise" if _block_axis(block, 1) == len(block) - 1 else f"block {block}"
        raise ValueError(f"a {kind} scale for shape {tuple(hp.shape)} must have shape {expected}; got {tuple(scale.shape)}")
    return scale


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
    """The cast itself, unchecked and without autograd: library code calls this.

    Granularity: ``block`` (a full per-dim block, see :class:`Float8Tensor`), or the old
    spelling ``axiswise_dim`` (``None``: tensorwise). With ``scale=None`` the scale is
    dynamic (the current amax of ``hp``, per block). ``scale_dtype``/``scale_mode``: fp32 or
    e8m0 scales (and the e8m0 exponent rule); ``rounding``: ``"nearest"`` or ``"stochastic"``.
    """
    f8, _, _, _ = _cast(
        hp, float8_dtype, axiswise_dim, block, scale, gemm, power_of_2_scale, orig_dtype,
        scale_dtype, scale_mode, rounding, generator, need_amax=False,
    )
    return f8


def _cast(
    hp, float8_dtype, axiswise_dim, block, scale, gemm, power_of_2_scale, orig_dtype,
    scale_dtype, scale_mode, rounding, generator, *, need_amax, amax=None, inplace=True,
):
    """Shared body of the two casts: (Float8Tensor, scaled fp32 values, group amax, fp32 scale)."""
    group_amax = None
    if block is not None and scale_dtype == torch.float32 and block.count(0) == 1 and set(block) <= {0, 1}:
        # An axiswise block (0 at one dim, 1 elsewhere): the per-axis amax kernels, same bits.
        axiswise_dim, block = block.index(0), None
    if block is None:
        block = axiswise_block(axiswise_dim, hp.dim())
        if scale is None:
            group_amax = tensor_amax(hp, axiswise_dim)
            scale = amax_to_scale(group_amax, float8_dtype, round_pow2=power_of_2_scale)
        elif need_amax:
            group_amax = amax if (amax is not None and axiswise_dim is None) else tensor_amax(hp, axiswise_dim)
        scale32 = scale
        expanded = scale
    else:
        if scale is None or need_amax:
            group_amax = block_amax(hp, block)
        if scale is None:
            if scale_dtype == E8M0:
                scale = amax_to_e8m0_scale(group_amax, float8_dtype, scale_mode)
            else:
                scale = amax_to_scale(group_amax, float8_dtype, round_pow2=power_of_2_scale)
        # Deliberate upcast of e8m0 scales: powers of two, exact in fp32.
        scale32 = scale if scale.dtype == torch.float32 else scale.to(torch.float32)
        expanded = expand_block_scale(scale32, block, tuple(hp.shape))
    scaled = _scaled_fp32(hp, expanded)
    if rounding == "stochastic":
        fmax = FORMATS[float8_dtype].max
        data = saturated_cast(stochastic_round(scaled.clamp(-fmax, fmax), float8_dtype, generator), float8_dtype)
    else:
        # The product is a temporary of our own: clamp it in place unless stats read it.
        data = saturated_cast(scaled, float8_dtype, inplace=inplace and not need_amax)
    return Float8Tensor(data, scale, orig_dtype or hp.dtype, block, gemm), scaled, group_amax, scale32


def _scaled_fp32(hp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``hp * scale`` computed in fp32: the values the FP8 rounding sees.

    Deliberate upcast: bf16/fp16 inputs are not rounded a second time before the FP8
    rounding. A 0-dim fp32 scale would not promote a bf16 tensor; a 1-element one does,
    and the multiply then reads ``hp`` directly instead of after a separate upcast pass
    (the same bits as ``hp.float() * scale``).
    """
    if hp.dim() == 0:
        return hp.to(torch.float32) * scale
    return hp * (scale.reshape(1) if scale.dim() == 0 else scale)


#: The entries of the vector :func:`cast_to_float8_with_stats` returns, in this order.
CAST_STATS_FIELDS: tuple[str, ...] = ("saturated_count", "underflow_count", "numel", "amax", "scale", "headroom_log2")


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
    """:func:`cast_to_float8`, also measuring what the cast did to ``hp``.

    The Float8Tensor is bitwise the one :func:`cast_to_float8` returns for the same
    arguments. The second result is a float64 vector laid out as :data:`CAST_STATS_FIELDS`:

    - ``saturated_count``: elements whose FP8 value the clamp set, i.e. scaled magnitude
      above :func:`~f8tensor.formats.saturation_bound` (max itself, and values that round
      to max anyway, are not saturated). NaN is never counted.
    - ``underflow_count``: elements non-zero in ``hp`` and zero in FP8 (flushed to zero:
      scaled magnitude at most half the smallest subnormal, where round-to-nearest-even
      gives zero).
    - ``numel``: the element count, so that fractions can be formed where they are read.
    - ``amax``: ``max |hp|``. ``amax``, when given, is that value already measured by the
      caller (tensorwise only), and saves a read of ``hp``.
    - ``scale``: the scale in use; for axiswise and block scales the smallest one (the
      row or block that holds the tensor's amax, under dynamic scaling).
    - ``headroom_log2``: ``log2(float8_max / max |hp * scale|)``. About 0 with a dynamic
      scale; positive when a (delayed) scale leaves range unused; negative when the amax
      was clipped, by that many powers of two. ``inf`` for an all-zero tensor.

    With ``rounding="stochastic"`` the counts are those of round-to-nearest on the same
    products (a stochastic cast flushes a slightly different set of tiny values).

    Everything is computed from the fp32 products ``hp * scale`` the cast computes anyway
    and the amax it measures, so under torch.compile it fuses into the cast's kernel (no
    second read of ``hp``). The vector is float64 so that counts stay exact (fp32 would
    stop at 2**24 elements) next to fp32 amax and scale values.
    """
    f8, scaled, group_amax, scale32 = _cast(
        hp, float8_dtype, axiswise_dim, block, scale, gemm, power_of_2_scale, orig_dtype,
        scale_dtype, scale_mode, rounding, generator, need_amax=True, amax=amax,
    )
    return f8, _cast_stats(hp, scaled, group_amax, scale32, float8_dtype)


def _cast_stats(
    hp: torch.Tensor,
    scaled: torch.Tensor,
    group_amax: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
) -> torch.Tensor:
    f64 = torch.float64
    if hp.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), float("nan")], dtype=f64, device=hp.device)
    fmt = FORMATS[float8_dtype]
    magnitude = scaled.abs()
    # int32 counters where they cannot overflow: a CPU kernel accumulates them at about half
    # the cost of int64 ones (the tensor's size is static, so this is decided once per shape).
    count = torch.int32 if hp.numel() < 2**31 else torch.int64
    saturated = (magnitude > saturation_bound(float8_dtype)).sum(dtype=count)
    # Round-to-nearest-even sends |x| <= smallest_subnormal / 2 to zero (the tie too: zero's
    # mantissa is even) and anything larger to a non-zero value, in all four formats. So the
    # flushed elements are found on the fp32 products, not by reading the FP8 bytes back.
    underflow = ((hp != 0) & (magnitude <= fmt.smallest_subnormal / 2)).sum(dtype=count)
    # max |hp * scale| without another pass over the tensor: fp32 rounding is monotonic, so
    # the largest rounded product is the rounded product of the largest |hp| (per group).
    scaled_amax = (group_amax * scale).amax()
    # Deliberate upcast: a ratio of fp32 numbers, exact enough for the log in float64.
    headroom = torch.log2(fmt.max / scaled_amax.to(f64))
    numel = torch.full((), hp.numel(), dtype=f64, device=hp.device)
    return torch.stack(
        [saturated.to(f64), underflow.to(f64), numel, group_amax.amax().to(f64), scale.amin().to(f64), headroom]
    )


def dequantize(f8: Float8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_data / _scale`` in fp32 per block, then cast to ``dtype`` (default: the original dtype)."""
    scale = f8._scale
    if scale.dim() and any(b > 1 for b in f8._block):
        scale = expand_block_scale(scale, f8._block, tuple(f8._data.shape))
    elif scale.dtype != torch.float32:
        scale = scale.to(torch.float32)  # e8m0: powers of two, exact in fp32
    hp = f8._data.to(torch.float32) / scale
    return hp.to(dtype or f8._orig_dtype)


class _FromHP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hp, float8_dtype, cast, scale, gemm, generator):  # type: ignore[override]
        if scale is not None:
            # An explicit scale skips the amax pass that would otherwise catch inf inputs:
            # keep them non-finite (NaN) rather than saturating them to a finite max.
            hp = torch.where(torch.isinf(hp), torch.nan, hp)
        return cast_to_float8(
            hp,
            float8_dtype,
            block=cast.block,
            scale=scale,
            gemm=gemm,
            power_of_2_scale=cast.power_of_2_scale,
            scale_dtype=cast.scale_dtype,
            scale_mode=cast.scale_mode,
            rounding=cast.rounding,
            generator=generator,
        )

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None, None, None, None


class _ToHP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f8, dtype):  # type: ignore[override]
        return dequantize(f8, dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None

