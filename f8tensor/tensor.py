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
from f8tensor.formats import (
    E8M0,
    FORMATS,
    SCALE_DTYPES,
    check_float8_dtype,
    check_hp_dtype,
    saturated_cast,
    saturation_bound,
)
from f8tensor.scaling import (
    amax_to_e8m0_scale,
    amax_to_scale,
    block_amax,
    expand_block_scale,
    stochastic_round,
    tensor_amax,
)

__all__ = [
    "CAST_STATS_FIELDS",
    "SCALE_DTYPES",
    "Float8Tensor",
    "cast_to_float8",
    "cast_to_float8_with_stats",
    "check_scale_values",
    "dequantize",
    "scale_from_number",
]

# SCALE_DTYPES (fp32, e8m0fnu for MX) is defined in formats.py, next to E8M0, and
# re-exported here: the dtypes a Float8Tensor's ``_scale`` may have.
# A scale must be a normal fp32 number: its inverse (the dequantization factor) is then
# finite too. 2**-126 ~ 1.18e-38 up to the fp32 max ~ 3.4e38.
_SCALE_MIN = torch.finfo(torch.float32).tiny
_SCALE_MAX = torch.finfo(torch.float32).max

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
        if not isinstance(power_of_2_scale, bool):
            raise TypeError(f"power_of_2_scale must be a bool; got {power_of_2_scale!r}")
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

    # ----------------------------------------------------------------- serialization

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        """Pickle (``torch.save``, ``pickle``, ``copy.deepcopy``) as plain fields rebuilt by
        :func:`_rebuild_float8_tensor`, the one validating way back.

        The FP8 bytes travel as a ``uint8`` tensor holding exactly this tensor's elements (a
        slice or ``split`` piece is copied out of its larger storage; a dense layout keeps
        its strides): ``uint8`` pickles everywhere, where FP8 storages do not always.
        Attributes other than the fields (and ``nn.Parameter``'s mark) are not saved.
        """
        return (_rebuild_float8_tensor, (_SERIAL_VERSION, self._serial_fields()))

    def _serial_fields(self) -> dict[str, Any]:
        raw = self._data.view(torch.uint8)
        size, stride = tuple(raw.shape), raw.stride()
        own = raw.storage_offset() == 0 and raw.untyped_storage().nbytes() == _extent(size, stride)
        if not (own and _no_overlap(size, stride)):
            raw = raw.clone(memory_format=torch.contiguous_format)
        gemm = self._gemm
        return {
            "data": raw,
            "float8_dtype": self._data.dtype,
            # e8m0 scales travel as their uint8 codes: torch storages of that dtype do not
            # survive a plain pickle (torch 2.13), uint8 does everywhere.
            "scale": self._scale.view(torch.uint8) if self._scale.dtype == E8M0 else self._scale,
            "scale_dtype": self._scale.dtype,
            "orig_dtype": self._orig_dtype,
            "block": self._block,
            "gemm": tuple(gemm),
            "requires_grad": self.requires_grad,
            "is_param": bool(self.__dict__.get("_is_param", False)),
        }

    def __deepcopy__(self, memo: dict) -> Float8Tensor:
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
        dict_state = state[0] if isinstance(state, tuple) and len(state) == 2 else state
        if isinstance(state, tuple) and len(state) == 2 and state[1]:
            raise ValueError(f"Float8Tensor checkpoint: unexpected slot state {sorted(state[1])!r}")
        if not isinstance(dict_state, dict):
            raise ValueError(f"Float8Tensor checkpoint: the state must be a dict of fields; got {type(dict_state).__name__}")
        names = {"_data", "_scale", "_orig_dtype", "_axiswise_dim", "_gemm"}
        missing, extra = names - dict_state.keys(), dict_state.keys() - names - {"_is_param"}
        if missing or extra:
            raise ValueError(
                f"Float8Tensor checkpoint: fields must be exactly {sorted(names)} (plus '_is_param'); "
                f"missing {sorted(missing)}, unexpected {sorted(map(str, extra))}"
            )
        if dict_state.get("_is_param", True) is not True:
            raise ValueError(f"Float8Tensor checkpoint: '_is_param' must be True; got {dict_state['_is_param']!r}")
        data, gemm = dict_state["_data"], dict_state["_gemm"]
        if type(gemm) is not GemmConfig:
            raise TypeError(f"Float8Tensor checkpoint: '_gemm' must be a GemmConfig; got {type(gemm).__name__}")
        block = _block_from_axiswise_dim(dict_state["_axiswise_dim"], data)
        scale = _validate_fields(data, dict_state["_scale"], dict_state["_orig_dtype"], block, gemm)
        outer = (self.dtype, tuple(self.shape), self.stride(), self.storage_offset(), self.device)
        inner = (dict_state["_orig_dtype"], tuple(data.shape), data.stride(), data.storage_offset(), data.device)
        if outer != inner:
            raise ValueError(
                f"Float8Tensor checkpoint: the wrapper (dtype, shape, strides, offset, device) {outer} "
                f"does not match its data {inner}"
            )
        self._data, self._scale = data, scale
        self._orig_dtype, self._block, self._gemm = dict_state["_orig_dtype"], block, gemm
        if "_is_param" in dict_state:
            self._is_param = True
        if type(self) is not Float8Tensor:  # _LegacyFloat8Tensor, see there
            self.__class__ = Float8Tensor

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


