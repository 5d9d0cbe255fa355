"""Float8Tensor: raw FP8 data, its scale and the dtype it stands for.

The tensor is a plain container: it never decides a scale (``scaling.py`` does) and its
ops live in a table filled by ``ops.py``. The casts into and out of it are autograd
Functions whose backward passes the gradient through unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from f8tensor.config import DEFAULT_GEMM, GemmConfig, Granularity
from f8tensor.formats import FORMATS, check_float8_dtype, check_hp_dtype, saturated_cast, saturation_bound
from f8tensor.scaling import amax_to_scale, dynamic_scale, tensor_amax

__all__ = ["CAST_STATS_FIELDS", "Float8Tensor", "cast_to_float8", "cast_to_float8_with_stats", "dequantize"]

_NO_KWARGS = types.MappingProxyType({})
OpHandler = Callable[[Any, Any, tuple, dict], Any]


class Float8Tensor(torch.Tensor):
    """An FP8 tensor that behaves like the high-precision tensor it was cast from.

    Outer (visible) dtype: the original dtype (bf16, fp16 or fp32); outer shape and
    strides: those of the data. Fields:

    - ``_data``: the FP8 payload, any of the four torch float8 dtypes.
    - ``_scale``: fp32. Tensorwise: a 0-dim tensor. Axiswise ("rowwise"): same ndim as
      ``_data``, size 1 along ``_axiswise_dim`` and equal to ``_data`` elsewhere.
      Invariant: ``_data = saturate(hp.float() * _scale)``, ``hp ~= _data.float() / _scale``.
    - ``_orig_dtype``: the high-precision dtype (also the outer dtype).
    - ``_axiswise_dim``: ``None`` for tensorwise, else the dimension the amax was reduced
      over (the scale is constant along it). Rowwise on a weight ``(out, in)`` is 1.
    - ``_gemm``: the :class:`GemmConfig` used when this tensor enters a matrix product.

    Build one with :meth:`from_hp`; get the high-precision values back with :meth:`to_hp`.
    Metadata is immutable and compares by value, so ``__tensor_flatten__`` and
    ``__tensor_unflatten__`` are exact inverses (torch.compile relies on it).
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _axiswise_dim: int | None
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
        axiswise_dim: int | None = None,
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
        self._axiswise_dim = axiswise_dim
        self._gemm = gemm
        return self

    # ----------------------------------------------------------------- construction

    @staticmethod
    def from_hp(
        hp: torch.Tensor,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        granularity: str | Granularity = "tensorwise",
        scale: torch.Tensor | float | None = None,
        gemm_config: GemmConfig | None = None,
        power_of_2_scale: bool = False,
    ) -> Float8Tensor:
        """Cast a bf16/fp16/fp32 tensor to FP8 (saturating), differentiably.

        ``granularity``: ``"tensorwise"`` (one scale) or ``"rowwise"`` (one scale per row,
        along the last dim). ``scale``: used as is when given (a float, a 0-dim tensor,
        or for rowwise a tensor of shape ``hp.shape[:-1] + (1,)``); otherwise the current
        amax sets it. ``gemm_config``: how matrix products with this tensor run (output
        dtype, padding, fast accumulation). ``power_of_2_scale``: round a computed scale
        down to a power of two. The gradient flows to ``hp`` unchanged.
        """
        if isinstance(hp, Float8Tensor):
            raise TypeError("from_hp expects a high-precision tensor; got a Float8Tensor (call .to_hp() first)")
        if not isinstance(hp, torch.Tensor):
            raise TypeError(f"from_hp expects a torch.Tensor; got {type(hp).__name__}")
        check_hp_dtype(hp.dtype, "Float8Tensor.from_hp input")
        check_float8_dtype(float8_dtype)
        gran = Granularity.parse(granularity)
        if gran is Granularity.ROWWISE and hp.dim() == 0:
            raise ValueError("rowwise scaling needs at least one dimension; got a 0-dim tensor")
        axiswise_dim = hp.dim() - 1 if gran is Granularity.ROWWISE else None
        if gemm_config is None:
            gemm_config = DEFAULT_GEMM
        elif not isinstance(gemm_config, GemmConfig):
            raise TypeError(f"gemm_config must be a GemmConfig; got {type(gemm_config).__name__}")
        else:
            gemm_config.validated()
        if scale is not None:
            scale = _check_given_scale(scale, hp, axiswise_dim)
        return _FromHP.apply(hp, float8_dtype, axiswise_dim, scale, gemm_config, power_of_2_scale)

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
    def granularity(self) -> Granularity:
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
            "axiswise_dim": self._axiswise_dim,
            "gemm": self._gemm,
        }
        fields.update(changes)
        return Float8Tensor(**fields)

    def __repr__(self) -> str:  # type: ignore[override]
        if self._axiswise_dim is None and not _is_fake(self._scale):
            scale = f"scale={self._scale.item():.6g}"
        else:
            scale = f"scale_shape={tuple(self._scale.shape)}"
        gran = "tensorwise" if self._axiswise_dim is None else f"axiswise(dim={self._axiswise_dim})"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"Float8Tensor({str(self._data.dtype).removeprefix('torch.')}, shape={tuple(self.shape)}, "
            f"orig_dtype={self._orig_dtype}, {gran}, {scale}{grad})"
        )

    # ----------------------------------------------------------------- compile support

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_data", "_scale"], (self._orig_dtype, self._axiswise_dim, self._gemm)

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


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or t.device.type == "meta"


