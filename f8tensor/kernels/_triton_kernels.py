"""The Triton kernels of the fused casts (imported on demand by ``triton_cast.py``).

Every kernel sees a 2D problem ``(R, C)`` with arbitrary strides and writes FP8 data as
``uint8`` bytes computed with integer arithmetic (:func:`_fp8_bits`), not the backend's
conversion. Scale math follows ``scaling.py`` bit for bit (float64 reciprocal, one
rounding to fp32). NaN reads as an infinite magnitude in the amax (both give a NaN
scale), so every max is an ordinary max. No atomics: partial amaxes are reduced in a
fixed order. Loaded at most twice: compiled, and under the Triton interpreter for CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: The canonical positive NaN of fp32, the non-finite scale of ``amax_to_scale``.
NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _fp8_bits(p, FMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr):
    """``saturate(p)`` as FP8 bytes (int32 in 0..255), round to nearest even, as torch converts.

    Normal values re-bias the exponent and round the dropped mantissa bits half to even;
    subnormals shift the full significand to units of the smallest subnormal. NaN is
    ``0x7F`` with the sign (``0x80`` in fnuz); a negative zero is ``0x80``, ``0x00`` in fnuz.
    """
    p = tl.where(p > FMAX, FMAX, p)
    p = tl.where(p < -FMAX, -FMAX, p)
    bits = p.to(tl.int32, bitcast=True)
    neg = bits < 0
    a = bits & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    exp = a >> 23
    SHIFT: tl.constexpr = 23 - MBITS
    # Normal FP8: rebias the exponent, round the low SHIFT bits half to even.
    t = a - ((127 - BIAS) << 23)
    normal = (t + ((1 << (SHIFT - 1)) - 1) + ((t >> SHIFT) & 1)) >> SHIFT
    # Subnormal FP8: value / 2**(1 - BIAS - MBITS) = significand >> s, half to even. For
    # |p| below half the smallest subnormal s >= 25 gives 0 (clamped to 31: no shift past
    # the word; fp32 zeros and subnormals land there too).
    sig = (a & 0x7FFFFF) | 0x800000
    s = (1 - BIAS) - (exp - 127) + SHIFT
    s = tl.minimum(tl.maximum(s, 1), 31)
    sub = (sig + ((1 << (s - 1)) - 1) + ((sig >> s) & 1)) >> s
    code = tl.where(exp >= 128 - BIAS, normal, sub)
    if FNUZ:
        code = tl.where(neg & (code != 0), code | 0x80, code)
        code = tl.where(is_nan, 0x80, code)
    else:
        code = tl.where(neg, code | 0x80, code)
        code = tl.where(is_nan, tl.where(neg, 0xFF, 0x7F), code)
    return code


@triton.jit
def _scaled(x, s):
    """``x * s`` in fp32 (``x`` already fp32). A NaN scale's NaN is the result, as torch's
    CPU multiply gives it whatever ``x`` is (on GPUs every NaN product is the canonical,
    positive NaN, and so is the scale's)."""
    p = x * s
    return tl.where(s != s, s, p)  # noqa: PLR0124 (the NaN test in triton)


@triton.jit
def _magnitude(x):
    """``|x|`` in fp32, NaN read as +inf (see the module docstring)."""
    return tl.where(x == x, tl.abs(x), float("inf"))  # noqa: PLR0124 (the NaN test in triton)


@triton.jit
def _amax(x, axis):
    """The max of magnitudes (no NaN) over ``axis`` (None: all). ``tl.reduce`` (a builtin)
    rather than ``tl.max``: the jit functions of triton's standard library are bound to the
    interpreter setting of their own import, and this file is loaded under both. The
    combine function is the standard library's own, which the interpreter recognizes and
    runs as one numpy reduction (any other runs element by element)."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _fp32_scale(amax, FMAX: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr):
    """``amax_to_scale``: fp32 scale of an fp32 amax (``+inf`` for a non-finite one)."""
    # Deliberate upcast: float64 division is correctly rounded on every backend (PTX
    # div.rn.f64, numpy in the interpreter); the fp32 result is the reference's bits.
    a64 = tl.maximum(amax.to(tl.float64), EPS)
    s = ((1.0 / a64) * FMAX).to(tl.float32)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    nan = tl.full(s.shape, NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(amax < float("inf"), s, nan)


@triton.jit
def _e8m0_byte(amax, FMAX: tl.constexpr, EMAX: tl.constexpr, FLOOR: tl.constexpr, EPS: tl.constexpr):
    """``amax_to_e8m0_scale`` as the e8m0 byte (int32): ``exponent + 127``, 255 for NaN."""
    a64 = tl.maximum(amax.to(tl.float64), EPS)
    if FLOOR:
        # 2**emax / 2**floor(log2(amax)): exact, so only the exponent matters.
        e = EMAX - (((a64.to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32) - 1023)
    else:
        r = (1.0 / a64) * FMAX
        e = ((r.to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32) - 1023
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(amax < float("inf"), e + 127, 255)


@triton.jit
def _e8m0_to_fp32(byte):
    """The fp32 value of an e8m0 byte: ``2**(byte - 127)``; 0 is fp32's subnormal 2**-127;
    255 is NaN."""
    bits = tl.where(byte == 0, 0x400000, byte << 23)
    bits = tl.where(byte == 255, NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp32_inverse(s):
    """torch's fp32 reciprocal of ``s``, correctly rounded: the float64 quotient rounded once
    to fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits: no double
    rounding). The dequantization factor the GEMMs read."""
    return (1.0 / s.to(tl.float64)).to(tl.float32)


@triton.jit
def _e8m0_inverse(byte):
    """The e8m0 byte of ``1 / 2**(byte - 127)``: ``2**(127 - (byte - 127))``, i.e. ``254 -
    byte`` (exact: powers of two); NaN (255) stays NaN."""
    return tl.where(byte == 255, 255, 254 - byte)


# ------------------------------------------------------------------------ tensorwise


@triton.jit
def amax_partials_kernel(
    x_ptr, part_ptr, R, C, sxr, sxc, tiles_c, tiles, tiles_per_prog,
    BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Program ``p``: max |x| over tiles ``p * tiles_per_prog ...`` into ``part[p]``."""
    pid = tl.program_id(0)
    acc = tl.full([BR, BC], 0.0, tl.float32)
    for i in range(tiles_per_prog):
        t = pid * tiles_per_prog + i
        rows = (t // tiles_c) * BR + tl.arange(0, BR)
        cols = (t % tiles_c) * BC + tl.arange(0, BC)
        # Past the last tile (a program's share rounded up): nothing to read.
        rows = tl.where(t < tiles, rows, R)
        m = (rows < R)[:, None] & (cols < C)[None, :]
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * sxr + cols.to(tl.int64)[None, :] * sxc
        x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _magnitude(x))
    tl.store(part_ptr + pid, _amax(acc, None))