# ===================================================================== validation

# Version 2 stores the per-dim block, the scale's dtype (an e8m0 scale as uint8 codes) and
# every GemmConfig field; version 1 stored the
# old ``axiswise_dim`` (tensorwise/axiswise only) and a 3-field GemmConfig, and still loads.
_SERIAL_VERSION = 2
_SERIAL_FIELDS = frozenset(
    {"data", "float8_dtype", "scale", "scale_dtype", "orig_dtype", "block", "gemm", "requires_grad", "is_param"}
)
_SERIAL_FIELDS_V1 = _SERIAL_FIELDS - {"block", "scale_dtype"} | {"axiswise_dim"}
_GEMM_FIELDS_V1 = 3  # (out_dtype, use_fast_accum, pad_inner_dim)


def scale_from_number(value: object, what: str, device: torch.device | str | None = None) -> torch.Tensor:
    """A Python number as a 0-dim fp32 scale, range-checked *in fp32* (``1e39`` would
    round to inf there, ``1e-46`` to 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a float or an fp32 tensor; got {type(value).__name__}")
    scale = torch.tensor(float(value), dtype=torch.float32, device=device)
    as_fp32 = float(torch.tensor(float(value), dtype=torch.float32))
    if not _SCALE_MIN <= as_fp32 <= _SCALE_MAX:
        raise ValueError(
            f"{what} must be a positive finite fp32 number in [{_SCALE_MIN:.4g}, {_SCALE_MAX:.4g}] "
            f"(so that it and its inverse are finite normal fp32 numbers); got {value!r} (in fp32: {as_fp32!r})"
        )
    return scale


def check_scale_values(scale: torch.Tensor, what: str, *, allow_nan: bool = False) -> torch.Tensor:
    """Every entry of ``scale`` a normal positive finite fp32 number (NaN too if ``allow_nan``);
    an e8m0 scale: no NaN code unless ``allow_nan`` (its other codes are all valid).

    Checked where that costs no device sync: on CPU, eagerly, a bad entry raises
    ``ValueError``. Elsewhere (a GPU tensor, or under torch.compile) the values are not
    read: bad entries become NaN, so the tensor reads back NaN rather than finite garbage
    (PyTorch offers no way to raise from device code without a sync). Returns the scale.
    """
    if _is_fake(scale):
        return scale
    if scale.dtype == E8M0:
        # Every e8m0 code but 0xFF is a positive finite power of two, 2**-127 .. 2**127, exact
        # in fp32 as is its inverse (the fp32 range check does not apply); 0xFF is NaN.
        # A NaN code elsewhere than on eager CPU is left alone: it already reads back NaN.
        on_cpu = scale.device.type == "cpu" and not torch.compiler.is_compiling()
        if not allow_nan and on_cpu and bool((scale.view(torch.uint8) == 0xFF).any()):
            raise ValueError(f"{what} must hold e8m0 powers of two; got NaN (0xFF)")
        return scale
    ok = (scale >= _SCALE_MIN) & (scale <= _SCALE_MAX)
    if allow_nan:
        ok = ok | torch.isnan(scale)
    if scale.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok.all()):
            bad = scale[~ok].flatten()[0].item()
            nan = " or NaN" if allow_nan else ""
            raise ValueError(
                f"{what} must hold positive finite fp32 numbers in [{_SCALE_MIN:.4g}, {_SCALE_MAX:.4g}]{nan}; got {bad!r}"
            )
        return scale
    return torch.where(ok, scale, torch.nan)


def _extent(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to one past the last one a layout touches (0 when empty)."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(size, stride))


def _no_overlap(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether no two indices of the layout share an element (no zero or overlapping strides)."""
    if any(n == 0 for n in size):
        return True
    span = 1
    for st, n in sorted((st, n) for n, st in zip(size, stride) if n > 1):
        if st < span:
            return False
        span += (n - 1) * st
    return True


