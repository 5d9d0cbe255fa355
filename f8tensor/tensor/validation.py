"""Validation of Float8Tensor fields that come from outside the library: checkpoints,
given scales, scale values. No Float8Tensor is needed to check its fields.
"""

from __future__ import annotations

import torch

from f8tensor.compat import is_fake
from f8tensor.quant.formats import E8M0, SCALE_DTYPES, check_float8_dtype, check_hp_dtype
from f8tensor.quant.specs import (
    DEFAULT_GEMM,
    ROUNDING_MODES,
    BlockGranularity,
    CastSpec,
    GemmConfig,
    Granularity,
    axiswise_block,
    axiswise_dim,
    block_scale_shape,
    parse_granularity,
)

__all__ = [
    "LEGACY_TAG",
    "RETIRED_FORMAT",
    "SERIAL_VERSION",
    "check_block",
    "check_given_scale",
    "check_layout",
    "check_scale_values",
    "check_unused_cast_args",
    "checkpoint_fields",
    "compact",
    "extent",
    "from_hp_spec",
    "no_overlap",
    "scale_from_codes",
    "scale_from_number",
    "serial_fields",
    "validate_fields",
]

# Version 2 stores the per-dim block, the scale's dtype (an e8m0 scale as uint8 codes) and
# every GemmConfig field. Formats 0 and 1 were written only before the first release.
SERIAL_VERSION = 2
#: The git tag of the last f8tensor that reads formats 0 and 1 (load there, save again).
LEGACY_TAG = "legacy-checkpoints"
RETIRED_FORMAT = (
    "this Float8Tensor checkpoint was written in a pre-release format (0 or 1) that this f8tensor "
    f"no longer reads; load it with the f8tensor of git tag {LEGACY_TAG!r} and save it again"
)
_SERIAL_FIELDS = frozenset(
    {"data", "float8_dtype", "scale", "scale_dtype", "orig_dtype", "block", "gemm", "requires_grad", "is_param"}
)

# A scale must be a normal fp32 number: its inverse (the dequantization factor) is then
# finite too. 2**-126 ~ 1.18e-38 up to the fp32 max ~ 3.4e38.
_SCALE_MIN = torch.finfo(torch.float32).tiny
_SCALE_MAX = torch.finfo(torch.float32).max


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
    if is_fake(scale):
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


#: The largest block entry: a tensor size (int64). Larger ones are one partial block anyway.
_MAX_BLOCK = 2**63 - 1


