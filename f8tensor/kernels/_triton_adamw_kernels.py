"""The fused AdamW step's Triton kernel (``adamw_step_kernel``, launched by ``triton_adamw.py``).

Loaded as the casts' kernels are (``triton_cast._kernels``: compiled, or interpreted for
CPU tensors), after them: the step's FP8 requantization calls the casts' rounding and
scale helpers of the same variant, one source for both.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl

# The casts' kernels of this file's variant (``..._triton_kernels`` or
# ``..._triton_kernels_interpreted``), which the loader put in sys.modules first.
_casts = sys.modules[__name__.replace("_triton_adamw_kernels", "_triton_kernels")]
_amax, _fp8_bits, _fp32_scale, _scaled = (
    _casts._amax, _casts._fp8_bits, _casts._fp32_scale, _casts._scaled
)  # fmt: skip


@triton.jit
def _bf16_to_fp32(h):
    """int16 bf16 bits (as loaded through an int16 view) -> fp32: the high half, exact."""
    return (h.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _fp32_to_bf16_bits(x):
    """fp32 -> bf16 bits (int32 in int16 range), round to nearest even, as torch's CPU
    conversion: ``(bits + 0x7FFF + lsb) >> 16``; NaN gives ``0x7FC0``."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where(x == x, rounded, 0x7FC0)  # noqa: PLR0124 (the NaN test in triton)


@triton.jit
def _e4m3_to_fp32(b):
    """e4m3fn bytes (int32 in 0..255) -> fp32, exact: normals by re-biasing the exponent,
    subnormals as ``mantissa * 2**-9``, ``0x7F``/``0xFF`` NaN."""
    sign = (b & 0x80) != 0
    e = (b >> 3) & 0xF
    mnt = b & 0x7
    normal = (((e + 120) << 23) | (mnt << 20)).to(tl.float32, bitcast=True)
    sub = mnt.to(tl.float32) * 0.001953125  # 2**-9, exact
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where(sign, -mag, mag)


@triton.jit
def _dequantize_e4m3(b, s):
    """``dequantize``: ``data / scale`` (correctly rounded division), saturated to fp32's
    finite range, NaN kept."""
    hp = tl.div_rn(_e4m3_to_fp32(b), s)
    hp = tl.where(hp > 3.4028234663852886e38, 3.4028234663852886e38, hp)
    return tl.where(hp < -3.4028234663852886e38, -3.4028234663852886e38, hp)


@triton.jit
def _requantize_e4m3(x, ok, u, STOCHASTIC: tl.constexpr, FMAX: tl.constexpr, BIAS: tl.constexpr,
                     MBITS: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    """The block cast of ``x`` ([G, B]: G blocks; ``ok``: the elements that exist): per block
    the amax, the dynamic fp32 scale (``amax_to_scale``'s bits), ``saturate(x * scale)``
    rounded to nearest or stochastically with the draws ``u``. Returns (bytes, scales).
    The amax is that of the block's finite elements; a non-finite element is stored as NaN."""
    finite = tl.abs(x) < float("inf")  # False for NaN too
    s = _fp32_scale(_amax(tl.where(ok & finite, tl.abs(x), 0.0), 1), FMAX, False, EPS)
    y = tl.where(finite, _scaled(x, s[:, None]), float("nan"))
    if STOCHASTIC:
        # ``stochastic_round`` on the clamped product: exact in fp32 (power-of-two spacings).
        y = tl.where(y > FMAX, FMAX, y)
        y = tl.where(y < -FMAX, -FMAX, y)
        EMIN: tl.constexpr = 1 - BIAS
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, EMIN)
        ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
        q = tl.div_rn(y, ulp)
        lo = tl.floor(q)
        y = (lo + (u < q - lo).to(tl.float32)) * ulp
    return _fp8_bits(y, FMAX, BIAS, MBITS, False), s