def _check_layout(t: torch.Tensor, what: str) -> None:
    """Every element of ``t`` has its own bytes in its real storage.

    A zero or overlapping stride would let a 2 KB checkpoint stand for a 16 GiB tensor that
    the first matmul or ``to_hp`` materializes; a view past its storage reads foreign memory.
    """
    if t.layout is not torch.strided:
        raise ValueError(f"{what} must be a strided (dense) tensor; got layout {t.layout}")
    size, stride = tuple(t.shape), t.stride()
    if any(st < 0 for st in stride) or not _no_overlap(size, stride):
        raise ValueError(
            f"{what} must not repeat elements through zero or overlapping strides; got shape {size}, strides {stride}"
        )
    if t.device.type == "meta":
        return
    end = (t.storage_offset() + _extent(size, stride)) * t.element_size()
    if end > t.untyped_storage().nbytes():
        raise ValueError(f"{what} reaches byte {end} of a storage of {t.untyped_storage().nbytes()} bytes")


def _scale_from_codes(scale: object, scale_dtype: object) -> object:
    """A version-2 checkpoint's scale: fp32 as is; e8m0 stored as its uint8 codes."""
    if scale_dtype not in SCALE_DTYPES or not isinstance(scale_dtype, torch.dtype):
        allowed = ", ".join(str(d) for d in SCALE_DTYPES)
        raise TypeError(f"Float8Tensor checkpoint: 'scale_dtype' must be one of {allowed}; got {scale_dtype!r}")
    stored = torch.uint8 if scale_dtype == E8M0 else scale_dtype
    if type(scale) is torch.Tensor and scale.dtype != stored:
        raise TypeError(
            f"Float8Tensor checkpoint: a {scale_dtype} scale is stored as a {stored} tensor; got {scale.dtype}"
        )
    return scale.view(E8M0) if scale_dtype == E8M0 and type(scale) is torch.Tensor else scale


def _block_from_axiswise_dim(axiswise_dim: object, data: torch.Tensor) -> tuple[int, ...]:
    """The block of a version-0/1 checkpoint's ``axiswise_dim`` (``None``: tensorwise)."""
    if axiswise_dim is None:
        return (0,) * data.dim()
    if isinstance(axiswise_dim, bool) or not isinstance(axiswise_dim, int):
        raise TypeError(f"Float8Tensor axiswise_dim must be None or an int; got {axiswise_dim!r}")
    if not 0 <= axiswise_dim < data.dim():
        raise ValueError(
            f"Float8Tensor axiswise_dim must be in [0, {data.dim()}) for data of shape "
            f"{tuple(data.shape)}; got {axiswise_dim}"
        )
    return axiswise_block(axiswise_dim, data.dim())


