"""amax -> scale: dynamic, delayed (amax history), power-of-2 and e8m0 block scales.

One rule everywhere: ``data = saturate(hp * scale)``, so ``scale = float8_max / amax``; one
scale entry per tensor, row or block. Computes scales only, never a Float8Tensor.
"""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from f8tensor.quant.formats import E8M0, E8M0_MAX_EXP, E8M0_MIN_EXP, FORMATS, format_number
from f8tensor.quant.specs import E8M0_SCALE_MODES, HISTORY_REDUCTIONS

__all__ = [
    "EPS",
    "HISTORY_REDUCTIONS",
    "abs_max",
    "amax_to_e8m0_scale",
    "amax_to_scale",
    "block_abs_max",
    "block_amax",
    "delayed_scale",
    "dynamic_scale",
    "expand_block_scale",
    "inverse_scale_of",
    "materialized",
    "push_amaxes",
    "scale_of_amax",
    "segment_amax",
    "stochastic_round",
    "tensor_amax",
]

# amax_to_e8m0_scale writes the e8m0 exponent range as literals: traced, a global read is
# a guard per cast.
assert (E8M0_MIN_EXP, E8M0_MAX_EXP) == (-127, 127), (E8M0_MIN_EXP, E8M0_MAX_EXP)

#: The least amax: an all-zero tensor gets a finite scale.
EPS = 2.0**-100
# Traced code writes the literal 2.0**-100: dynamo would lift a global float to an input.


