"""amax -> scale: dynamic (current), delayed (amax history) and power-of-2 rounding.

Scale semantics, one rule everywhere in f8tensor::

    data = saturate(hp.float() * scale)        hp ~= data.float() / scale

so ``scale = float8_max / amax``. Tensorwise scales are 0-dim; axiswise (rowwise)
scales keep the reduced dimension as size 1 and broadcast against the data.

Block scales (1x128, 128x128, MX 1x32, any block shape: see
:class:`f8tensor.quant.config.BlockGranularity`) follow the same rule per block: the amax is
taken over each block, and the scale has one entry per block (``ceil(size / b)`` along a
dim with block ``b``, 1 along a dim with block 0). e8m0 scales are powers of two stored
as ``torch.float8_e8m0fnu`` with the same meaning (the multiplier hp -> data).

This module only computes scale tensors (and the stochastic rounding of scaled values);
it never builds a Float8Tensor.
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
    "push_amax",
    "segment_amax",
    "stochastic_round",
    "tensor_amax",
]

#: amax is clamped to at least this before division, so an all-zero tensor gets a finite
#: scale. 2**-100 (~7.9e-31) keeps tensors with a tiny but real amax (down to ~1e-30)
#: representable instead of flushing them to zero, while every derived number stays a
#: normal fp32: float8_max / EPS <= 57344 * 2**100 ~ 7.3e34 (< 3.4e38), and the inverse
#: scale EPS / float8_max >= 2**-116 ~ 1.2e-35 (> 1.2e-38, the smallest normal).
EPS = 2.0**-100
# Inside functions that torch.compile traces, EPS is written as the literal ``2.0**-100``
# (folded to a constant by the Python compiler): under ``torch.compile(dynamic=True)``
# dynamo turns a *global* float into a symbolic graph input, and when the first read of
# it happens inside one autograd Function's subgraph, every later Function of the graph
# (the model's next layer) reuses a symbol bound in that finished subgraph and dynamo
# fails (see formats.format_number, the same for the format's numbers). A literal is a
# constant: nothing to lift.


def tensor_amax(x: torch.Tensor, axiswise_dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32: a 0-dim tensor, or reduced over ``axiswise_dim`` with keepdim.

    One pass over ``x`` (one min/max reduction, never materializing ``|x|``; on CPU, two
    for an axiswise amax, see below). NaN in ``x`` gives a NaN amax, inf or -inf gives
    inf; an empty tensor (an empty FSDP shard) gives 0.
    """
    return abs_max(x, axiswise_dim).to(torch.float32)


def abs_max(x: torch.Tensor, axiswise_dim: int | None = None) -> torch.Tensor:
    """:func:`tensor_amax` in ``x``'s own dtype (exact: min and max are), for callers that
    widen it further anyway (:func:`dynamic_scale` goes straight to float64: one conversion
    instead of two). An empty ``x`` gives fp32 zeros."""
    if x.numel() == 0:
        shape = () if axiswise_dim is None else _keepdim_shape(x.shape, axiswise_dim)
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    # max(max, -min) rather than linalg.vector_norm(ord=inf): also one pass on GPUs, and
    # several times faster on CPU, where the inf-norm kernel is slow. min and max are
    # exact in any float dtype, so widening the result to fp32 afterwards loses nothing,
    # and every way of taking them gives the same bits.
    if axiswise_dim is not None and x.device.type == "cpu":
        # CPU's aminmax along a dimension is 5-20x slower than amax and amin taken
        # separately (two vectorized reductions): see BENCHMARKS.md.
        lo, hi = torch.amin(x, dim=axiswise_dim, keepdim=True), torch.amax(x, dim=axiswise_dim, keepdim=True)
    else:
        lo, hi = torch.aminmax(x, dim=axiswise_dim, keepdim=axiswise_dim is not None)
    return torch.maximum(hi, lo.neg())