def _check_block(block: object, data: torch.Tensor, scale: torch.Tensor) -> None:
    """The block against the data and the scale (see the :class:`Float8Tensor` table).

    A tuple of ints >= 0, one per dim of the data. Tensorwise (all 0, 0-dim scale) takes an
    fp32 scale; any other block a scale of :func:`block_scale_shape`, fp32 or e8m0 (the
    rules of :class:`BlockGranularity`, which pairs e8m0 with any block).
    """
    if type(block) is not tuple or any(type(b) is not int for b in block):
        raise TypeError(f"Float8Tensor block must be a tuple of ints >= 0 (0: the whole dim); got {block!r}")
    if any(b < 0 for b in block):
        raise ValueError(f"Float8Tensor block entries must be >= 0 (0: the whole dim); got {block!r}")
    if len(block) != data.dim():
        raise ValueError(
            f"Float8Tensor block {block} must have one entry per dim of data of shape {tuple(data.shape)}"
        )
    if scale.dim() == 0:
        if any(block):
            raise ValueError(f"a 0-dim (tensorwise) scale needs an all-0 block; got block {block}")
        if scale.dtype != torch.float32:
            raise TypeError(f"a tensorwise Float8Tensor has a float32 scale; got {scale.dtype}")
        return
    expected = block_scale_shape(tuple(data.shape), block)
    if tuple(scale.shape) != expected:
        tensorwise = "" if any(block) else " or () (tensorwise)"
        raise ValueError(
            f"a block {block} scale for data of shape {tuple(data.shape)} must have shape {expected}{tensorwise}; "
            f"got {tuple(scale.shape)}"
        )


def _validate_fields(
    data: object, scale: object, orig_dtype: object, block: object, gemm: GemmConfig
) -> torch.Tensor:
    """Check every field of a Float8Tensor coming from outside the library (a checkpoint).

    The one validation of deserialized tensors (both checkpoint formats go through it):
    extend it here when the granularity grows. Returns the scale
    (invalid values turned into NaN where they cannot be read without a device sync).
    """
    if type(data) is not torch.Tensor:
        raise TypeError(f"Float8Tensor data must be a plain torch.Tensor; got {type(data).__name__}")
    check_float8_dtype(data.dtype, "Float8Tensor data dtype")
    _check_layout(data, "Float8Tensor data")
    if type(scale) is not torch.Tensor:
        raise TypeError(f"Float8Tensor scale must be a plain torch.Tensor; got {type(scale).__name__}")
    if scale.dtype not in SCALE_DTYPES:
        allowed = ", ".join(str(d) for d in SCALE_DTYPES)
        raise TypeError(f"Float8Tensor scale dtype must be one of {allowed}; got {scale.dtype}")
    _check_layout(scale, "Float8Tensor scale")
    if scale.device != data.device:
        raise ValueError(f"Float8Tensor scale is on {scale.device}, its data on {data.device}: they must share a device")
    check_hp_dtype(orig_dtype, "Float8Tensor orig_dtype")
    _check_block(block, data, scale)
    if not isinstance(gemm, GemmConfig):
        raise TypeError(f"Float8Tensor gemm must be a GemmConfig; got {type(gemm).__name__}")
    if gemm.out_dtype is not None and not isinstance(gemm.out_dtype, torch.dtype):
        raise TypeError(f"GemmConfig.out_dtype must be None or a torch.dtype; got {gemm.out_dtype!r}")
    gemm.validated()
    # A NaN scale is what a cast of a non-finite tensor legitimately produces (its data reads
    # back NaN); zero, negative, infinite or subnormal scales never are.
    return check_scale_values(scale, "Float8Tensor scale", allow_nan=True)


