"""The vocabulary of casts: granularities, the cast spec, the GEMM spec and the predicates
on a block. Every other module reads these words; this one decides nothing.

Granularity has one internal spelling, the per-dim block of a :class:`CastSpec`, with
``()`` for tensorwise (one scale for the whole tensor, a 0-dim scale, of any rank).
:func:`is_tensorwise`, :func:`axiswise_dim`, :func:`is_blockwise` and the other predicates
read it, here and nowhere else. A Float8Tensor keeps one block entry per dim of its data
(so that its layout ops move a dim's entry with the dim); :func:`layout_block` and
:func:`spec_block` are the two translations between that form and the spec's, and
:func:`axiswise_block` builds the block of the axiswise keyword spelling.

The user configs that build these (``CastConfig.operand_spec``) are in ``config``; the
named recipes in ``recipes``. :class:`GemmConfig` and :class:`CastSpec` travel as
Float8Tensor metadata and through casts and are therefore NamedTuples (see
:class:`GemmConfig`).
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
    """``cls(value)`` for the strings users type, with an error listing what is allowed."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"{what} must be one of {allowed}; got {value!r}") from None


class Granularity(str, enum.Enum):
    """How many scales a cast uses.

    ``TENSORWISE``: one scale for the whole tensor. ``ROWWISE``: one scale per row along
    the last dimension (for a weight ``(out, in)``: one per output feature). Internally a
    rowwise scale may also run along another axis (``axiswise_dim``), e.g. per column for
    the operands of the weight-gradient GEMM.
    """

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
    """A block-scaled granularity: which elements share one scale, and the scale's dtype.

    - ``block``: one entry per trailing dim of the tensor it is applied to; a tensor with
      more dims gets 1 on the leading ones (``(1, 128)`` on a ``(B, S, K)`` activation is
      ``(1, 1, 128)``: every row of every batch entry has its own tiles). An entry
      ``b > 0``: ``b`` consecutive elements along that dim share a scale (partial edge
      blocks allowed: ``ceil(size / b)`` scales); ``0``: the whole dim shares one.
    - ``scale_dtype``: ``torch.float32`` or ``torch.float8_e8m0fnu`` (MX: power-of-two scales).
    - ``scale_mode``: for e8m0 only, how the shared exponent is chosen: ``"rceil"`` (default:
      the smallest power of two that keeps the block's amax in range, never saturates) or
      ``"floor"`` (OCP MX spec v1.0: ``floor(log2(amax)) - emax_elem``; can saturate the top
      of a block by up to 2x).

    Public spellings: :data:`BLOCK_1x128`, :data:`BLOCK_128x128`, :data:`MX_1x32`,
    :data:`MX_1x32_FLOOR`, or a plain tuple such as ``(1, 128)`` (fp32 scales).
    A NamedTuple, not a dataclass, for the reason given at :class:`GemmConfig`.

    Raises:
        ValueError: when a cast or a config uses it (:meth:`validated`): a ``block`` that is
            not a non-empty tuple of ints in ``[0, 2**63)``, an unknown ``scale_dtype`` or
            ``scale_mode``, or a tensor with fewer dims than ``block`` has entries.

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
        if not isinstance(block, tuple) or not block or any(
            isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**63 for b in block
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
        """A short name, as ``Granularity.value`` is for the others: ``"1x128"``, ``"1x32 e8m0 rceil"``."""
        name = "x".join(str(b) for b in self.block)
        return f"{name} e8m0 {self.scale_mode}" if self.scale_dtype == E8M0 else name

    def full_block(self, ndim: int) -> tuple[int, ...]:
        """The per-dim block for a tensor with ``ndim`` dims (leading dims padded with 1)."""
        if ndim < len(self.block):
            raise ValueError(f"block {self.block} needs a tensor with at least {len(self.block)} dims; got {ndim}")
        return (1,) * (ndim - len(self.block)) + self.block


NVFP4_SCALE = torch.float8_e4m3fn

#: DeepSeek-V3 activation/gradient tiles: one fp32 scale per 128 consecutive elements of a row.
BLOCK_1x128 = BlockGranularity((1, 128))
#: DeepSeek-V3 weight blocks: one fp32 scale per 128x128 block.
BLOCK_128x128 = BlockGranularity((128, 128))
#: MXFP8: one e8m0 (power-of-two) scale per 32 consecutive elements of a row, RCEIL exponent.
MX_1x32 = BlockGranularity((1, 32), E8M0, "rceil")
#: MXFP8 with the OCP spec's floor rule for the shared exponent.
MX_1x32_FLOOR = BlockGranularity((1, 32), E8M0, "floor")


#: The dtype of an FP4 :class:`~f8tensor.quant.config.CastConfig` (``torch.float4_e2m1fn_x2``: packed E2M1); its
#: granularity says which FP4 format: :data:`NVFP4_1x16`, :data:`NVFP4_16x16` or :data:`MXFP4_1x32`.
FP4_CAST_DTYPE = FLOAT4_X2
#: NVFP4: E2M1 with one e4m3fn scale per 16 elements along K, plus an fp32 tensor scale.
NVFP4_1x16 = BlockGranularity((1, 16), NVFP4_SCALE)
#: NVFP4 with 2D 16x16 blocks (weights): both layouts of a weight quantize identically.
NVFP4_16x16 = BlockGranularity((16, 16), NVFP4_SCALE)
#: MXFP4 (OCP MX v1.0): E2M1 with one e8m0 scale per 32 elements along K (RCEIL exponent).
MXFP4_1x32 = BlockGranularity((1, 32), E8M0, "rceil")
FP4_BLOCKS = {NVFP4_SCALE: ((1, 16), (16, 16)), E8M0: ((1, 32),)}


#: The named granularities, by the string :func:`parse_granularity` takes for each:
#: :class:`Granularity`'s values and the names of the block constants above (the constants
#: themselves are taken too). A bad granularity's error lists these names.
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
        value: a name of :data:`GRANULARITY_NAMES` (``"tensorwise"``, ``"rowwise"``,
            ``"MX_1x32"``, ...), a :class:`Granularity`, a :class:`BlockGranularity` (such as
            :data:`BLOCK_1x128`) or a block tuple such as ``(1, 128)`` (fp32 scales).

    Raises:
        TypeError: a block shape given as a list.
        ValueError: anything else (the message lists every accepted form), or an invalid block.
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
    """The scale's shape for data of ``shape`` and a per-dim ``block``: 1 where the block
    is 0 (the whole dim), ``ceil(size / b)`` elsewhere."""
    return tuple(1 if b == 0 else -(-s // b) for s, b in zip(shape, block))


def axiswise_block(axiswise_dim: int, ndim: int) -> tuple[int, ...]:
    """The block of the axiswise spelling: axiswise ``d`` -> 0 at ``d`` (the amax runs along
    it), 1 elsewhere (one scale per index). (Tensorwise is ``()``, not an axis.)"""
    d = axiswise_dim % ndim
    return tuple(0 if i == d else 1 for i in range(ndim))


# ----------------------------------------------------------------------- the cast spec


class CastSpec(NamedTuple):
    """One cast to FP8, as data: every cast in f8tensor is given one (casts of a Float8Linear
    operand, of an expert weight, of a plain GEMM operand, re-casts for a kernel).

    - ``float8_dtype``: one of the four FP8 dtypes.
    - ``block``: which elements share one scale, one entry per dim of the tensor cast:
      ``b > 0``: ``b`` consecutive elements along that dim (a partial last block allowed);
      ``0``: the whole dim. ``()``: one scale for the whole tensor, of any rank (tensorwise:
      a 0-dim scale). Otherwise the scale has one dim per entry, ``ceil(size / b)`` long (1
      for 0). Rowwise is 0 on the dim the GEMM contracts and 1 elsewhere: ``(1, 0)`` for an
      ``(M, K)`` input; 1x128 tiles ``(1, 128)``; DeepSeek weights ``(128, 128)``.
    - ``scale_dtype``: ``torch.float32`` or ``torch.float8_e8m0fnu`` (MX: powers of two).
    - ``scale_mode``: the e8m0 exponent rule, ``"rceil"`` or ``"floor"`` (see
      :class:`BlockGranularity`).
    - ``power_of_2``: round a computed fp32 scale down to a power of two.
    - ``rounding``: ``"nearest"`` or ``"stochastic"``.

    A NamedTuple for the reason given at :class:`GemmConfig`. Library code builds it from
    validated configs (:meth:`~f8tensor.quant.config.CastConfig.operand_spec`) or from a Float8Tensor's own fields;
    the public entry points (``Float8Tensor.from_hp``) validate what users pass.
    """

    float8_dtype: torch.dtype
    block: tuple[int, ...] = ()
    scale_dtype: torch.dtype = torch.float32
    scale_mode: str = "rceil"
    power_of_2: bool = False
    rounding: str = "nearest"


# The predicates on a block, in the spelling of CastSpec.block: ``()`` is tensorwise (a
# 0-dim scale); a Float8Tensor's is ``Float8Tensor._scale_block``.


def is_tensorwise(block: tuple[int, ...]) -> bool:
    """One scale for the whole tensor (a 0-dim scale)."""
    return not block


def axiswise_dim(block: tuple[int, ...]) -> int | None:
    """The dim an axiswise block shares its scales along: the one 0 of a block that is 1
    elsewhere (one scale per index of the other dims), or the last dim of an all-0 block
    (one scale, kept with the tensor's rank). ``None`` for tensorwise and for true blocks."""
    if not block:
        return None
    zeros = [d for d, b in enumerate(block) if b == 0]
    if len(zeros) == len(block):
        return len(block) - 1
    if len(zeros) == 1 and all(b in (0, 1) for b in block):
        return zeros[0]
    return None


def is_axiswise(block: tuple[int, ...], dim: int | None = None) -> bool:
    """An axiswise block (see :func:`axiswise_dim`), along ``dim`` if given."""
    axis = axiswise_dim(block)
    return axis is not None and (dim is None or axis == dim % len(block))


def is_blockwise(block: tuple[int, ...]) -> bool:
    """A true block (1x128, 128x128, MX, ...): neither tensorwise nor axiswise."""
    return bool(block) and axiswise_dim(block) is None


def varies_along(block: tuple[int, ...], dim: int) -> bool:
    """Whether the scale takes more than one value along ``dim`` (block entry > 0)."""
    return bool(block) and block[dim] != 0


def constant_along(block: tuple[int, ...], dim: int) -> bool:
    """One scale for the whole of ``dim`` per index of the other dims (tensorwise, or every
    entry 0 or 1 with 0 at ``dim``): the scales the dense and grouped kernels read along K."""
    return not block or (block[dim] == 0 and all(b in (0, 1) for b in block))



def layout_block(block: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """A spec's block as a Float8Tensor of ``ndim`` dims stores it: one entry per dim, so
    tensorwise ``()`` becomes all 0 (the 0-dim scale still says tensorwise)."""
    return block or (0,) * ndim


def spec_block(block: tuple[int, ...], scale_ndim: int) -> tuple[int, ...]:
    """A Float8Tensor's stored block in the spec's spelling: ``()`` when its scale is 0-dim
    (tensorwise), else the block itself. The inverse of :func:`layout_block`."""
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
    """The :class:`CastSpec` of the keyword spellings, for a tensor of ``ndim`` dims:
    ``block`` (a full per-dim block), or ``axiswise_dim`` (``None`` with no block: tensorwise)."""
    if block is None:
        block = () if axiswise_dim is None else axiswise_block(axiswise_dim, ndim)
    return CastSpec(float8_dtype, block, scale_dtype, scale_mode, power_of_2_scale, rounding)


def check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool; got {value!r}")


class GemmConfig(NamedTuple):
    """How one FP8 matrix product runs; carried by each Float8Tensor operand.

    - ``out_dtype``: dtype of the product. ``None`` means the first operand's
      high-precision dtype (``x`` in ``x @ w8.t()``). Any of bf16, fp16, fp32 is written
      straight from the fp32 accumulator: there is no FP8 round trip before, say, a
      residual add. For an FP8 output with a known scale use :func:`f8tensor.float8_mm`.
    - ``use_fast_accum``: Hopper's faster, less precise FP8 accumulation (ignored on CPU).
    - ``pad_inner_dim``: zero-pad K and N up to multiples of 16 (what ``torch._scaled_mm``
      requires) instead of raising.
    - ``emulate``: compute block-scaled products (1x128, 128x128, MX, FP4) with the
      reference path (dequantize per block in fp32, fp32 matmul) instead of the
      ``torch.nn.functional.scaled_mm`` kernels, e.g. on a GPU or build without them. A
      device with no such kernel (every CPU) runs the reference path either way; with
      ``emulate=False`` it warns once per process and kind of product (a ``UserWarning``
      saying the products are emulated), with ``emulate=True`` it is silent.

    An immutable NamedTuple rather than a dataclass: it is Float8Tensor metadata, and
    torch.compile reads and builds it on tensors created inside the graph, where dynamo
    handles plain named tuples (on every supported torch version) but neither dataclasses
    nor tuples with a custom ``__new__``. So it is checked where it enters the public
    API (:meth:`validated`). Derive variants with ``cfg._replace(...)``.

    Raises:
        ValueError: from :meth:`validated`, which the entry points call: an ``out_dtype``
            the FP8 kernels cannot write (the message lists the allowed ones).
    """

    out_dtype: torch.dtype | None = None
    use_fast_accum: bool = False
    pad_inner_dim: bool = False
    emulate: bool = False

    def validated(self) -> GemmConfig:
        """Return ``self`` if every field is allowed, else raise saying what is."""
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
