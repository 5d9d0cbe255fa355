"""The FP4 casts: E2M1 elements with NVFP4 or MXFP4 block scales, packed two per byte.

Written from two descriptions, in this package's own terms:

- **E2M1** (OCP Microscaling spec v1.0, section 5.3.3): 1 sign, 2 exponent, 1 mantissa
  bit, exponent bias 1, no infinity, no NaN. The 8 magnitudes are
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (codes 0..7; code 1 is the one subnormal); bit 3 is the
  sign, so ``-0`` exists (code 8).
- **MXFP4** (the same spec, sections 5 and 6.3): one e8m0 scale ``X = 2**e`` per 32
  consecutive elements along the contraction dim; ``x ~= e2m1 * X``. ``e`` follows the
  spec's rule ``floor(log2(amax)) - emax_elem`` (``emax_elem = 2``: ``"floor"``, which can
  clip the top of a block from 6 up to just under 8) or the smallest power of two that
  keeps ``amax / X <= 6`` (``"rceil"``, the default: nothing saturates).
- **NVFP4** (NVIDIA's description of the Blackwell format): one ``float8_e4m3fn`` scale per
  16 consecutive elements plus one fp32 scale per tensor, so that the block scales use
  e4m3's range: ``g = amax_tensor / (448 * 6)``, block scale ``s = e4m3(amax_block / 6 / g)``
  (round to nearest), ``x ~= e2m1 * s * g``. ``four_over_six``: each block is also encoded
  with 4 as its largest value (``s = e4m3(amax_block / 4 / g)``), and the encoding with
  the lower squared error is kept.

Scales here are **decode** factors (``x ~= e2m1 * block_scale * global_scale``), as the
specs and the sm100 kernels spell them; FP8 casts store the reciprocal (see ``reference.py``).

Elements are rounded to nearest, ties to even (the rule the specs give for conversions),
or stochastically (round up with probability equal to the distance from the lower
neighbour in units of the spacing: unbiased). Values beyond 6 saturate to 6. A block with
an infinity or NaN gets a NaN scale (e4m3fn 0x7F, e8m0 0xFF), so it dequantizes to NaN,
never to finite garbage; NVFP4's tensor amax is taken over the finite values, so the other
blocks keep their scales. A block whose NVFP4 scale rounds to zero (its amax more than
``2**9 * 448`` times below the tensor's) is flushed to zeros. Dequantizing saturates to the
target dtype's finite range (a finite value near the dtype's max can round up past it).

Packing (what ``torch.float4_e2m1fn_x2`` and PyTorch's FP4 kernels read): along one dim,
element ``2i`` in the low nibble and ``2i + 1`` in the high nibble of byte ``i``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from f8tensor.quant.formats import E8M0, FLOAT4_X2

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP4_STATS_FIELDS",
    "MXFP4",
    "NVFP4",
    "FP4Spec",
    "cast_fp4",
    "dequantize_fp4",
    "e2m1_decode",
    "e2m1_encode",
    "pack_e2m1",
    "unpack_e2m1",
]

#: The kinds of FP4 cast.
NVFP4 = "nvfp4"
MXFP4 = "mxfp4"
#: The largest E2M1 magnitude.
E2M1_MAX = 6.0
#: The 8 non-negative E2M1 values, indexed by code (codes 8..15 are their negatives).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: e4m3fn's largest value: NVFP4's block-scale range.
_E4M3_MAX = 448.0
#: A scaled magnitude above this is *saturated*: round-to-nearest would leave the format
#: (the tie 7 between 6 and the absent 8 would round up to 8, 6's mantissa being odd).
_SATURATION_BOUND = math.nextafter(7.0, 0.0)
#: A scaled magnitude at most this rounds to zero (half the smallest subnormal, 0.5; the
#: tie goes to 0, whose mantissa is even).
_FLUSH_BOUND = 0.25

#: Layout of the vector :func:`cast_fp4` returns with ``stats=True`` (the FP8 casts' own).
FP4_STATS_FIELDS = ("saturated_count", "underflow_count", "numel", "amax", "scale", "headroom_log2")


class FP4Spec(NamedTuple):
    """One FP4 cast, as data.

    - ``kind``: ``"nvfp4"`` or ``"mxfp4"``.
    - ``block``: one entry per dim of the tensor cast, each dividing its size: ``b``
      consecutive elements along that dim share a scale (``(1, 16)``: NVFP4 1x16 along the
      last dim; ``(16, 16)``: 2D weight blocks; ``(1, 32)``: MXFP4).
    - ``pack_dim``: the dim two elements share a byte along (the contraction dim; even size).
    - ``scale_mode``: MXFP4's exponent rule, ``"rceil"`` or ``"floor"``.
    - ``rounding``: ``"nearest"`` or ``"stochastic"``.
    - ``four_over_six``: NVFP4 only, see the module docstring.
    """

    kind: str
    block: tuple[int, ...]
    pack_dim: int = -1
    scale_mode: str = "rceil"
    rounding: str = "nearest"
    four_over_six: bool = False

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kind == NVFP4 else E8M0


# ----------------------------------------------------------------- elements


def e2m1_encode(x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 values (already scaled) -> E2M1 codes (uint8, 0..15), saturating at 6.

    The E2M1 grid has spacing 0.5 on ``[0, 2)``, 1 on ``[2, 4)`` and 2 on ``[4, 6]``, each a
    power of two, so ``step * round(|x| / step)`` (``torch.round``: ties to even) is
    round-to-nearest-even on the grid: an even multiple of the step is an even mantissa.
    NaN encodes as 0 here; the casts mark its block through the scale.
    """
    mag = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=E2M1_MAX)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    units = mag / step  # exact: a division by a power of two
    if rounding == "stochastic":
        low = units.floor()
        # As scaling.stochastic_round: rand_like for the default generator traces under
        # torch.compile(dynamic=True), where `rand` given generator=None does not.
        if generator is None:
            draw = torch.rand_like(units, dtype=torch.float32, memory_format=torch.contiguous_format)
        else:
            draw = torch.rand(units.shape, generator=generator, device=units.device, dtype=torch.float32)
        units = low + (draw < units - low).to(torch.float32)
    else:
        units = units.round()
    q = units * step
    code = torch.where(q < 2.0, q * 2.0, torch.where(q < 4.0, q + 2.0, q * 0.5 + 4.0))
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> fp32 values (a table lookup)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Codes (uint8) -> bytes, two codes per byte along ``dim`` (``2i`` low nibble, ``2i+1``
    high), in ``FLOAT4_X2`` (``torch.float4_e2m1fn_x2``)."""
    dim = dim % codes.dim()
    if codes.shape[dim] % 2:
        raise ValueError(f"FP4 packs two values per byte along dim {dim}: its size must be even; got {tuple(codes.shape)}")
    moved = codes.movedim(dim, -1)
    packed = moved[..., 0::2] | (moved[..., 1::2] << 4)
    return packed.movedim(-1, dim).contiguous().view(FLOAT4_X2)


def unpack_e2m1(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Bytes -> codes (uint8), the inverse of :func:`pack_e2m1` (``dim`` doubles)."""
    raw = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    dim = dim % raw.dim()
    moved = raw.movedim(dim, -1)
    codes = torch.stack([moved & 0xF, moved >> 4], dim=-1).flatten(-2)
    return codes.movedim(-1, dim)