def extent(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to one past the last one a layout touches (0 when empty)."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(size, stride))


def no_overlap(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether no two indices of the layout share an element (no zero or overlapping strides)."""
    if any(n == 0 for n in size):
        return True
    span = 1
    for st, n in sorted((st, n) for n, st in zip(size, stride) if n > 1):
        if st < span:
            return False
        span += (n - 1) * st
    return True


def check_layout(t: torch.Tensor, what: str) -> None:
    """Every element of ``t`` has its own bytes in its real storage.

    A zero or overlapping stride would let a 2 KB checkpoint stand for a 16 GiB tensor that
    the first matmul or ``to_hp`` materializes; a view past its storage reads foreign memory.
    """
    if t.layout is not torch.strided:
        raise ValueError(f"{what} must be a strided (dense) tensor; got layout {t.layout}")
    size, stride = tuple(t.shape), t.stride()
    if any(st < 0 for st in stride) or not no_overlap(size, stride):
        raise ValueError(
            f"{what} must not repeat elements through zero or overlapping strides; got shape {size}, strides {stride}"
        )
    if t.device.type == "meta":
        return
    end = (t.storage_offset() + extent(size, stride)) * t.element_size()
    if end > t.untyped_storage().nbytes():
        raise ValueError(f"{what} reaches byte {end} of a storage of {t.untyped_storage().nbytes()} bytes")


def scale_from_codes(scale: object, scale_dtype: object) -> object:
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


def check_block(block: object, data: torch.Tensor, scale: torch.Tensor) -> None:
    """The block against the data and the scale (see the :class:`Float8Tensor` table).

    A tuple of ints >= 0, one per dim of the data. Tensorwise (all 0, 0-dim scale) takes an
    fp32 scale; any other block a scale of :func:`block_scale_shape`, fp32 or e8m0 (the
    rules of :class:`BlockGranularity`, which pairs e8m0 with any block).
    """
    if type(block) is not tuple or any(type(b) is not int for b in block):
        raise TypeError(f"Float8Tensor block must be a tuple of ints >= 0 (0: the whole dim); got {block!r}")
    if any(b < 0 or b > _MAX_BLOCK for b in block):
        raise ValueError(
            f"Float8Tensor block entries must be in [0, 2**63) (0: the whole dim; an entry larger than "
            f"its dim is one partial block); got {block!r}"
        )
    if len(block) != data.dim():
        raise ValueError(f"Float8Tensor block {block} must have one entry per dim of data of shape {tuple(data.shape)}")
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


def validate_fields(data: object, scale: object, orig_dtype: object, block: object, gemm: GemmConfig) -> torch.Tensor:
    """Check every field of a Float8Tensor coming from outside the library (a checkpoint).

    The one validation of deserialized tensors (both checkpoint formats go through it):
    extend it here when the granularity grows. Returns the scale
    (invalid values turned into NaN where they cannot be read without a device sync).
    """
    if type(data) is not torch.Tensor:
        raise TypeError(f"Float8Tensor data must be a plain torch.Tensor; got {type(data).__name__}")
    check_float8_dtype(data.dtype, "Float8Tensor data dtype")
    check_layout(data, "Float8Tensor data")
    if type(scale) is not torch.Tensor:
        raise TypeError(f"Float8Tensor scale must be a plain torch.Tensor; got {type(scale).__name__}")
    if scale.dtype not in SCALE_DTYPES:
        allowed = ", ".join(str(d) for d in SCALE_DTYPES)
        raise TypeError(f"Float8Tensor scale dtype must be one of {allowed}; got {scale.dtype}")
    check_layout(scale, "Float8Tensor scale")
    if scale.device != data.device:
        raise ValueError(
            f"Float8Tensor scale is on {scale.device}, its data on {data.device}: they must share a device"
        )
    check_hp_dtype(orig_dtype, "Float8Tensor orig_dtype")
    check_block(block, data, scale)
    if not isinstance(gemm, GemmConfig):
        raise TypeError(f"Float8Tensor gemm must be a GemmConfig; got {type(gemm).__name__}")
    if gemm.out_dtype is not None and not isinstance(gemm.out_dtype, torch.dtype):
        raise TypeError(f"GemmConfig.out_dtype must be None or a torch.dtype; got {gemm.out_dtype!r}")
    gemm.validated()
    # A NaN scale is what a cast of a non-finite tensor legitimately produces (its data reads
    # back NaN); zero, negative, infinite or subnormal scales never are.
    return check_scale_values(scale, "Float8Tensor scale", allow_nan=True)


def check_given_scale(
    scale: torch.Tensor | float, hp: torch.Tensor, block: tuple[int, ...], scale_dtype: torch.dtype
) -> torch.Tensor:
    """A scale given to ``Float8Tensor.from_hp`` for ``hp`` cast with ``block`` (a
    :class:`~f8tensor.quant.config.CastSpec` block: ``()`` tensorwise) and ``scale_dtype``.
    Returns it as the cast takes it (a tensorwise scale 0-dim)."""
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
    if not block:
        if scale.numel() != 1:
            raise ValueError(f"a tensorwise scale has one element; got shape {tuple(scale.shape)}")
        return _own_copy(scale.reshape(()))
    expected = block_scale_shape(tuple(hp.shape), block)
    if tuple(scale.shape) != expected:
        kind = "rowwise" if axiswise_dim(block) == len(block) - 1 else f"block {block}"
        raise ValueError(
            f"a {kind} scale for shape {tuple(hp.shape)} must have shape {expected}; got {tuple(scale.shape)}"
        )
    return _own_copy(scale)


def _own_copy(scale: torch.Tensor) -> torch.Tensor:
    """A cast is a value: the tensor keeps its own dense copy of a given scale, so an in-place
    update of the caller's tensor (or of the base it is a view of) changes nothing, and an
    expanded scale is stored (and saved) one entry per block, not as a zero-stride view."""
    return scale.clone(memory_format=torch.contiguous_format)


def checkpoint_fields(version: object, fields: object) -> tuple:
    """The fields of a pickled Float8Tensor (format :data:`SERIAL_VERSION`), every one checked:
    ``(data, scale, orig_dtype, block, gemm, requires_grad, is_param)``.

    Raises:
        ValueError: another format (format 1 names :data:`LEGACY_TAG`), or a bad field.
    """
    if type(version) is int and version == 1:
        raise ValueError(RETIRED_FORMAT)
    if type(version) is not int or version != SERIAL_VERSION:
        raise ValueError(
            f"Float8Tensor checkpoint format {version!r} is not supported (this f8tensor reads {SERIAL_VERSION})"
        )
    names = _SERIAL_FIELDS
    if not isinstance(fields, dict) or set(fields) != names:
        got = sorted(map(str, fields)) if isinstance(fields, dict) else type(fields).__name__
        raise ValueError(
            f"Float8Tensor checkpoint (format {version}): fields must be exactly {sorted(names)}; got {got}"
        )
    raw = fields["data"]
    if type(raw) is not torch.Tensor or raw.dtype != torch.uint8:
        what = raw.dtype if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"Float8Tensor checkpoint: 'data' must be a uint8 tensor (the FP8 bytes); got {what}")
    float8_dtype = check_float8_dtype(fields["float8_dtype"], "Float8Tensor checkpoint 'float8_dtype'")
    check_layout(raw, "Float8Tensor data")
    data = raw.view(float8_dtype)
    gemm_fields = fields["gemm"]
    if not isinstance(gemm_fields, tuple) or len(gemm_fields) != len(GemmConfig._fields):
        raise ValueError(f"Float8Tensor checkpoint: 'gemm' must be a tuple {GemmConfig._fields}; got {gemm_fields!r}")
    gemm = GemmConfig(*gemm_fields)
    for name in ("requires_grad", "is_param"):
        if not isinstance(fields[name], bool):
            raise TypeError(f"Float8Tensor checkpoint: {name!r} must be a bool; got {fields[name]!r}")
    block, scale = fields["block"], scale_from_codes(fields["scale"], fields["scale_dtype"])
    scale = validate_fields(data, scale, fields["orig_dtype"], block, gemm)
    return data, scale, fields["orig_dtype"], block, gemm, fields["requires_grad"], fields["is_param"]


# ===================================================================== what users pass


def check_unused_cast_args(rounds_given_scale: bool, rounding: object, generator: object) -> None:
    """Refuse cast arguments that would do nothing.

    Raises:
        TypeError: a bad ``generator``.
        ValueError: ``rounds_given_scale``, or a generator without stochastic rounding.
    """
    if rounds_given_scale:
        raise ValueError(
            "power_of_2_scale rounds a computed scale; a given scale is used as is: round it yourself "
            "(torch.exp2(torch.floor(torch.log2(scale)))) or leave power_of_2_scale False"
        )
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
    if rounding != "stochastic":
        raise ValueError(
            f"generator draws stochastic rounding's noise; with rounding={rounding!r} it has no effect: "
            f"pass rounding='stochastic' or no generator"
        )


def from_hp_spec(
    hp: torch.Tensor,
    float8_dtype: torch.dtype,
    granularity: object,
    power_of_2_scale: object,
    rounding: object,
    gemm_config: object,
) -> tuple[CastSpec, GemmConfig]:
    """The arguments of ``Float8Tensor.from_hp`` (``hp`` a tensor) checked, in that order, and
    turned into the cast's :class:`CastSpec` and the tensor's :class:`GemmConfig`."""
    check_hp_dtype(hp.dtype, "Float8Tensor.from_hp input")
    check_float8_dtype(float8_dtype)
    if not isinstance(power_of_2_scale, bool):
        raise TypeError(f"power_of_2_scale must be a bool; got {power_of_2_scale!r}")
    gran = parse_granularity(granularity)
    if gran is Granularity.ROWWISE and hp.dim() == 0:
        raise ValueError("rowwise scaling needs at least one dimension; got a 0-dim tensor")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}; got {rounding!r}")
    if isinstance(gran, BlockGranularity) and gran.scale_dtype not in SCALE_DTYPES:
        raise ValueError(
            f"a Float8Tensor's block scales are fp32 or e8m0; {gran.scale_dtype} block scales are NVFP4's "
            f"(f8tensor.Float4Tensor.from_hp(hp, 'nvfp4'))"
        )
    if isinstance(gran, BlockGranularity):
        spec = CastSpec(float8_dtype, gran.full_block(hp.dim()), gran.scale_dtype, gran.scale_mode)
    else:
        spec = CastSpec(float8_dtype, axiswise_block(hp.dim() - 1, hp.dim()) if gran is Granularity.ROWWISE else ())
    spec = spec._replace(power_of_2=power_of_2_scale, rounding=rounding)
    if gemm_config is None:
        gemm_config = DEFAULT_GEMM
    elif not isinstance(gemm_config, GemmConfig):
        raise TypeError(f"gemm_config must be a GemmConfig; got {type(gemm_config).__name__}")
    else:
        gemm_config.validated()
    return spec, gemm_config


# ===================================================================== the checkpoint format (written)


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a checkpoint stores it: exactly its own elements, each once. A view that
    does not own its whole storage (a slice: pickling would write the base's storage) or
    that repeats elements (an ``expand``: the checkpoint check refuses zero strides) is
    copied out, dense; a tensor that owns its storage keeps its strides."""
    size, stride = tuple(t.shape), t.stride()
    own = t.storage_offset() == 0 and t.untyped_storage().nbytes() == extent(size, stride) * t.element_size()
    if own and no_overlap(size, stride):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def serial_fields(
    data: torch.Tensor,
    scale: torch.Tensor,
    orig_dtype: torch.dtype,
    block: tuple[int, ...],
    gemm: GemmConfig,
    requires_grad: bool,
    is_param: bool,
) -> dict[str, object]:
    """A Float8Tensor's fields as version :data:`SERIAL_VERSION` writes them (what
    :func:`checkpoint_fields` reads back)."""
    scale_out = scale.view(torch.uint8) if scale.dtype == E8M0 else scale
    return {
        "data": compact(data.view(torch.uint8)),
        "float8_dtype": data.dtype,
        # e8m0 scales travel as their uint8 codes: torch storages of that dtype do not
        # survive a plain pickle (torch 2.13), uint8 does everywhere.
        "scale": compact(scale_out),
        "scale_dtype": scale.dtype,
        "orig_dtype": orig_dtype,
        "block": block,
        "gemm": tuple(gemm),
        "requires_grad": requires_grad,
        "is_param": is_param,
    }