def tensor_amax(x: torch.Tensor, axiswise_dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32, 0-dim or over ``axiswise_dim`` (keepdim); NaN stays NaN."""
    return abs_max(x, axiswise_dim).to(torch.float32)


def abs_max(x: torch.Tensor, axiswise_dim: int | None = None) -> torch.Tensor:
    """:func:`tensor_amax` in ``x``'s own dtype (exact); an empty ``x`` gives fp32 zeros."""
    if x.numel() == 0:
        shape = () if axiswise_dim is None else _keepdim_shape(x.shape, axiswise_dim)
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    if axiswise_dim is not None and x.device.type == "cpu":
        # CPU aminmax along a dim is slow (BENCHMARKS-history.md).
        lo, hi = torch.amin(x, dim=axiswise_dim, keepdim=True), torch.amax(x, dim=axiswise_dim, keepdim=True)
    else:
        lo, hi = torch.aminmax(x, dim=axiswise_dim, keepdim=axiswise_dim is not None)
    return torch.maximum(hi, lo.neg())


def _keepdim_shape(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return tuple(1 if i == dim % len(shape) else s for i, s in enumerate(shape))


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype, *, round_pow2: bool = False) -> torch.Tensor:
    """``float8_max / amax`` in fp32: finite for amax 0, NaN for a non-finite amax."""
    traced = torch.compiler.is_compiling()
    scale = scale_of_amax(amax, format_number(float8_dtype, "max"), round_pow2, traced)
    # Traced, stored once, not recomputed per element.
    return materialized(scale, None) if traced else scale


def scale_of_amax(amax: torch.Tensor, fmax: float, round_pow2: bool, traced: bool = False) -> torch.Tensor:
    """:func:`amax_to_scale` not materialized (for a caller that knows it runs eager), of the
    format's largest value ``fmax``; ``traced``: inside a graph being compiled."""
    # float64: correctly rounded everywhere, so eager == compiled bitwise.
    amax64 = amax.to(torch.float64)
    # fmax / amax as Tensor.__rdiv__ computes it (reciprocal, then multiply), without its
    # Python wrapper; 2.0**-100 is EPS (see there).
    if round_pow2:
        scale = _round_down_pow2((amax64.clamp(min=2.0**-100).reciprocal() * fmax).to(torch.float32))
        # After the rounding, which would turn a NaN scale into inf.
        return torch.where(torch.isfinite(amax64), scale, float("nan"))
    if traced:
        # |inf + 0 * inf|: a NaN constant (NaN != NaN) would keep equal casts of one input apart.
        amax64 = amax64.add(amax64, alpha=0).abs()
    else:
        # Non-finite -> NaN in one op (the eager hot path counts ops).
        nan = float("nan")  # not math.nan: a module attribute read is a guard
        amax64 = torch.nan_to_num(amax64, nan=nan, posinf=nan, neginf=nan)
    return (amax64.clamp(min=2.0**-100).reciprocal() * fmax).to(torch.float32)


def inverse_scale_of(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in the scale's dtype (exact for e8m0)."""
    if scale.dtype == torch.float32:
        return scale.reciprocal()
    return scale.to(torch.float32).reciprocal().to(E8M0)


def materialized(t: torch.Tensor, stride: tuple | None = None) -> torch.Tensor:
    """``t``; compiled, a buffer written once where computed, not recomputed by each reader.

    Args:
        stride: the layout ``t`` is known to have (strides of a traced backward are unreadable).
    """
    if not torch.compiler.is_compiling() or type(t) is not torch.Tensor:
        return t
    if stride is None:
        t = t.contiguous()
        stride = _contiguous_strides(t.shape)
    return t.as_strided(t.shape, stride)


def _contiguous_strides(shape) -> tuple:
    # Indexed, not reversed(): traced, each builtin iterator is a guard.
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * shape[i]
    return tuple(strides)


def _round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    # Exponent bits: exact, unlike log2/exp2.
    bits = scale.view(torch.int32) & 0x7F800000
    return bits.view(torch.float32)


def dynamic_scale(
    x: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    axiswise_dim: int | None = None,
    round_pow2: bool = False,
) -> torch.Tensor:
    """The current ("dynamic") scale of ``x``."""
    return amax_to_scale(abs_max(x, axiswise_dim), float8_dtype, round_pow2=round_pow2)


def delayed_scale(
    history: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    reduction: str = "max",
    margin: int = 0,
    round_pow2: bool = False,
) -> torch.Tensor:
    """The scale from an amax history (newest first); all zero (step one) gives the unit scale.

    Raises:
        ValueError: ``reduction`` is not ``"max"`` or ``"most_recent"``.
    """
    if reduction == "max":
        amax = history.amax()
    elif reduction == "most_recent":
        amax = history[0]
    else:
        raise ValueError(f"reduction must be one of {HISTORY_REDUCTIONS}; got {reduction!r}")
    amax = amax.where(amax > 0, format_number(float8_dtype, "max"))  # a method: traced, torch.where is a guard
    if margin:
        amax = amax * (2.0**margin)
    return amax_to_scale(amax, float8_dtype, round_pow2=round_pow2)


def push_amaxes(
    histories: torch.Tensor, amaxes: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
) -> None:
    """Shift each row of ``histories`` whose amax is given, that amax first, in one write.

    A non-finite amax repeats the row's newest; a None leaves the row as it is.
    """
    # Methods, not torch.where/isfinite: traced, each torch function first used is a guard.
    # No generators: each is a Python call per step.
    if amaxes[0] is not None and amaxes[1] is not None and amaxes[2] is not None:
        raw = torch.cat([amaxes[0].reshape(1), amaxes[1].reshape(1), amaxes[2].reshape(1)])
        newest = raw.to(histories.dtype).where(raw.isfinite(), histories[:, 0])
        histories.copy_(torch.cat([newest.reshape(-1, 1), histories[:, :-1]], 1))
        return
    rows = []
    for history, amax in zip(histories.unbind(0), amaxes):
        if amax is not None:
            amax = amax.to(history.dtype).where(amax.isfinite(), history[0])
            history = torch.cat([amax.reshape(1), history[:-1]])
        rows.append(history.reshape(1, -1))
    histories.copy_(torch.cat(rows))


def _blocked(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, as ``(n0, b0, n1, b1, ...)``."""
    pads: list[int] = []
    shape: list[int] = []
    # A symbolic size is never compared (a guard per token count).
    traced = torch.compiler.is_compiling()
    for size, b in zip(x.shape, block):
        extent = size if b == 0 or (statically_known_true(b > size) if traced else b > size) else b
        count = 1 if b == 0 else -(-size // b)
        pads.append(count * extent - size)
        shape += [count, extent]
    if not all(statically_known_true(pad == 0) for pad in pads) if traced else any(pads):
        flat = [p for pad in reversed(pads) for p in (0, pad)]
        x = torch.nn.functional.pad(x, flat)
    return x.reshape(shape)


def block_amax(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """max |x| per block in fp32, in the scale's shape."""
    return block_abs_max(x, block).to(torch.float32)


def block_abs_max(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """:func:`block_amax` in ``x``'s own dtype; ValueError unless one block entry per dim."""
    if len(block) != x.dim():
        raise ValueError(f"block {block} has {len(block)} entries for a {x.dim()}-dim tensor")
    out_shape = tuple(1 if b == 0 else -(-s // b) for s, b in zip(x.shape, block))
    if x.numel() == 0:
        return torch.zeros(out_shape, dtype=torch.float32, device=x.device)
    xb = _blocked(x, block)
    inner = tuple(range(1, 2 * x.dim(), 2))
    lo, hi = torch.amin(xb, dim=inner), torch.amax(xb, dim=inner)
    return torch.maximum(hi, lo.neg()).reshape(out_shape)


def segment_amax(x: torch.Tensor, lengths: torch.Tensor, *, rows_per_chunk: int = 1) -> torch.Tensor:
    """max |x| per (row segment of ``lengths``, column) of 2D ``x``, fp32.

    ``lengths`` must sum to the rows (unchecked) and be multiples of ``rows_per_chunk``.
    """
    rows, cols = x.shape
    if rows_per_chunk > 1:
        chunks = x.reshape(rows // rows_per_chunk, rows_per_chunk, cols)
        if torch.compiler.is_compiling():
            # One pass (min, max, then maximum were two); eager's make no full-size temporary.
            magnitude = chunks.float().abs().amax(1)
        else:
            magnitude = torch.maximum(chunks.amax(1), chunks.amin(1).neg())
        lengths = lengths // rows_per_chunk
    else:
        magnitude = x.abs()
    # unsafe: checking the lengths would sync.
    return torch.segment_reduce(magnitude.float(), "max", lengths=lengths, axis=0, unsafe=True, initial=0.0)


def _floor_pow2_f64(x: torch.Tensor) -> torch.Tensor:
    # 2**floor(log2(x)), exactly: the exponent bits.
    return (x.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)


def amax_to_e8m0_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, mode: str = "rceil", dtype: torch.dtype = E8M0
) -> torch.Tensor:
    """Power-of-two MX block scales (e8m0); a non-finite amax gives NaN.

    Args:
        mode: ``"rceil"`` (nothing saturates) or ``"floor"`` (OCP MX v1.0; a block's top may clamp).
        dtype: ``E8M0``, or ``torch.float32`` for the same values in fp32.
    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in E8M0_SCALE_MODES:
        raise ValueError(f"e8m0 scale mode must be one of {E8M0_SCALE_MODES}; got {mode!r}")
    # float64: exact powers of two, same bits eager and compiled.
    amax64 = amax.to(torch.float64).clamp(min=2.0**-100)  # EPS (see there)
    if mode == "rceil":
        scale = _floor_pow2_f64(format_number(float8_dtype, "max") / amax64)
    else:
        scale = (2.0 ** format_number(float8_dtype, "emax")) / _floor_pow2_f64(amax64)
    scale = scale.clamp(min=2.0**-127, max=2.0**127)  # E8M0_MIN_EXP, E8M0_MAX_EXP (see there)
    # + (amax - amax): NaN for a non-finite amax, else 0.
    scale = scale + (amax64 - amax64)
    if dtype == E8M0:
        return scale.to(torch.float32).to(E8M0)
    return scale.abs().to(dtype)  # a NaN as e8m0's reads back: positive


def expand_block_scale(scale: torch.Tensor, block: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 scale repeated over its blocks, broadcasting against ``shape``."""
    if scale.dtype != torch.float32:
        scale = scale.to(torch.float32)
    traced = torch.compiler.is_compiling()
    for d, b in enumerate(block):
        if b <= 1:
            continue
        n = scale.shape[d]
        if statically_known_true(n == 1) if traced else n == 1:
            continue
        if traced and not statically_known_true(n * b == shape[d]):
            # Inductor CPU (torch 2.13) reads the view below out of bounds.
            scale = scale.index_select(d, torch.arange(shape[d], device=scale.device) // b)
            continue
        sizes = list(scale.shape)
        scale = scale.unsqueeze(d + 1).expand(*sizes[: d + 1], b, *sizes[d + 1 :])
        scale = scale.reshape(*sizes[:d], n * b, *sizes[d + 1 :])
        if n * b != shape[d]:
            scale = scale.narrow(d, 0, shape[d])
    return scale


def stochastic_round(
    x: torch.Tensor,
    float8_dtype: torch.dtype,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round fp32 ``x`` stochastically to the FP8 grid (``E[result] = x``); ``uniform``: own draws."""
    fmt = FORMATS[float8_dtype]
    emin = round(math.log2(format_number(float8_dtype, "smallest_normal")))
    e = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(min=emin)
    ulp = ((e - fmt.mantissa_bits + 127) << 23).view(torch.float32)
    q = x / ulp
    lo = torch.floor(q)
    # rand_like: `rand` with a generator fails to trace symbolic shapes.
    if uniform is not None:
        u = uniform
    elif generator is None:
        u = torch.rand_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
    else:
        u = torch.rand(x.shape, dtype=torch.float32, device=x.device, generator=generator)
    return (lo + (u < q - lo).to(torch.float32)) * ulp