def _rebuild_float8_tensor(version: object, fields: object) -> Float8Tensor:
    """Unpickle a Float8Tensor (``torch.load``, with ``weights_only=True`` too; ``pickle``;
    ``copy.deepcopy``): every field is validated before the tensor exists."""
    if type(version) is not int or version not in (1, _SERIAL_VERSION):
        raise ValueError(
            f"Float8Tensor checkpoint format {version!r} is not supported (this f8tensor reads 1 and {_SERIAL_VERSION})"
        )
    names = _SERIAL_FIELDS if version == _SERIAL_VERSION else _SERIAL_FIELDS_V1
    if not isinstance(fields, dict) or set(fields) != names:
        got = sorted(map(str, fields)) if isinstance(fields, dict) else type(fields).__name__
        raise ValueError(f"Float8Tensor checkpoint (format {version}): fields must be exactly {sorted(names)}; got {got}")
    raw = fields["data"]
    if type(raw) is not torch.Tensor or raw.dtype != torch.uint8:
        what = raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"Float8Tensor checkpoint: 'data' must be a uint8 tensor (the FP8 bytes); got {what}")
    float8_dtype = check_float8_dtype(fields["float8_dtype"], "Float8Tensor checkpoint 'float8_dtype'")
    _check_layout(raw, "Float8Tensor data")
    data = raw.view(float8_dtype)
    gemm_fields = fields["gemm"]
    n_gemm = len(GemmConfig._fields) if version == _SERIAL_VERSION else _GEMM_FIELDS_V1
    if not isinstance(gemm_fields, tuple) or len(gemm_fields) != n_gemm:
        raise ValueError(f"Float8Tensor checkpoint: 'gemm' must be a tuple {GemmConfig._fields[:n_gemm]}; got {gemm_fields!r}")
    gemm = GemmConfig(*gemm_fields)
    for name in ("requires_grad", "is_param"):
        if not isinstance(fields[name], bool):
            raise TypeError(f"Float8Tensor checkpoint: {name!r} must be a bool; got {fields[name]!r}")
    if version == _SERIAL_VERSION:
        block, scale = fields["block"], _scale_from_codes(fields["scale"], fields["scale_dtype"])
    else:
        block, scale = _block_from_axiswise_dim(fields["axiswise_dim"], data), fields["scale"]
    scale = _validate_fields(data, scale, fields["orig_dtype"], block, gemm)
    out = Float8Tensor(data, scale, fields["orig_dtype"], block, gemm)
    if fields["is_param"]:
        return torch.nn.Parameter(out, requires_grad=fields["requires_grad"])
    return out.requires_grad_(fields["requires_grad"])


class _LegacyFloat8Tensor(Float8Tensor):
    """What ``weights_only=True`` loading knows as ``f8tensor.tensor.Float8Tensor``.

    Checkpoints written before :meth:`Float8Tensor.__reduce_ex__` name the class: they
    rebuild an empty wrapper of it and restore its attributes through ``__setstate__``,
    which validates them and turns the object into a Float8Tensor. Constructing the class
    directly (pickle's NEWOBJ), which would skip that validation, is refused.
    """

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any):  # type: ignore[override]
        raise TypeError("a Float8Tensor is loaded through its validating rebuild, never constructed from a checkpoint")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError("a Float8Tensor from a checkpoint was used before its fields were restored (a malformed checkpoint)")


def _check_given_scale(
    scale: torch.Tensor | float, hp: torch.Tensor, block: tuple[int, ...], tensorwise: bool, scale_dtype: torch.dtype
) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        # A number is an fp32 scale (range-checked in fp32); an MX granularity then refuses
        # it below, as it needs an e8m0 tensor.
        scale = scale_from_number(scale, "scale", hp.device)
    if scale.dtype != scale_dtype:
        want = "float32" if scale_dtype == torch.float32 else f"{scale_dtype} (MX granularity)"
        raise TypeError(f"scale must be {want}; got {scale.dtype}")
    if scale.device != hp.device:
        raise ValueError(f"scale is on {scale.device}, the tensor on {hp.device}: they must share a device")
    scale = check_scale_values(scale, "scale")
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