# ----------------------------------------------------------------- blocks


def _blocked(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """``x`` viewed as ``(n0, b0, n1, b1, ...)``: block index and offset per dim."""
    if len(block) != x.dim():
        raise ValueError(f"an FP4 block has one entry per dim; got block {block} for shape {tuple(x.shape)}")
    shape = []
    for size, b in zip(x.shape, block):
        b = b or size or 1  # 0: the whole dim (an empty dim: one empty block)
        if b <= 0 or size % b:
            raise ValueError(
                f"FP4 blocks must tile the tensor exactly (partial blocks are not supported): block {block}, "
                f"shape {tuple(x.shape)}"
            )
        shape += [size // b, b]
    return x.reshape(shape)


def _block_dims(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


def _expand(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-block tensor ``(n0, n1, ...)`` as ``(n0, 1, n1, 1, ...)``, to broadcast over blocks."""
    return scale.reshape([s for n in scale.shape for s in (n, 1)]) if ndim else scale


def _e8m0_decode_scale(amax: torch.Tensor, mode: str) -> torch.Tensor:
    """MXFP4's ``X = 2**e`` per block, as fp32, NaN for a non-finite amax.

    From ``amax = m * 2**p`` (frexp, ``m`` in [0.5, 1)), exactly, with no division by 6:
    ``"floor"``: ``floor(log2 amax) - emax_elem = p - 1 - 2``; ``"rceil"``: the smallest ``e``
    with ``amax / 2**e <= 6``, ``ceil(log2(amax / 6)) = p - 3`` when ``m <= 0.75`` (``amax <=
    6 * 2**(p-3)``), else ``p - 2``. (A float division by 6 would round, and frexp of the
    quotient could then pick the wrong binade; an int32 -> float64 conversion has no
    vectorized form in inductor's CPU code, so the exponent stays in float32, exact.)"""
    a = amax if amax.dtype in (torch.float32, torch.float64) else amax.to(torch.float32)
    finite = torch.isfinite(a)
    a = torch.where(finite & (a > 0), a, 1.0)
    mant, exp = torch.frexp(a)
    p = exp.to(a.dtype)
    e = p - 3.0 if mode == "floor" else p - 2.0 - (mant <= 0.75).to(a.dtype)
    e = torch.where(amax > 0, e, -127.0).clamp(-127, 127)
    scale = torch.exp2(e.to(torch.float64))  # 2**-127 is an fp32 subnormal: exact
    return torch.where(finite, scale, torch.nan).to(torch.float32)


def _encode_blocks(x, denom, rounding, generator):
    """codes and the fp32 values they were rounded from, for blocks of ``x`` with decode ``denom``."""
    # A zero denominator (an NVFP4 block scale that rounded to 0) flushes its block to
    # zeros that keep their signs (x * 0).
    scaled = torch.where(denom > 0, x / torch.where(denom > 0, denom, 1.0), x * 0.0)
    return e2m1_encode(scaled, rounding, generator), scaled


def cast_fp4(
    hp: torch.Tensor,
    spec: FP4Spec,
    *,
    generator: torch.Generator | None = None,
    stats: bool = False,
):
    """``hp`` cast per ``spec``: ``(packed, block_scale, global_scale)``, plus the stats vector
    (laid out as :data:`FP4_STATS_FIELDS`, float64) with ``stats=True``.

    ``packed``: ``FLOAT4_X2`` bytes, ``hp``'s shape with ``spec.pack_dim`` halved.
    ``block_scale``: one per block (shape ``size // block`` per dim), e4m3fn (NVFP4) or
    e8m0 (MXFP4), decode factors. ``global_scale``: 0-dim fp32 decode factor (1 for MXFP4).
    """
    if spec.kind not in (NVFP4, MXFP4):
        raise ValueError(f"FP4Spec.kind must be {NVFP4!r} or {MXFP4!r}; got {spec.kind!r}")
    # Deliberate upcast: the scaled values the rounding sees are fp32, not bf16 rounded twice.
    x = _blocked(hp.to(torch.float32), spec.block)
    dims = _block_dims(hp.dim())
    amax = x.abs().amax(dim=dims) if hp.numel() else x.new_zeros([s // (b or s or 1) for s, b in zip(hp.shape, spec.block)])
    finite_block = torch.isfinite(amax)
    if spec.kind == MXFP4:
        global_scale = torch.ones((), dtype=torch.float32, device=hp.device)
        block32 = _e8m0_decode_scale(amax, spec.scale_mode)
        block_scale = block32.to(E8M0)
        codes, scaled = _encode_blocks(x, _expand(block32, hp.dim()), spec.rounding, generator)
    else:
        # The tensor amax over finite values: an inf elsewhere must not wipe out every block.
        tensor_amax = torch.where(finite_block, amax, 0.0).amax() if amax.numel() else amax.new_zeros(())
        global_scale = torch.where(tensor_amax > 0, tensor_amax / (_E4M3_MAX * E2M1_MAX), 1.0)
        block_scale, codes, scaled = _nvfp4_blocks(x, amax, global_scale, E2M1_MAX, hp.dim(), spec.rounding, generator)
        if spec.four_over_six:
            s4, c4, v4 = _nvfp4_blocks(x, amax, global_scale, 4.0, hp.dim(), spec.rounding, generator)
            err6 = _block_sq_error(x, codes, block_scale, global_scale, dims)
            err4 = _block_sq_error(x, c4, s4, global_scale, dims)
            take4 = err4 < err6
            block_scale = torch.where(take4, s4.to(torch.float32), block_scale.to(torch.float32)).to(torch.float8_e4m3fn)
            pick = _expand(take4, hp.dim())
            codes, scaled = torch.where(pick, c4, codes), torch.where(pick, v4, scaled)
        block_scale = torch.where(finite_block, block_scale.to(torch.float32), torch.nan).to(torch.float8_e4m3fn)
    codes = codes.reshape(hp.shape)
    packed = pack_e2m1(codes, spec.pack_dim)
    if not stats:
        return packed, block_scale, global_scale
    return packed, block_scale, global_scale, _stats(hp, scaled.reshape(hp.shape), amax, block_scale, global_scale)


def _nvfp4_blocks(x, amax, global_scale, top, ndim, rounding, generator):
    """NVFP4 block scales that map each block's amax to ``top`` (6, or 4 for four-over-six),
    then the codes."""
    # Saturating: four-over-six's scale to 4 can exceed e4m3's 448 for the largest blocks.
    wanted = (torch.where(torch.isfinite(amax), amax, 0.0) / top / global_scale).clamp(max=_E4M3_MAX)
    block_scale = wanted.to(torch.float8_e4m3fn)
    denom = _expand(block_scale.to(torch.float32) * global_scale, ndim)
    codes, scaled = _encode_blocks(x, denom, rounding, generator)
    return block_scale, codes, scaled


def _block_sq_error(x, codes, block_scale, global_scale, dims):
    deq = e2m1_decode(codes) * _expand(block_scale.to(torch.float32) * global_scale, len(dims))
    return (torch.nan_to_num(x) - deq).square().sum(dim=dims)


def dequantize_fp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    block: tuple[int, ...],
    pack_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``e2m1 * block_scale * global_scale`` in fp32, saturated to ``dtype``'s finite range,
    then cast to ``dtype``.

    Saturating, as the FP8 dequantize does (``reference.dequantize``): E2M1 keeps one
    mantissa bit in every binade, so a value within a quarter of a binade below the
    dtype's max (fp16 60000, bf16 or fp32 max) rounds up to the next power of two whatever
    the block scale (MXFP4's powers of two: ``4 * 2**e``), which lies beyond the dtype's
    range (fp16 65536, fp32 2**128). No scale choice leaves room for it; the way back
    clamps instead. A block whose input held an inf or NaN has a NaN scale and stays NaN
    (clamp keeps NaN): never finite. One elementwise op, no host sync."""
    values = e2m1_decode(unpack_e2m1(packed, pack_dim))
    # Deliberate upcast of the e4m3/e8m0 scales: exact in fp32.
    scale = block_scale.to(torch.float32) * global_scale
    out = _blocked(values, block) * _expand(scale, values.dim())
    # The fp32 arithmetic's own range bounds a wider dtype (fp64: dequantize(torch.float64)).
    limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    return out.reshape(values.shape).clamp(-limit, limit).to(dtype)


def _stats(hp, scaled, amax, block_scale, global_scale) -> torch.Tensor:
    f64 = torch.float64
    if hp.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), float("nan")], dtype=f64, device=hp.device)
    magnitude = scaled.abs()
    saturated = (magnitude > _SATURATION_BOUND).sum()
    underflow = ((hp != 0) & torch.isfinite(hp) & (magnitude <= _FLUSH_BOUND)).sum()
    decode = block_scale.to(torch.float32) * global_scale
    finite = torch.isfinite(decode) & (decode > 0)
    # The FP8 casts report the smallest multiplier hp -> data: here 1 / the largest decode.
    largest = torch.where(finite, decode, 0.0).amax()
    scale = torch.where(largest > 0, 1.0 / largest, torch.nan)
    scaled_amax = torch.nan_to_num(magnitude, nan=0.0).amax()
    headroom = torch.log2(E2M1_MAX / scaled_amax.to(f64))
    numel = torch.full((), hp.numel(), dtype=f64, device=hp.device)
    finite_amax = torch.where(torch.isfinite(amax), amax, 0.0).amax()
    return torch.stack([saturated.to(f64), underflow.to(f64), numel, finite_amax.to(f64), scale.to(f64), headroom])
