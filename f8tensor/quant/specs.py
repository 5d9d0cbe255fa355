"""The vocabulary of casts: granularities, cast and GEMM specs, predicates on a block.

Granularity's one internal spelling is a :class:`CastSpec`'s per-dim block (``()``: tensorwise).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch

from f8tensor.quant.formats import E8M0, FLOAT4_X2, FLOAT8_DTYPES, HP_DTYPES, SCALE_DTYPES

__all__ = [
    "DEFAULT_GEMM",
    "E8M0_SCALE_MODES",
    "FP4_CAST_DTYPE",
    "GRANULARITY_NAMES",
    "HISTORY_REDUCTIONS",
    "ROUNDING_MODES",
    "BLOCK_1x128",
    "BLOCK_128x128",
    "BlockGranularity",
    "CastSpec",
    "GemmConfig",
    "Granularity",
    "MXFP4_1x32",
    "MX_1x32",
    "MX_1x32_FLOOR",
    "NVFP4_1x16",
    "NVFP4_16x16",
    "axiswise_block",
    "axiswise_dim",
    "block_scale_shape",
    "constant_along",
    "is_axiswise",
    "is_blockwise",
    "is_tensorwise",
    "keyword_spec",
    "layout_block",
    "parse_enum",
    "parse_granularity",
    "spec_block",
    "varies_along",
]


def parse_enum(cls: type[enum.Enum], value: object, what: str) -> Any:
    """``cls(value)`` for the strings users type; the ValueError lists what is allowed."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"{what} must be one of {allowed}; got {value!r}") from None


