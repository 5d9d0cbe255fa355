"""Property-based fuzzing of the cast over shapes, dtypes, formats, granularities and value ranges.

Values are drawn from a seeded torch generator (Hypothesis picks the seed, the regime and
everything else), so each example is a whole tensor and shrinking still works on the knobs.
"""

from __future__ import annotations

import torch
from helpers import GRANULARITIES, HP_DTYPES
from hypothesis import given, settings
from hypothesis import strategies as st

from f8tensor import FLOAT8_DTYPES, FORMATS, Float8Tensor
from f8tensor.quant.scaling import EPS

# fp32 rounding in x * scale and data / scale, relative.
FP32_SLACK = 2.0**-21

shapes = st.one_of(
    st.tuples(st.integers(1, 64), st.integers(1, 64)),
    st.tuples(st.integers(1, 4), st.integers(1, 16), st.integers(1, 64)),
)
REGIMES = ("normal", "tiny", "wide", "huge", "zeros", "sparse")


def _values(shape, hp_dtype, regime: str, sign: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    hp_max = torch.finfo(hp_dtype).max
    if regime == "normal":
        x = x * 10.0 ** torch.empty(()).uniform_(-3, 3, generator=g)
    elif regime == "tiny":
        # fp16: mostly subnormals; bf16/fp32: around 1e-32, below EPS (flushed, but must stay sane).
        x = x * (1e-6 if hp_dtype == torch.float16 else 1e-32)
    elif regime == "wide":
        x = x * torch.exp(torch.empty(shape).uniform_(-12, 12, generator=g))
    elif regime == "huge":
        # Up to half the dtype's max: dequantizing a saturated value (max / scale) then
        # stays in range whatever way the fp32 scale was rounded (test_cast covers max itself).
        x = (x * hp_max / 16).clamp(-hp_max / 2, hp_max / 2)
    elif regime == "zeros":
        x = torch.zeros(shape)
    elif regime == "sparse":
        x = x * (torch.rand(shape, generator=g) < 0.2)
    if sign == "positive":
        x = x.abs()
    elif sign == "negative":
        x = -x.abs()
    x = x.clamp(-hp_max, hp_max).to(hp_dtype)
    assert torch.isfinite(x).all()
    return x


def _amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    x = x.float().abs()
    return x.amax() if granularity == "tensorwise" else x.amax(dim=-1, keepdim=True)


def _check_cast_invariants(x: torch.Tensor, x8: Float8Tensor, float8_dtype: torch.dtype) -> None:
    fmt = FORMATS[float8_dtype]
    xf = x.float()
    data = x8._data.float()
    scale = x8._scale

    # Finite input: finite data and a finite, positive scale.
    assert torch.isfinite(scale).all() and (scale > 0).all(), scale
    assert torch.isfinite(data).all()
    assert (data.abs() <= fmt.max).all()

    # Zeros stay zero; nonzero data keeps the sign of the input.
    zero = xf == 0
    assert (data[zero] == 0).all() and (x8.to_hp()[zero] == 0).all()
    nonzero = data != 0
    assert (torch.sign(data[nonzero]) == torch.sign(xf.expand_as(data)[nonzero])).all()

    deq = data / scale  # fp32 dequantization
    scaled = (xf * scale).abs()
    normal = (scaled >= fmt.smallest_normal) & (scaled <= fmt.max)
    # Normal range: relative error within half an ulp of the format.
    err = (deq - xf).abs()
    bound = xf.abs() * (fmt.eps / 2 + FP32_SLACK)
    assert (err[normal] <= bound[normal]).all(), f"max rel err {(err / xf.abs())[normal].max().item()}"
    # Subnormal range: absolute error within half the smallest subnormal, in the scaled
    # domain (plus fp32 rounding, which is relative to the operands, not to the error).
    sub = scaled < fmt.smallest_normal
    sub_bound = fmt.smallest_subnormal / 2 + scaled * FP32_SLACK
    assert ((err * scale)[sub] <= sub_bound[sub]).all()


@settings(max_examples=500, deadline=None)
@given(
    shape=shapes,
    hp_dtype=st.sampled_from(HP_DTYPES),
    float8_dtype=st.sampled_from(FLOAT8_DTYPES),
    granularity=st.sampled_from(GRANULARITIES),
    regime=st.sampled_from(REGIMES),
    sign=st.sampled_from(["mixed", "positive", "negative"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dynamic_cast_invariants(shape, hp_dtype, float8_dtype, granularity, regime, sign, seed):
    x = _values(shape, hp_dtype, regime, sign, seed)
    x8 = Float8Tensor.from_hp(x, float8_dtype, granularity=granularity)
    assert x8.shape == x.shape and x8.dtype == hp_dtype and x8._data.dtype == float8_dtype
    _check_cast_invariants(x, x8, float8_dtype)

    fmt = FORMATS[float8_dtype]
    amax = _amax(x, granularity)
    back = x8.to_hp()
    assert back.dtype == hp_dtype and torch.isfinite(back).all()
    # Never larger than the largest input (per tensor or per row), up to fp32 rounding,
    # when the scale maps amax onto the format's max. Below EPS the scale is capped, so
    # amax lands inside the range and may round up by half an FP8 step: relative eps/2
    # among normals, half the subnormal spacing below them.
    below = amax < EPS
    bound = amax * (1 + torch.where(below, fmt.eps, FP32_SLACK))
    bound = bound + below * (fmt.smallest_subnormal / x8._scale)
    assert (back.float().abs() <= bound).all()
    # The dynamic scale puts the largest magnitude exactly on the format's max.
    data_amax = _amax(x8._data, granularity)
    usable = amax >= EPS
    assert (data_amax[usable] == fmt.max).all(), (data_amax, amax)


@settings(max_examples=400, deadline=None)
@given(
    shape=shapes,
    hp_dtype=st.sampled_from(HP_DTYPES),
    float8_dtype=st.sampled_from(FLOAT8_DTYPES),
    granularity=st.sampled_from(GRANULARITIES),
    regime=st.sampled_from(REGIMES),
    sign=st.sampled_from(["mixed", "positive", "negative"]),
    headroom_log2=st.integers(-6, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_explicit_scale_invariants(shape, hp_dtype, float8_dtype, granularity, regime, sign, headroom_log2, seed):
    # A scale that maps amax to max * 2**headroom_log2: positive headroom pushes values
    # beyond the range (they must saturate to exactly +-max), negative leaves room.
    x = _values(shape, hp_dtype, regime, sign, seed)
    fmt = FORMATS[float8_dtype]
    raw_amax = _amax(x, granularity)
    amax = raw_amax.clamp(min=1e-30)
    scale = (fmt.max / amax * 2.0**headroom_log2).to(torch.float32)  # <= 448e30 * 64: finite
    scale_arg = scale.reshape(()) if granularity == "tensorwise" else scale
    x8 = Float8Tensor.from_hp(x, float8_dtype, granularity=granularity, scale=scale_arg)
    assert torch.equal(x8._scale, scale_arg)
    _check_cast_invariants(x, x8, float8_dtype)

    data = x8._data.float()
    beyond = (x.float() * scale).abs() > fmt.max
    expected = torch.sign(x.float()).expand_as(data) * fmt.max
    assert (data[beyond] == expected[beyond]).all()
    if headroom_log2 > 0 and bool((raw_amax >= 1e-30).any()):
        assert bool(beyond.any())  # the largest magnitude was pushed past the max


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 32), st.integers(1, 32)),
    hp_dtype=st.sampled_from(HP_DTYPES),
    float8_dtype=st.sampled_from(FLOAT8_DTYPES),
    granularity=st.sampled_from(GRANULARITIES),
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    explicit_scale=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_non_finite_never_looks_finite(shape, hp_dtype, float8_dtype, granularity, bad, explicit_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    poisoned = torch.rand(shape, generator=g) < 0.1
    poisoned.view(-1)[torch.randint(0, x.numel(), (1,), generator=g)] = True
    x = x.masked_fill(poisoned, bad).to(hp_dtype)

    if explicit_scale:
        scale = 2.0 if granularity == "tensorwise" else torch.full((shape[0], 1), 2.0)
        x8 = Float8Tensor.from_hp(x, float8_dtype, granularity=granularity, scale=scale)
        # Exactly the non-finite elements are NaN; everything else is finite.
        assert torch.equal(x8._data.float().isnan(), poisoned)
        assert torch.equal(x8.to_hp().isnan(), poisoned)
        return

    x8 = Float8Tensor.from_hp(x, float8_dtype, granularity=granularity)
    back = x8.to_hp()
    if granularity == "tensorwise":
        assert back.isnan().all()
    else:
        bad_rows = poisoned.any(dim=-1)
        assert back[bad_rows].isnan().all()
        assert torch.isfinite(back[~bad_rows]).all()