def _check_given_scale(scale: torch.Tensor | float, hp: torch.Tensor, axiswise_dim: int | None) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or an fp32 tensor; got {type(scale).__name__}")
        if not (0.0 < float(scale) < float("inf")):
            raise ValueError(f"scale must be a positive finite number; got {scale!r}")
        scale = torch.tensor(float(scale), dtype=torch.float32, device=hp.device)
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32; got {scale.dtype}")
    if axiswise_dim is None:
        if scale.numel() != 1:
            raise ValueError(f"a tensorwise scale has one element; got shape {tuple(scale.shape)}")
        return scale.reshape(())
    expected = tuple(hp.shape[:-1]) + (1,)
    if tuple(scale.shape) != expected:
        raise ValueError(f"a rowwise scale for shape {tuple(hp.shape)} must have shape {expected}; got {tuple(scale.shape)}")
    return scale


def cast_to_float8(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    axiswise_dim: int | None = None,
    scale: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    power_of_2_scale: bool = False,
    orig_dtype: torch.dtype | None = None,
) -> Float8Tensor:
    """The cast itself, unchecked and without autograd: library code calls this.

    With ``scale=None`` the scale is dynamic (the current amax of ``hp``).
    """
    if scale is None:
        scale = dynamic_scale(hp, float8_dtype, axiswise_dim=axiswise_dim, round_pow2=power_of_2_scale)
    # The product is a temporary of our own: clamp it in place.
    data = saturated_cast(_scaled_fp32(hp, scale), float8_dtype, inplace=True)
    return Float8Tensor(data, scale, orig_dtype or hp.dtype, axiswise_dim, gemm)


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
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    gemm: GemmConfig = DEFAULT_GEMM,
    power_of_2_scale: bool = False,
    orig_dtype: torch.dtype | None = None,
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
    - ``scale``: the scale in use; for axiswise scales the smallest one (the row that
      holds the tensor's amax, under dynamic scaling).
    - ``headroom_log2``: ``log2(float8_max / max |hp * scale|)``. About 0 with a dynamic
      scale; positive when a (delayed) scale leaves range unused; negative when the amax
      was clipped, by that many powers of two. ``inf`` for an all-zero tensor.

    Everything is computed from the fp32 products ``hp * scale`` the cast computes anyway
    and the amax it measures, so under torch.compile it fuses into the cast's kernel (no
    second read of ``hp``). The vector is float64 so that counts stay exact (fp32 would
    stop at 2**24 elements) next to fp32 amax and scale values.
    """
    if scale is None:
        # The same two steps as dynamic_scale, keeping the amax it measures.
        group_amax = tensor_amax(hp, axiswise_dim)
        scale = amax_to_scale(group_amax, float8_dtype, round_pow2=power_of_2_scale)
    elif amax is None or axiswise_dim is not None:
        group_amax = tensor_amax(hp, axiswise_dim)
    else:
        group_amax = amax
    scaled = _scaled_fp32(hp, scale)
    data = saturated_cast(scaled, float8_dtype)  # not in place: the stats read `scaled`
    f8 = Float8Tensor(data, scale, orig_dtype or hp.dtype, axiswise_dim, gemm)
    return f8, _cast_stats(hp, scaled, group_amax, scale, float8_dtype)


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
    """``_data / _scale`` in fp32, then cast to ``dtype`` (default: the original dtype)."""
    hp = f8._data.to(torch.float32) / f8._scale
    return hp.to(dtype or f8._orig_dtype)


class _FromHP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hp, float8_dtype, axiswise_dim, scale, gemm, power_of_2_scale):  # type: ignore[override]
        if scale is not None:
            # An explicit scale skips the amax pass that would otherwise catch inf inputs:
            # keep them non-finite (NaN) rather than saturating them to a finite max.
            hp = torch.where(torch.isinf(hp), torch.nan, hp)
        return cast_to_float8(
            hp, float8_dtype, axiswise_dim=axiswise_dim, scale=scale, gemm=gemm, power_of_2_scale=power_of_2_scale
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