class Granularity(str, enum.Enum):
    """How many scales a cast uses: one per tensor, or one per row along the last dim."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"

    @classmethod
    def parse(cls, value: object) -> Granularity:
        return parse_enum(cls, value, "granularity")


E8M0_SCALE_MODES = ("rceil", "floor")
ROUNDING_MODES = ("nearest", "stochastic")
#: How delayed scaling reduces its amax history to one amax.
HISTORY_REDUCTIONS = ("max", "most_recent")


class BlockGranularity(NamedTuple):
    """Block scaling: ``block`` elements share one ``scale_dtype`` scale (0: the whole dim).

    ``scale_mode``: the e8m0 exponent rule, ``"rceil"`` or ``"floor"`` (OCP MX).

    Example:
        >>> from f8tensor import BlockGranularity, Float8Tensor
        >>> g = BlockGranularity((1, 32), torch.float8_e8m0fnu)
        >>> Float8Tensor.from_hp(torch.randn(4, 64), granularity=g)._scale.shape
        torch.Size([4, 2])
    """

    block: tuple[int, ...]
    scale_dtype: torch.dtype = torch.float32
    scale_mode: str = "rceil"

    def validated(self) -> BlockGranularity:
        block = self.block
        if (
            not isinstance(block, tuple)
            or not block
            or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**63 for b in block)
        ):
            raise ValueError(
                f"a block shape is a non-empty tuple of ints in [0, 2**63) (0: the whole dim; an entry "
                f"larger than its dim is one partial block); got {block!r}"
            )
        if self.scale_dtype not in SCALE_DTYPES + (NVFP4_SCALE,):
            raise ValueError(
                f"BlockGranularity.scale_dtype must be one of {SCALE_DTYPES} (or float8_e4m3fn for NVFP4 "
                f"blocks); got {self.scale_dtype!r}"
            )
        if self.scale_mode not in E8M0_SCALE_MODES:
            raise ValueError(f"BlockGranularity.scale_mode must be one of {E8M0_SCALE_MODES}; got {self.scale_mode!r}")
        return self

    @property
    def value(self) -> str:
        """A short name: ``"1x128"``, ``"1x32 e8m0 rceil"``."""
        name = "x".join(str(b) for b in self.block)
        return f"{name} e8m0 {self.scale_mode}" if self.scale_dtype == E8M0 else name

    def full_block(self, ndim: int) -> tuple[int, ...]:
        """The per-dim block for ``ndim`` dims (leading dims 1)."""
        if ndim < len(self.block):
            raise ValueError(f"block {self.block} needs a tensor with at least {len(self.block)} dims; got {ndim}")
        return (1,) * (ndim - len(self.block)) + self.block


NVFP4_SCALE = torch.float8_e4m3fn

#: DeepSeek-V3 activation tiles: one fp32 scale per 128 elements of a row.
BLOCK_1x128 = BlockGranularity((1, 128))
#: DeepSeek-V3 weight blocks: one fp32 scale per 128x128 block.
BLOCK_128x128 = BlockGranularity((128, 128))
#: MXFP8: one e8m0 scale per 32 elements of a row.
MX_1x32 = BlockGranularity((1, 32), E8M0, "rceil")
#: MXFP8 with the OCP spec's floor rule for the shared exponent.
MX_1x32_FLOOR = BlockGranularity((1, 32), E8M0, "floor")


#: The dtype of an FP4 cast (packed E2M1); the granularity names the FP4 format.
FP4_CAST_DTYPE = FLOAT4_X2
#: NVFP4: E2M1, one e4m3fn scale per 16 elements along K, plus a tensor scale.
NVFP4_1x16 = BlockGranularity((1, 16), NVFP4_SCALE)
#: NVFP4 with 16x16 blocks (weights).
NVFP4_16x16 = BlockGranularity((16, 16), NVFP4_SCALE)
#: MXFP4: E2M1 with one e8m0 scale per 32 elements along K.
MXFP4_1x32 = BlockGranularity((1, 32), E8M0, "rceil")
FP4_BLOCKS = {NVFP4_SCALE: ((1, 16), (16, 16)), E8M0: ((1, 32),)}


#: The named granularities, by the string :func:`parse_granularity` takes.
GRANULARITY_NAMES: dict[str, Granularity | BlockGranularity] = {
    **{g.value: g for g in Granularity},
    "BLOCK_1x128": BLOCK_1x128,
    "BLOCK_128x128": BLOCK_128x128,
    "MX_1x32": MX_1x32,
    "MX_1x32_FLOOR": MX_1x32_FLOOR,
    "NVFP4_1x16": NVFP4_1x16,
    "NVFP4_16x16": NVFP4_16x16,
    "MXFP4_1x32": MXFP4_1x32,
}


def parse_granularity(value: object) -> Granularity | BlockGranularity:
    """A granularity -> the canonical object.

    Args:
        value: a name of :data:`GRANULARITY_NAMES`, a :class:`Granularity`, a :class:`BlockGranularity` or a block tuple.
    Raises:
        TypeError: a block shape given as a list.
        ValueError: anything else (the message lists the accepted forms), or an invalid block.
    """
    if isinstance(value, Granularity):
        return value
    if isinstance(value, BlockGranularity):
        return value.validated()
    if isinstance(value, tuple):
        return BlockGranularity(tuple(value)).validated()
    if isinstance(value, list):
        raise TypeError(f"a block shape is a tuple, not a list; got {value!r}")
    if isinstance(value, str) and value in GRANULARITY_NAMES:
        return GRANULARITY_NAMES[value]
    names = ", ".join(repr(name) for name in GRANULARITY_NAMES)
    raise ValueError(
        f"granularity must be one of {names} (a name, or the f8tensor constant of that name), a "
        f"BlockGranularity, or a block tuple such as (1, 128); got {value!r}"
    )


def block_scale_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape for data of ``shape``: ``ceil(size / b)`` per dim, 1 for block 0."""
    return tuple(1 if b == 0 else -(-s // b) for s, b in zip(shape, block))


def axiswise_block(axiswise_dim: int, ndim: int) -> tuple[int, ...]:
    """The block of axiswise ``d``: 0 at ``d``, 1 elsewhere."""
    d = axiswise_dim % ndim
    return tuple(0 if i == d else 1 for i in range(ndim))


class CastSpec(NamedTuple):
    """One cast to FP8, as data: format, per-dim block (``()``: tensorwise), scale dtype and rules."""

    float8_dtype: torch.dtype
    block: tuple[int, ...] = ()
    scale_dtype: torch.dtype = torch.float32
    scale_mode: str = "rceil"
    power_of_2: bool = False
    rounding: str = "nearest"


def is_tensorwise(block: tuple[int, ...]) -> bool:
    """One scale for the whole tensor (a 0-dim scale)."""
    return not block


def axiswise_dim(block: tuple[int, ...]) -> int | None:
    """The dim an axiswise block shares its scales along; ``None`` for tensorwise and true blocks."""
    if not block:
        return None
    zeros = block.count(0)
    if zeros == len(block):
        return len(block) - 1
    if zeros == 1 and block.count(1) == len(block) - 1:
        return block.index(0)
    return None


def is_axiswise(block: tuple[int, ...], dim: int | None = None) -> bool:
    """An axiswise block, along ``dim`` if given."""
    axis = axiswise_dim(block)
    return axis is not None and (dim is None or axis == dim % len(block))


def is_blockwise(block: tuple[int, ...]) -> bool:
    """A true block: neither tensorwise nor axiswise."""
    return bool(block) and axiswise_dim(block) is None


def varies_along(block: tuple[int, ...], dim: int) -> bool:
    """Whether the scale takes more than one value along ``dim``."""
    return bool(block) and block[dim] != 0


def constant_along(block: tuple[int, ...], dim: int) -> bool:
    """One scale for the whole of ``dim`` per index of the other dims."""
    return not block or (block[dim] == 0 and block.count(0) + block.count(1) == len(block))


def layout_block(block: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """A spec's block as a Float8Tensor of ``ndim`` dims stores it (tensorwise: all 0)."""
    return block or (0,) * ndim


def spec_block(block: tuple[int, ...], scale_ndim: int) -> tuple[int, ...]:
    """The inverse of :func:`layout_block`: ``()`` when the scale is 0-dim."""
    return block if scale_ndim else ()


def keyword_spec(
    ndim: int,
    float8_dtype: torch.dtype,
    axiswise_dim: int | None,
    block: tuple[int, ...] | None,
    power_of_2_scale: bool,
    scale_dtype: torch.dtype,
    scale_mode: str,
    rounding: str,
) -> CastSpec:
    """The :class:`CastSpec` of the keyword spellings (``block`` or ``axiswise_dim``)."""
    if block is None:
        block = () if axiswise_dim is None else axiswise_block(axiswise_dim, ndim)
    return CastSpec(float8_dtype, block, scale_dtype, scale_mode, power_of_2_scale, rounding)


def check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool; got {value!r}")


class GemmConfig(NamedTuple):
    """How one FP8 matrix product runs; carried by each Float8Tensor operand.

    ``out_dtype`` (``None``: the first operand's), ``use_fast_accum``, ``pad_inner_dim`` (K, N to
    multiples of 16), ``emulate`` (the fp32 reference for block-scaled products, silently). A
    NamedTuple because dynamo builds it inside graphs; checked by :meth:`validated`.
    """

    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False
    pad_inner_dim: bool = False
    emulate: bool = False

    def validated(self) -> GemmConfig:
        """``self``, or ValueError naming the bad field and what is allowed."""
        if self.out_dtype is not None and self.out_dtype not in HP_DTYPES:
            hint = (
                " (for an FP8 output pass out_dtype and out_scale to f8tensor.float8_mm)"
                if self.out_dtype in FLOAT8_DTYPES
                else ""
            )
            allowed = ", ".join(str(d) for d in HP_DTYPES)
            raise ValueError(f"GemmConfig.out_dtype must be None or one of {allowed}; got {self.out_dtype!r}{hint}")
        check_bool("GemmConfig", "use_fast_accum", self.use_fast_accum)
        check_bool("GemmConfig", "pad_inner_dim", self.pad_inner_dim)
        check_bool("GemmConfig", "emulate", self.emulate)
        return self


DEFAULT_GEMM = GemmConfig()