@triton.jit
def cast_tensor_kernel(
    x_ptr, part_ptr, n_part, scale_in_ptr, out_ptr, out2_ptr, scale_ptr, inv_ptr,
    R, C, sxr, sxc, sor, soc, s2r, s2c, tiles_c,
    HAS_SCALE: tl.constexpr, WRITE2: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr, EPS: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    """One tile per program: reduce the partials (or read the given scale), scale, cast,
    store the data (and its second layout); program 0 stores the scale (when computed)
    and its inverse, the dequantization factor the GEMMs read."""
    pid = tl.program_id(0)
    if HAS_SCALE:
        s = tl.load(scale_in_ptr)
    else:
        offs = tl.arange(0, BP)
        amax = _amax(tl.load(part_ptr + offs, mask=offs < n_part, other=0.0), None)
        s = _fp32_scale(amax, FMAX, POW2, EPS)
        tl.store(scale_ptr, s, mask=pid == 0)
    tl.store(inv_ptr, _fp32_inverse(s), mask=pid == 0)
    rows = (pid // tiles_c) * BR + tl.arange(0, BR)
    cols = (pid % tiles_c) * BC + tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    x = tl.load(x_ptr + r64 * sxr + c64 * sxc, mask=m, other=0.0).to(tl.float32)
    code = _fp8_bits(_scaled(x, s), FMAX, BIAS, MBITS, FNUZ).to(tl.uint8)
    tl.store(out_ptr + r64 * sor + c64 * soc, code, mask=m)
    if WRITE2:
        tl.store(out2_ptr + r64 * s2r + c64 * s2c, code, mask=m)


# ------------------------------------------------------------------- axiswise (rows)


@triton.jit
def cast_rows_kernel(
    x_ptr, scale_in_ptr, out_ptr, scale_ptr, inv_ptr, R, C, sxr, sxc, sor, soc, ss,
    HAS_SCALE: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr, EPS: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """BR whole rows per program, one fp32 scale per row: an amax pass over the row in BC
    chunks, then the cast pass (the second read of the rows hits the cache)."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    rm = rows < R
    r64 = rows.to(tl.int64)[:, None]
    if HAS_SCALE:
        s = tl.load(scale_in_ptr + rows.to(tl.int64) * ss, mask=rm, other=1.0)
    else:
        acc = tl.full([BR, BC], 0.0, tl.float32)
        for c0 in range(0, C, BC):
            cols = c0 + tl.arange(0, BC)
            m = rm[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + r64 * sxr + cols.to(tl.int64)[None, :] * sxc, mask=m, other=0.0)
            acc = tl.maximum(acc, _magnitude(x.to(tl.float32)))
        s = _fp32_scale(_amax(acc, 1), FMAX, POW2, EPS)
        tl.store(scale_ptr + rows.to(tl.int64) * ss, s, mask=rm)
    tl.store(inv_ptr + rows.to(tl.int64) * ss, _fp32_inverse(s), mask=rm)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        m = rm[:, None] & (cols < C)[None, :]
        c64 = cols.to(tl.int64)[None, :]
        x = tl.load(x_ptr + r64 * sxr + c64 * sxc, mask=m, other=0.0).to(tl.float32)
        code = _fp8_bits(_scaled(x, s[:, None]), FMAX, BIAS, MBITS, FNUZ).to(tl.uint8)
        tl.store(out_ptr + r64 * sor + c64 * soc, code, mask=m)


# ------------------------------------------------------------ 1 x b blocks (groups)


@triton.jit
def _row_offsets(rows, NR, s_outer, s_inner):
    """Element offsets of rows ``rows`` of a 2D problem whose rows are ``(outer, inner)``
    pairs, ``NR`` inner rows per outer one: a dense N-D tensor whose leading dims, in memory
    order, lie partly outside and partly inside the last dim (a 2D view with arbitrary
    strides is ``NR = R``, ``s_outer = 0``)."""
    r64 = rows.to(tl.int64)
    return (r64 // NR) * s_outer + (r64 % NR) * s_inner


@triton.jit
def cast_groups_kernel(
    x_ptr, scale_in_ptr, out_ptr, scale_ptr, inv_ptr, R, C, NB, BLK, NR, sxo, sxr, sxc, soo, sor, soc, sso, ssr, ssc,
    HAS_SCALE: tl.constexpr, E8M0: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr,
    EPS: tl.constexpr, BR: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
):  # fmt: skip
    """BR rows x G blocks of BLK consecutive elements per program (``B``: BLK rounded up to a
    power of two), one read: the per-block amax, scale (fp32, or e8m0 bytes), the cast.
    Rows are addressed as in :func:`_row_offsets` (``NR``, and an outer stride per tensor:
    ``sxo``, ``soo``, ``sso``)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    grp = tl.program_id(1) * G + tl.arange(0, G)
    j = tl.arange(0, B)
    cols = grp[None, :, None] * BLK + j[None, None, :]
    m = (rows < R)[:, None, None] & (j < BLK)[None, None, :] & (cols < C)
    c64 = cols.to(tl.int64)
    x = tl.load(x_ptr + _row_offsets(rows, NR, sxo, sxr)[:, None, None] + c64 * sxc, mask=m, other=0.0).to(tl.float32)
    sm = (rows < R)[:, None] & (grp < NB)[None, :]
    sptr = _row_offsets(rows, NR, sso, ssr)[:, None] + grp.to(tl.int64)[None, :] * ssc
    if HAS_SCALE:
        if E8M0:
            byte = tl.load(scale_in_ptr + sptr, mask=sm, other=127).to(tl.int32)
            s = _e8m0_to_fp32(byte)
        else:
            s = tl.load(scale_in_ptr + sptr, mask=sm, other=1.0)
    else:
        amax = _amax(_magnitude(x), 2)
        if E8M0:
            byte = _e8m0_byte(amax, FMAX, EMAX, FLOOR, EPS)
            tl.store(scale_ptr + sptr, byte.to(tl.uint8), mask=sm)
            s = _e8m0_to_fp32(byte)
        else:
            s = _fp32_scale(amax, FMAX, POW2, EPS)
            tl.store(scale_ptr + sptr, s, mask=sm)
    if E8M0:
        tl.store(inv_ptr + sptr, _e8m0_inverse(byte).to(tl.uint8), mask=sm)
    else:
        tl.store(inv_ptr + sptr, _fp32_inverse(s), mask=sm)
    code = _fp8_bits(_scaled(x, s[:, :, None]), FMAX, BIAS, MBITS, FNUZ).to(tl.uint8)
    tl.store(out_ptr + _row_offsets(rows, NR, soo, sor)[:, None, None] + c64 * soc, code, mask=m)


# -------------------------------------------------------------- br x bc blocks (tiles)


@triton.jit
def cast_tiles_kernel(
    x_ptr, scale_in_ptr, out_ptr, out2_ptr, scale_ptr, inv_ptr, R, C, BLK_R, BLK_C,
    sxr, sxc, sor, soc, s2r, s2c, ssr, ssc,
    HAS_SCALE: tl.constexpr, WRITE2: tl.constexpr, E8M0: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr,
    EPS: tl.constexpr, SUB: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One BLK_R x BLK_C block per program, in SUB-row slabs (``BC``: BLK_C rounded up to a
    power of two): an amax pass, then the cast pass writing the data (and a second
    layout); the block's scale stored once."""
    tr = tl.program_id(0)
    tc = tl.program_id(1)
    jc = tl.arange(0, BC)
    cols = tc * BLK_C + jc
    cm = (jc < BLK_C) & (cols < C)
    c64 = cols.to(tl.int64)[None, :]
    if HAS_SCALE:
        if E8M0:
            byte = tl.load(scale_in_ptr + tr * ssr + tc * ssc).to(tl.int32)
            s = _e8m0_to_fp32(byte)
        else:
            s = tl.load(scale_in_ptr + tr * ssr + tc * ssc)
    else:
        acc = tl.full([SUB, BC], 0.0, tl.float32)
        for r0 in range(0, BLK_R, SUB):
            jr = r0 + tl.arange(0, SUB)
            rows = tr * BLK_R + jr
            m = ((jr < BLK_R) & (rows < R))[:, None] & cm[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxr + c64 * sxc, mask=m, other=0.0)
            acc = tl.maximum(acc, _magnitude(x.to(tl.float32)))
        amax = _amax(acc, None)
        if E8M0:
            byte = _e8m0_byte(amax, FMAX, EMAX, FLOOR, EPS)
            tl.store(scale_ptr + tr * ssr + tc * ssc, byte.to(tl.uint8))
            s = _e8m0_to_fp32(byte)
        else:
            s = _fp32_scale(amax, FMAX, POW2, EPS)
            tl.store(scale_ptr + tr * ssr + tc * ssc, s)
    if E8M0:
        tl.store(inv_ptr + tr * ssr + tc * ssc, _e8m0_inverse(byte).to(tl.uint8))
    else:
        tl.store(inv_ptr + tr * ssr + tc * ssc, _fp32_inverse(s))
    for r0 in range(0, BLK_R, SUB):
        jr = r0 + tl.arange(0, SUB)
        rows = tr * BLK_R + jr
        m = ((jr < BLK_R) & (rows < R))[:, None] & cm[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * sxr + c64 * sxc, mask=m, other=0.0).to(tl.float32)
        code = _fp8_bits(_scaled(x, s), FMAX, BIAS, MBITS, FNUZ).to(tl.uint8)
        tl.store(out_ptr + r64 * sor + c64 * soc, code, mask=m)
        if WRITE2:
            tl.store(out2_ptr + r64 * s2r + c64 * s2c, code, mask=m)


# ------------------------------------------------------- the way back (1 x b blocks)


@triton.jit
def _fp8_to_fp32_bits(
    byte, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr, INF: tl.constexpr, SUB_UNIT: tl.constexpr
):
    """The fp32 bits (int32) of FP8 bytes (int32 in 0..255), exactly, in integer arithmetic:
    normal values re-biased, subnormals through their exact fp32 value, zero and ``-0``;
    NaN as torch's conversion decodes it (the FP8 mantissa in the top mantissa bits; fnuz:
    ``0x7F800001``); ``INF`` (e5m2): an all-ones exponent with a zero mantissa is infinite.
    ``SUB_UNIT``: the smallest subnormal, ``2**(1 - BIAS - MBITS)``."""
    EBITS: tl.constexpr = 7 - MBITS
    EMASK: tl.constexpr = (1 << EBITS) - 1
    MMASK: tl.constexpr = (1 << MBITS) - 1
    sign = (byte & 0x80) << 24
    e = (byte >> MBITS) & EMASK
    m = byte & MMASK
    normal = ((e - BIAS + 127) << 23) | (m << (23 - MBITS))
    # A subnormal is m units of the smallest subnormal: exact in fp32 (a power-of-two multiple).
    sub = (m.to(tl.float32) * SUB_UNIT).to(tl.int32, bitcast=True)
    bits = tl.where(e == 0, sub, normal)
    if FNUZ:
        bits = tl.where(byte == 0x80, 0x7F800001, bits | sign)
    elif INF:
        bits = tl.where(e == EMASK, 0x7F800000 | (m << (23 - MBITS)), bits) | sign
    else:
        bits = tl.where((e == EMASK) & (m == MMASK), 0x7F800000 | (m << (23 - MBITS)), bits) | sign
    return bits


@triton.jit
def _narrow_bits(v, OUT_MBITS: tl.constexpr, OUT_BIAS: tl.constexpr):
    """fp32 values ``v`` (finite ones within the output's range, or infinite, or NaN) as the
    bits (int32) of a 16-bit float with ``OUT_MBITS`` mantissa bits and bias ``OUT_BIAS``
    (bf16: 7, 127; fp16: 10, 15), rounded to nearest even in integer arithmetic (as
    :func:`_fp8_bits`; the interpreter's own float -> bf16 conversion truncates). NaN: bf16's
    ``0x7FC0`` (torch's scalar conversion), fp16's sign and top payload bits (a quiet NaN
    stays quiet)."""
    SHIFT: tl.constexpr = 23 - OUT_MBITS
    EXP_ONES: tl.constexpr = (2 * OUT_BIAS + 1) << OUT_MBITS
    bits = v.to(tl.int32, bitcast=True)
    neg = bits < 0
    a = bits & 0x7FFFFFFF
    exp = a >> 23
    t = a - ((127 - OUT_BIAS) << 23)
    code = (t + ((1 << (SHIFT - 1)) - 1) + ((t >> SHIFT) & 1)) >> SHIFT
    if OUT_BIAS != 127:
        # Below the output's normal range (bf16 has fp32's: its subnormals, zeros included,
        # are the normal formula's): the full significand in units of its smallest
        # subnormal, half to even (fp32 zeros and subnormals shift to 0).
        sig = (a & 0x7FFFFF) | 0x800000
        s = (1 - OUT_BIAS) - (exp - 127) + SHIFT
        s = tl.minimum(tl.maximum(s, 1), 31)
        sub = (sig + ((1 << (s - 1)) - 1) + ((sig >> s) & 1)) >> s
        code = tl.where(exp >= 128 - OUT_BIAS, code, sub)
    code = tl.where(a == 0x7F800000, EXP_ONES, code)
    if OUT_BIAS == 127:
        code = tl.where(neg, code | 0x8000, code)
        code = tl.where(a > 0x7F800000, 0x7FC0, code)
    else:
        code = tl.where(a > 0x7F800000, EXP_ONES | ((a >> SHIFT) & ((1 << OUT_MBITS) - 1)), code)
        code = tl.where(neg, code | 0x8000, code)
    return code


@triton.jit
def dequantize_groups_kernel(
    d_ptr, s_ptr, o_ptr, R, C, NB, BLK, NR,
    sdo, sdi, sdc, sso, ssi, ssc, soo, soi, soc,
    BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr, INF: tl.constexpr, SUB_UNIT: tl.constexpr,
    OUT: tl.constexpr, LIMIT: tl.constexpr,
    BR: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
):  # fmt: skip
    """``reference.dequantize`` of 1 x BLK blocks: BR rows x G blocks per program, one read
    of the FP8 bytes and of each block's fp32 scale: ``data / scale`` (the correctly rounded
    fp32 quotient: the float64 quotient rounded once, 53 >= 2 * 24 + 2 bits), clamped to
    ``[-LIMIT, LIMIT]`` (the output dtype's finite range; NaN kept), an FP8 infinity kept
    (``INF``), stored in the output dtype (``OUT``: 0 fp32, 1 bf16, 2 fp16; 16-bit outputs
    as integer bits). NaN: a NaN byte's decoded NaN made quiet, else a NaN scale's bits: the
    operand x86 division propagates (what the reference gives on CPU)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    grp = tl.program_id(1) * G + tl.arange(0, G)
    j = tl.arange(0, B)
    cols = grp[None, :, None] * BLK + j[None, None, :]
    m = (rows < R)[:, None, None] & (j < BLK)[None, None, :] & (cols < C)
    c64 = cols.to(tl.int64)
    byte = tl.load(d_ptr + _row_offsets(rows, NR, sdo, sdi)[:, None, None] + c64 * sdc, mask=m, other=0)
    bits = _fp8_to_fp32_bits(byte.to(tl.int32), BIAS, MBITS, FNUZ, INF, SUB_UNIT)
    x = bits.to(tl.float32, bitcast=True)
    sm = (rows < R)[:, None] & (grp < NB)[None, :]
    s = tl.load(s_ptr + _row_offsets(rows, NR, sso, ssi)[:, None] + grp.to(tl.int64)[None, :] * ssc, mask=sm, other=1.0)
    s = s[:, :, None]
    # Deliberate upcast: float64 division is correctly rounded on every backend; rounded once
    # to fp32 it is the fp32 quotient torch computes.
    q = (x.to(tl.float64) / s.to(tl.float64)).to(tl.float32)
    q = tl.where(q > LIMIT, LIMIT, q)
    q = tl.where(q < -LIMIT, -LIMIT, q)
    x_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    s_bits = s.to(tl.int32, bitcast=True)
    q = tl.where(s != s, (s_bits | 0x400000).to(tl.float32, bitcast=True), q)  # noqa: PLR0124
    q = tl.where(x_nan, (bits | 0x400000).to(tl.float32, bitcast=True), q)
    if INF:
        q = tl.where((bits & 0x7FFFFFFF) == 0x7F800000, x, q)
    o_off = _row_offsets(rows, NR, soo, soi)[:, None, None] + c64 * soc
    if OUT == 0:
        tl.store(o_ptr + o_off, q, mask=m)
    elif OUT == 1:
        tl.store(o_ptr + o_off, _narrow_bits(q, 7, 127).to(tl.int16), mask=m)
    else:
        tl.store(o_ptr + o_off, _narrow_bits(q, 10, 15).to(tl.int16), mask=m)
