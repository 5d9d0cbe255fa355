"""The FP4 casts: E2M1 elements with NVFP4 or MXFP4 block scales, packed two per byte.

- E2M1 (OCP MX spec v1.0, 5.3.3): magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (codes 0..7),
  bit 3 the sign; no inf, no NaN.
- MXFP4: one e8m0 scale ``2**e`` per 32 elements along K (``"rceil"``: nothing saturates;
  ``"floor"``: the spec's rule).
- NVFP4: one e4m3fn scale per 16 elements and one fp32 tensor scale
  ``g = amax / (448 * 6)``; ``four_over_six`` also tries 4 as a block's top value.

Scales here are **decode** factors (``x ~= e2m1 * block_scale * global_scale``), as the
specs and kernels spell them; FP8 casts store the reciprocal. Rounding is to nearest even
(or stochastic), saturating at 6. A block holding inf or NaN gets a NaN scale, so it
dequantizes to NaN, never finite garbage. Packing: element ``2i`` in the low nibble of
byte ``i``, ``2i + 1`` in the high one.
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
#: A scaled magnitude above this is *saturated* (the tie 7 would round up to the absent 8).
_SATURATION_BOUND = math.nextafter(7.0, 0.0)
#: A scaled magnitude at most this rounds to zero (the tie goes to even 0).
_FLUSH_BOUND = 0.25

#: Layout of the vector :func:`cast_fp4` returns with ``stats=True`` (the FP8 casts' own).
FP4_STATS_FIELDS = ("saturated_count", "underflow_count", "numel", "amax", "scale", "headroom_log2")


class FP4Spec(NamedTuple):
    """One FP4 cast, as data.

    - ``kind``: ``"nvfp4"`` or ``"mxfp4"``.
    - ``block``: per dim, the elements sharing a scale (``(1, 16)``, ``(16, 16)``, ``(1, 32)``).
    - ``pack_dim``: the dim two elements share a byte along (K; even size).
    - ``scale_mode``: MXFP4's exponent rule, ``"rceil"`` or ``"floor"``.
    - ``rounding``: ``"nearest"`` or ``"stochastic"``.
    - ``four_over_six``: NVFP4 only: keep the lower-error of tops 6 and 4 per block.
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


def e2m1_encode(x: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 values (already scaled) -> E2M1 codes (uint8, 0..15), saturating at 6.

    The grid's spacings are powers of two, so ``step * round(|x| / step)`` is round-to-nearest-even
    on it. NaN encodes as 0; the casts mark its block through the scale.
    """
    mag = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=E2M1_MAX)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    units = mag / step  # exact: a division by a power of two
    if rounding == "stochastic":
        low = units.floor()
        # rand_like traces under torch.compile(dynamic=True); rand(generator=None) does not.
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
    """Codes (uint8) -> ``FLOAT4_X2`` bytes, two per byte along ``dim`` (``2i`` low nibble)."""
    dim = dim % codes.dim()
    if codes.shape[dim] % 2:
        raise ValueError(
            f"FP4 packs two values per byte along dim {dim}: its size must be even; got {tuple(codes.shape)}"
        )
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

    Computed exactly from frexp's exponent (no division by 6, which would round and could
    pick the wrong binade): ``"floor"``: ``p - 3``; ``"rceil"``: ``p - 3`` when the mantissa is
    at most 0.75, else ``p - 2``. Kept in float32 (inductor's CPU code has no vectorized
    int32 -> float64).
    """
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
    # A zero denominator (an NVFP4 scale rounded to 0) flushes to signed zeros.
    scaled = torch.where(denom > 0, x / torch.where(denom > 0, denom, 1.0), x * 0.0)
    return e2m1_encode(scaled, rounding, generator), scaled


def cast_fp4(
    hp: torch.Tensor,
    spec: FP4Spec,
    *,
    generator: torch.Generator | None = None,
    stats: bool = False,
):
    """``hp`` cast per ``spec``: ``(packed, block_scale, global_scale)`` (+ stats with ``stats=True``).

    Returns:
        ``packed``: ``FLOAT4_X2`` bytes, ``spec.pack_dim`` halved; ``block_scale``: one per
        block, e4m3fn (NVFP4) or e8m0 (MXFP4); ``global_scale``: 0-dim fp32 (1 for MXFP4);
        all decode factors. The stats vector is laid out as :data:`FP4_STATS_FIELDS`.
    """
    if spec.kind not in (NVFP4, MXFP4):
        raise ValueError(f"FP4Spec.kind must be {NVFP4!r} or {MXFP4!r}; got {spec.kind!r}")
    # Deliberate upcast: the scaled values the rounding sees are fp32, not bf16 rounded twice.
    x = _blocked(hp.to(torch.float32), spec.block)
    dims = _block_dims(hp.dim())
    amax = (
        x.abs().amax(dim=dims)
        if hp.numel()
        else x.new_zeros([s // (b or s or 1) for s, b in zip(hp.shape, spec.block)])
    )
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
            block_scale = torch.where(take4, s4.to(torch.float32), block_scale.to(torch.float32)).to(
                torch.float8_e4m3fn
            )
            pick = _expand(take4, hp.dim())
            codes, scaled = torch.where(pick, c4, codes), torch.where(pick, v4, scaled)
        block_scale = torch.where(finite_block, block_scale.to(torch.float32), torch.nan).to(torch.float8_e4m3fn)
    codes = codes.reshape(hp.shape)
    packed = pack_e2m1(codes, spec.pack_dim)
    if not stats:
        return packed, block_scale, global_scale
    return packed, block_scale, global_scale, _stats(hp, scaled.reshape(hp.shape), amax, block_scale, global_scale)


def _nvfp4_blocks(x, amax, global_scale, top, ndim, rounding, generator):
    """NVFP4 block scales mapping each block's amax to ``top`` (6, or 4), then the codes."""
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
    """``e2m1 * block_scale * global_scale`` in fp32, saturated to ``dtype``'s range, cast.

    Saturating as the FP8 dequantize does: a value near the dtype's max may round up past it.
    A block with a NaN scale stays NaN.
    """
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
