"""The column-wise cast's Triton kernels: one fp32 scale per column of an ``(R, C)`` problem.

Loaded as the casts' kernels are (``triton_cast._kernels``: compiled, or interpreted for
CPU tensors), after them, and built from their rounding and scale helpers of the same
variant. Tiles run along the columns (the input's inner dim) so that both passes read
whole rows; ``R`` is cut into splits of whole tiles so that every pass has programs for
every column tile and split: ``col_amax_kernel`` writes one partial amax per (split,
column), ``cast_cols_kernel`` reduces a column's partials (max: exact, in any order),
stores the scale and its inverse (split 0) and writes its split's FP8 bytes through the
output's strides (column-major for the weight-gradient GEMM). With one split the cast
kernel measures the amax itself: one launch.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl

# The casts' kernels of this file's variant, which the loader put in sys.modules first.
_casts = sys.modules[__name__.replace("_triton_col_kernels", "_triton_kernels")]
_amax, _fp8_bits, _fp32_inverse, _fp32_scale, _magnitude, _scaled = (
    _casts._amax, _casts._fp8_bits, _casts._fp32_inverse, _casts._fp32_scale, _casts._magnitude, _casts._scaled
)  # fmt: skip


@triton.jit
def _split_amax(x_ptr, R, cols, cm, r_begin, n_rows, sxr, sxc, BR: tl.constexpr, BC: tl.constexpr):
    """The max magnitude of each of ``cols`` over rows ``r_begin ... r_begin + n_rows``
    (``n_rows``: a multiple of BR; rows past ``R`` read nothing)."""
    c64 = cols.to(tl.int64)[None, :]
    acc = tl.full([BR, BC], 0.0, tl.float32)
    for r0 in range(0, n_rows, BR):
        rows = r_begin + r0 + tl.arange(0, BR)
        m = (rows < R)[:, None] & cm[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxr + c64 * sxc, mask=m, other=0.0)
        acc = tl.maximum(acc, _magnitude(x.to(tl.float32)))
    return _amax(acc, 0)


@triton.jit
def col_amax_kernel(x_ptr, part_ptr, R, C, rows_per_split, sxr, sxc, BR: tl.constexpr, BC: tl.constexpr):
    """Program ``(split, t)``: the max |x| of column tile ``t`` over the split's rows, into
    ``part[split, cols]`` (a contiguous ``(splits, C)`` fp32 buffer)."""
    split = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols < C
    amax = _split_amax(x_ptr, R, cols, cm, split * rows_per_split, rows_per_split, sxr, sxc, BR, BC)
    tl.store(part_ptr + split.to(tl.int64) * C + cols, amax, mask=cm)


@triton.jit
def cast_cols_kernel(
    x_ptr, part_ptr, n_split, scale_in_ptr, out_ptr, scale_ptr, inv_ptr, R, C, rows_per_split,
    sxr, sxc, sor, soc, ss,
    HAS_SCALE: tl.constexpr, MEASURE: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, FNUZ: tl.constexpr, EPS: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    """Program ``(split, t)``: column tile ``t``'s scales (given; else from the ``n_split``
    partials, or measured here over all rows with ``MEASURE``: one split), split 0 storing
    the scales and their inverses, then the split's rows scaled, cast and stored."""
    split = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols < C
    sptr = cols.to(tl.int64) * ss
    if HAS_SCALE:
        s = tl.load(scale_in_ptr + sptr, mask=cm, other=1.0)
    else:
        if MEASURE:
            amax = _split_amax(x_ptr, R, cols, cm, 0, rows_per_split, sxr, sxc, BR, BC)
        else:
            p = tl.arange(0, BP)
            pm = (p < n_split)[:, None] & cm[None, :]
            parts = tl.load(part_ptr + p.to(tl.int64)[:, None] * C + cols[None, :], mask=pm, other=0.0)
            amax = _amax(parts, 0)
        s = _fp32_scale(amax, FMAX, POW2, EPS)
        if split == 0:
            tl.store(scale_ptr + sptr, s, mask=cm)
    if split == 0:
        tl.store(inv_ptr + sptr, _fp32_inverse(s), mask=cm)
    c64 = cols.to(tl.int64)[None, :]
    for r0 in range(0, rows_per_split, BR):
        rows = split * rows_per_split + r0 + tl.arange(0, BR)
        m = (rows < R)[:, None] & cm[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * sxr + c64 * sxc, mask=m, other=0.0).to(tl.float32)
        code = _fp8_bits(_scaled(x, s[None, :]), FMAX, BIAS, MBITS, FNUZ).to(tl.uint8)
        tl.store(out_ptr + r64 * sor + c64 * soc, code, mask=m)