@triton.jit
def adamw_step_kernel(
    p_ptr, rem_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, mtab_ptr, vtab_ptr, ptab_ptr,
    C, NB, n_blocks, BLK, start, period,
    wd_factor, w1, beta2, value2, bc2, neg_step, eps,
    P_BF16: tl.constexpr, G_BF16: tl.constexpr, STATES: tl.constexpr, MASTER: tl.constexpr,
    HAS_WD: tl.constexpr, LERP_SMALL: tl.constexpr, STOCH_M: tl.constexpr, STOCH_V: tl.constexpr,
    TORCH_CUDA: tl.constexpr,
    FMAX: tl.constexpr, BIAS: tl.constexpr, MBITS: tl.constexpr, EPS: tl.constexpr,
    G: tl.constexpr, B: tl.constexpr,
):  # fmt: skip
    """One AdamW step of one tensor, seen as rows of ``C`` elements cut into blocks of
    ``BLK`` (the last of a row may be short; ``NB`` per row, ``n_blocks`` in all; a flat
    tensor is one row). G blocks per program; every element is read and written once.

    ``STATES``: 0 fp32 moments, 1 bf16 moments (int16 bits), 2 e4m3 moments with one fp32
    scale per block (requantized here: a block never spans two programs). ``MASTER``: 0
    the fp32 result rounded to nearest into a bf16 parameter (or stored into an fp32 one),
    1 rounded stochastically, 2 split into bf16 + int16 remainder. ``TORCH_CUDA``: round
    as torch's CUDA kernels do (see ``triton_adamw``), else as its CPU kernels do. Scalars
    arrive as fp32, as torch converts a Python scalar for an fp32 tensor op."""
    pid = tl.program_id(0)
    blk = pid * G + tl.arange(0, G)
    j = tl.arange(0, B)
    row = (blk // NB).to(tl.int64)
    cols = (blk % NB)[:, None] * BLK + j[None, :]
    ok = (blk < n_blocks)[:, None] & (j < BLK)[None, :] & (cols < C)
    offs = row[:, None] * C + cols.to(tl.int64)

    # The fp32 parameter (or master).
    if P_BF16:
        ph = tl.load(p_ptr + offs, mask=ok, other=0)
        if MASTER == 2:
            low = tl.load(rem_ptr + offs, mask=ok, other=0).to(tl.int32)
            high = (ph.to(tl.int32) - (low < 0).to(tl.int32)) & 0xFFFF
            param = ((high << 16) | (low & 0xFFFF)).to(tl.float32, bitcast=True)
        else:
            param = _bf16_to_fp32(ph)
    else:
        param = tl.load(p_ptr + offs, mask=ok, other=0.0)
    if G_BF16:
        grad = _bf16_to_fp32(tl.load(g_ptr + offs, mask=ok, other=0))
    else:
        grad = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_WD:
        param = param * wd_factor

    if STATES == 2:
        sm = blk < n_blocks
        m = _dequantize_e4m3(tl.load(m_ptr + offs, mask=ok, other=0).to(tl.int32),
                             tl.load(ms_ptr + blk, mask=sm, other=1.0)[:, None])  # fmt: skip
        v = _dequantize_e4m3(tl.load(v_ptr + offs, mask=ok, other=0).to(tl.int32),
                             tl.load(vs_ptr + blk, mask=sm, other=1.0)[:, None])  # fmt: skip
    elif STATES == 1:
        m = _bf16_to_fp32(tl.load(m_ptr + offs, mask=ok, other=0))
        v = _bf16_to_fp32(tl.load(v_ptr + offs, mask=ok, other=0))
    else:
        m = tl.load(m_ptr + offs, mask=ok, other=0.0)
        v = tl.load(v_ptr + offs, mask=ok, other=0.0)

    # torch's ops in torch's order. lerp: one fma on both devices (ATen's vectorized CPU
    # lerp calls fmadd; nvcc contracts the CUDA one); the large-weight branch's (w - 1) is
    # the exact negation of CUDA's (1 - w).
    if LERP_SMALL:
        m = tl.fma(w1, grad - m, m)
    else:
        m = tl.fma(w1 - 1.0, grad - m, grad)
    # mul_(beta2), then addcmul: ``v + (value * g) * g`` with the last multiply-add fused
    # (what both devices' compilers make of ``a + alpha * b * c``).
    v = v * beta2
    v = tl.fma(value2 * grad, grad, v)
    # sqrt, the division by the bias correction (CUDA: a multiply by the fp32 reciprocal,
    # which the host passes as ``bc2``), + eps: three rounded ops, no contraction.
    if TORCH_CUDA:
        denom = tl.sqrt_rn(v) * bc2
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2)
    denom = denom + eps
    # addcdiv: CPU ``p + (s * m) / d``; CUDA ``p + s * (m / d)``, the multiply-add fused.
    if TORCH_CUDA:
        param = tl.fma(neg_step, tl.div_rn(m, denom), param)
    else:
        param = param + tl.div_rn(neg_step * m, denom)

    if STATES == 2:
        flat = start + offs
        idx = flat % period
        um = m  # unread by a nearest rounding
        uv = v
        if STOCH_M:
            um = tl.load(mtab_ptr + idx, mask=ok, other=0.0)
        if STOCH_V:
            uv = tl.load(vtab_ptr + idx, mask=ok, other=0.0)
        code, s = _requantize_e4m3(m, ok, um, STOCH_M, FMAX, BIAS, MBITS, EPS)
        tl.store(m_ptr + offs, code.to(tl.uint8), mask=ok)
        tl.store(ms_ptr + blk, s, mask=sm)
        code, s = _requantize_e4m3(v, ok, uv, STOCH_V, FMAX, BIAS, MBITS, EPS)
        tl.store(v_ptr + offs, code.to(tl.uint8), mask=ok)
        tl.store(vs_ptr + blk, s, mask=sm)
    elif STATES == 1:
        tl.store(m_ptr + offs, _fp32_to_bf16_bits(m).to(tl.int16), mask=ok)
        tl.store(v_ptr + offs, _fp32_to_bf16_bits(v).to(tl.int16), mask=ok)
    else:
        tl.store(m_ptr + offs, m, mask=ok)
        tl.store(v_ptr + offs, v, mask=ok)

    if P_BF16:
        if MASTER == 2:
            bits = param.to(tl.int32, bitcast=True)
            low = bits & 0xFFFF
            high = (bits >> 16) + (low >= 0x8000).to(tl.int32)
            tl.store(p_ptr + offs, high.to(tl.int16), mask=ok)
            tl.store(rem_ptr + offs, low.to(tl.int16), mask=ok)
        elif MASTER == 1:
            u = tl.load(ptab_ptr + (start + offs) % period, mask=ok, other=0.0)
            bits = param.to(tl.int32, bitcast=True)
            bits = (bits + (u * 65536.0).to(tl.int32)) & -65536
            finite = tl.abs(param) < float("inf")
            out = tl.where(finite, bits.to(tl.float32, bitcast=True), param)
            tl.store(p_ptr + offs, _fp32_to_bf16_bits(out).to(tl.int16), mask=ok)
        else:
            tl.store(p_ptr + offs, _fp32_to_bf16_bits(param).to(tl.int16), mask=ok)
    else:
        tl.store(p_ptr + offs, param, mask=ok)