def _keepdim_shape(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return tuple(1 if i == dim % len(shape) else s for i, s in enumerate(shape))


def amax_to_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, *, round_pow2: bool = False
) -> torch.Tensor:
    """``float8_max / amax`` as fp32, guarded.

    - amax of 0 (or below :data:`EPS`) gives ``float8_max / EPS``: finite.
    - A non-finite amax (the tensor held inf or NaN) gives a NaN scale, so the cast turns
      the whole tensor into NaN instead of finite-looking garbage.
    - ``round_pow2`` rounds the scale down to a power of two (exact dequantization,
      scales that never drift by an ulp between ranks or steps).
    """
    # Deliberate upcast: float64 division is correctly rounded on every backend, while
    # fp32 division in generated GPU kernels may not be; the fp32 result is then bitwise
    # identical in eager and under torch.compile. (``max / t`` is ``t.reciprocal() * max``
    # in torch: that is the rounding every scale of the library has, kept as is.)
    amax64 = amax.to(torch.float64)
    fmax = format_number(float8_dtype, "max")
    if round_pow2:
        scale = _round_down_pow2((fmax / amax64.clamp(min=2.0**-100)).to(torch.float32))  # 2.0**-100: EPS (see there)
        # After the rounding, which would turn a NaN scale into inf.
        return materialized(torch.where(torch.isfinite(amax64), scale, torch.nan))
    # The non-finite guard in one op (the eager hot path counts ops): inf, -inf and NaN
    # amax become the canonical NaN before the division, which carries it to the scale
    # (clamp, reciprocal, multiplication and the fp32 conversion keep a NaN and its sign).
    # Finite amax pass unchanged: the same bits as a `where(isfinite(amax), scale, nan)`.
    amax64 = torch.nan_to_num(amax64, nan=math.nan, posinf=math.nan, neginf=math.nan)
    scale = (fmax / amax64.clamp(min=2.0**-100)).to(torch.float32)  # 2.0**-100: EPS (see there)
    # Stored once: inductor would otherwise inline the float64 division into every loop
    # that reads the scale, a double conversion and division per element of the cast.
    return materialized(scale)


def inverse_scale_of(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, the dequantization factor the GEMM kernels take, in the scale's dtype:
    exact for e8m0 (powers of two; the reciprocal is taken in fp32)."""
    if scale.dtype == torch.float32:
        return scale.reciprocal()
    return scale.to(torch.float32).reciprocal().to(E8M0)


def materialized(t: torch.Tensor, stride: tuple | None = None) -> torch.Tensor:
    """``t`` itself; under torch.compile, a result inductor stores to memory where computed.

    Inductor inlines a cheap elementwise result into each loop that reads it (recomputing
    it there) and re-derives a transposed view's producer in the view's loop order. Both
    are wrong for the casts: a scale must be computed once, not once per element, and a
    column-major FP8 copy must be written by the cast's own pass. ``as_strided`` is a view
    whose inductor lowering needs a real buffer, so ``t`` is stored in its own layout by
    the loop that computes it, and readers load it. Eager: returned as is.

    The strides are never read from ``t``: inside an autograd Function's backward traced
    with dynamic shapes (``torch.compile(dynamic=True)``) dynamo cannot read the strides
    of a tensor computed from the incoming gradient. ``stride``: the layout ``t`` is known
    to have (a buffer the caller allocated); default: ``t`` is made contiguous (a no-op
    for the fresh elementwise results passed here) and gets contiguous strides.
    """
    if not torch.compiler.is_compiling() or type(t) is not torch.Tensor:
        return t
    if stride is None:
        t = t.contiguous()
        stride = _contiguous_strides(t.shape)
    return t.as_strided(t.shape, stride)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return tuple(reversed(strides))


def _round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    # Keep sign and exponent bits, drop the mantissa: 2**floor(log2(scale)) exactly for
    # positive normal fp32, without log2/exp2 whose rounding differs across backends.
    bits = scale.view(torch.int32) & 0x7F800000
    return bits.view(torch.float32)


def dynamic_scale(
    x: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    axiswise_dim: int | None = None,
    round_pow2: bool = False,
) -> torch.Tensor:
    """The current ("dynamic") scale of ``x``: one extra read of ``x`` for the amax."""
    return amax_to_scale(abs_max(x, axiswise_dim), float8_dtype, round_pow2=round_pow2)


def delayed_scale(
    history: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    reduction: str = "max",
    margin: int = 0,
    round_pow2: bool = False,
) -> torch.Tensor:
    """Delayed scaling: the scale from an amax history (newest first, shape ``(L,)``) alone.

    ``reduction="max"`` uses the largest amax of the window, ``"most_recent"`` the newest
    one; ``margin`` leaves ``2**margin`` of headroom below the format's max.

    The scale depends on nothing measured on the tensor being cast, so the cast needs no
    pass over it beforehand: under torch.compile the amax pushed into the history is
    measured inside the cast's own pass. Hence the two guards work without the current
    amax:

    - An empty history (all zero: the first step) gives the unit scale (``2**-margin``
      with a margin), as if the amax were the format's max: FP8 values are the
      high-precision ones rounded to the format, whose range (E4M3 up to 448, E5M2 up to
      57344) holds typical activations, weights and gradients; from the next step on the
      history holds a real amax. Every data-parallel rank picks the same first scale.
    - A history never holds a non-finite amax (see :func:`push_amax`), so the scale is
      always finite and positive. Non-finite *inputs* are the caller's to keep
      non-finite (the delayed cast turns inf into NaN element by element).
    """
    if reduction == "max":
        amax = history.amax()
    elif reduction == "most_recent":
        amax = history[0]
    else:
        raise ValueError(f"reduction must be one of {HISTORY_REDUCTIONS}; got {reduction!r}")
    amax = torch.where(amax > 0, amax, format_number(float8_dtype, "max"))
    if margin:
        amax = amax * (2.0**margin)
    return amax_to_scale(amax, float8_dtype, round_pow2=round_pow2)


def push_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Shift ``history`` by one (in place) and store ``amax`` as its newest entry.

    A non-finite amax (an inf/NaN step, e.g. an fp16 overflow that a grad scaler skips)
    repeats the newest entry instead of poisoning the next ``L`` scales. In place, so the
    history can live in a module buffer and be updated inside forward or backward, eager
    or compiled, with no Python state.
    """
    amax = torch.where(torch.isfinite(amax), amax.to(history.dtype), history[0])
    history.copy_(torch.cat([amax.reshape(1), history[:-1]]))


# ===================================================================== block scales


def _blocked(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """``x`` zero-padded to whole blocks and viewed as ``(n0, b0, n1, b1, ...)``.

    ``n_d`` is the number of blocks along dim ``d`` (1 for block 0) and ``b_d`` the block's
    extent (the whole dim for block 0, and for a block larger than the dim: one partial
    block, never padded to the block's size). Zero padding leaves every block's amax unchanged.
    """
    pads: list[int] = []
    shape: list[int] = []
    # A symbolic size (torch.compile(dynamic=True)) is never compared (a guard would mean one
    # graph per token count): it is padded to whole blocks, the same amax.
    traced = torch.compiler.is_compiling()
    for size, b in zip(x.shape, block):
        extent = size if b == 0 or (statically_known_true(b > size) if traced else b > size) else b
        count = 1 if b == 0 else -(-size // b)
        pads.append(count * extent - size)
        shape += [count, extent]
    if not all(statically_known_true(pad == 0) for pad in pads) if traced else any(pads):
        # F.pad takes (last-dim-left, last-dim-right, ...): pad on the right only.
        flat = [p for pad in reversed(pads) for p in (0, pad)]
        x = torch.nn.functional.pad(x, flat)
    return x.reshape(shape)


def block_amax(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """max |x| per block, fp32, in the scale's shape (``ceil(size / b)`` per dim, 1 for b = 0).

    NaN in a block gives that block a NaN amax, inf gives inf; other blocks are unaffected.
    """
    return block_abs_max(x, block).to(torch.float32)


def block_abs_max(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """:func:`block_amax` in ``x``'s own dtype (exact), for a caller that widens it to float64
    next (the scale: one conversion instead of two). An empty ``x`` gives fp32 zeros."""
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
    """max |x| per (segment, column) of a 2D ``x`` whose rows are cut into consecutive
    segments of ``lengths`` rows (ragged groups: an MoE layer's tokens sorted by expert),
    fp32, shape ``(len(lengths), columns)``; a segment with no rows gets 0. ``lengths``
    must sum to the row count (not checked: that would read it on the host).

    ``rows_per_chunk``: every length (and so the row count) is a multiple of it, so each
    chunk of that many consecutive rows lies in one segment: the rows are reduced chunk by
    chunk first (one pass over ``x``, which inductor fuses with ``|x|``), and the segment
    reduction reads the chunk maxima, ``rows_per_chunk`` times fewer. Never a scatter: a
    scatter-max of every row into its group's row is an atomic per element, all of a
    group's rows racing for the same addresses. NaN in a segment gives NaN there, inf gives
    inf (as ``amax``); min and max are exact, so the result is the same bits whatever the
    chunking.
    """
    rows, cols = x.shape
    if rows_per_chunk > 1:
        chunks = x.reshape(rows // rows_per_chunk, rows_per_chunk, cols)
        magnitude = torch.maximum(chunks.amax(1), chunks.amin(1).neg())
        lengths = lengths // rows_per_chunk
    else:
        magnitude = x.abs()
    # unsafe: lengths summing to the rows is the caller's invariant (checking it syncs).
    return torch.segment_reduce(magnitude.float(), "max", lengths=lengths, axis=0, unsafe=True, initial=0.0)


def _floor_pow2_f64(x: torch.Tensor) -> torch.Tensor:
    # 2**floor(log2(x)) exactly for positive normal float64: keep the exponent bits only.
    return (x.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)


def amax_to_e8m0_scale(amax: torch.Tensor, float8_dtype: torch.dtype, mode: str = "rceil") -> torch.Tensor:
    """Power-of-two scales for MX blocks, as ``torch.float8_e8m0fnu``.

    With ``X = 2**shared_exp`` the spec's dequantization factor and ``scale = 1 / X`` ours:

    - ``"rceil"``: ``X = 2**ceil(log2(amax / float8_max))``, the smallest power of two that
      keeps ``amax / X <= float8_max``: nothing in the block saturates.
    - ``"floor"`` (OCP MX v1.0, section 6.3): ``X = 2**(floor(log2(amax)) - emax_elem)``;
      ``amax / X`` lies in ``[2**emax, 2**(emax+1))``, so the top of a block above
      ``float8_max`` (448 for e4m3fn) is clamped.

    amax of 0 is clamped to :data:`EPS` first (a finite scale); the exponent is clamped to
    e8m0's range ``[-127, 127]``; a non-finite amax gives the e8m0 NaN (byte 0xFF), so the
    whole block dequantizes to NaN.
    """
    if mode not in E8M0_SCALE_MODES:
        raise ValueError(f"e8m0 scale mode must be one of {E8M0_SCALE_MODES}; got {mode!r}")
    # Deliberate upcast: float64 holds 448 / amax for every fp32 amax without rounding to
    # the next power of two (the two differ by >= 2**-24 relative), and powers of two
    # 2**-127..2**127 are exact; the same bits eager and compiled.
    amax64 = amax.to(torch.float64).clamp(min=2.0**-100)  # EPS (see there)
    if mode == "rceil":
        scale = _floor_pow2_f64(format_number(float8_dtype, "max") / amax64)
    else:
        scale = (2.0 ** format_number(float8_dtype, "emax")) / _floor_pow2_f64(amax64)
    scale = scale.clamp(min=2.0**E8M0_MIN_EXP, max=2.0**E8M0_MAX_EXP)
    # The non-finite guard in two ops: amax - amax is 0 for a finite amax (adding it leaves
    # the scale's bits alone) and NaN for inf or NaN, which the exponent masking above
    # would have turned into a finite scale. e8m0 has one NaN (0xFF) whatever its sign.
    scale = scale + (amax64 - amax64)
    # Exact: every value is a power of two in e8m0's range (fp32 holds 2**-127 as a
    # subnormal), or NaN. Through fp32: the conversion to e8m0 every back end has.
    return scale.to(torch.float32).to(E8M0)


def expand_block_scale(scale: torch.Tensor, block: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 scale repeated over its blocks, broadcastable against data of ``shape``.

    Dims with block 0 or 1 already broadcast; a dim with block ``b > 1`` repeats each
    entry ``b`` times and drops the padding of a partial edge block.
    """
    if scale.dtype != torch.float32:
        scale = scale.to(torch.float32)
    traced = torch.compiler.is_compiling()
    for d, b in enumerate(block):
        # One block spanning the whole dim (a block larger than the dim included): its single
        # entry broadcasts as it is. Traced, a symbolic size is never compared (no guard: one
        # graph for every token count); it takes the indexed path below, the same values.
        if b <= 1:
            continue
        n = scale.shape[d]
        if statically_known_true(n == 1) if traced else n == 1:
            continue
        if traced and not statically_known_true(n * b == shape[d]):
            # A short last block (or a symbolic size), compiled: one index per element.
            # Inductor's CPU code (torch 2.13) reads the expanded, reshaped and narrowed
            # view below out of bounds past the first block (garbage in the cast).
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
    """Round fp32 ``x`` (already within the format's finite range) to a neighbouring value of
    the ``float8_dtype`` grid, up with probability equal to the distance from the lower one
    in spacings: ``E[result] = x`` exactly. Returns fp32 values that are on the FP8 grid.

    The spacing at ``x`` is ``2**(e - mantissa_bits)`` with ``e = floor(log2|x|)``, held at
    the format's smallest normal exponent below it (the subnormal spacing). Everything is
    exact in fp32 (power-of-two spacings, ``floor``), so the only randomness is the
    uniform draw: reproducible with ``generator`` (or ``torch.manual_seed``). NaN stays NaN.
    ``uniform``: the caller's draws instead (fp32 in ``[0, 1)``, ``x``'s shape), e.g. a
    counter-based hash of each element's position, which no generator state has to follow.
    """
    fmt = FORMATS[float8_dtype]
    emin = round(math.log2(format_number(float8_dtype, "smallest_normal")))
    # floor(log2|x|) from the fp32 exponent bits (values below fp32's normals are far below
    # every FP8 subnormal and take the subnormal spacing through the clamp).
    e = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(min=emin)
    ulp = ((e - fmt.mantissa_bits + 127) << 23).view(torch.float32)
    # One division: exact (a power-of-two divisor), and one pass where the spacing's
    # reciprocal would take three (measured 2x slower on a CPU, and two more kernels in
    # eager CUDA).
    q = x / ulp
    lo = torch.floor(q)
    # rand_like for the default generator: under torch.compile(dynamic=True) `rand` of a
    # symbolic shape fails to trace once a generator argument (even None) is passed;
    # rand_like draws the same numbers from the same generator state.
    if uniform is not None:
        u = uniform
    elif generator is None:
        u = torch.rand_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
    else:
        u = torch.rand(x.shape, dtype=torch.float32, device=x.device, generator=generator)
    return (lo + (u < q - lo).to(torch.float32)) * ulp
