"""from_hp / to_hp: round-trip accuracy, guards on awkward inputs, clear errors, autograd, repr."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    CAST_MIN_DB,
    GRANULARITIES,
    HP_DTYPES,
    assert_consistent,
    assert_sqnr,
    bits,
    dtype_name,
)

from f8tensor import FLOAT8_DTYPES, FORMATS, Float8Tensor, GemmConfig, Granularity

try:
    from expecttest import assert_expected_inline
except ImportError:  # expecttest absent (a GPU machine's stock Python): only the repr tests skip

    def assert_expected_inline(*args, **kwargs):
        pytest.skip("expecttest is not installed")

# ----------------------------------------------------------------------------- numerics


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_round_trip_sqnr(float8_dtype, hp_dtype, granularity):
    # Thresholds: e4m3 (fn, fnuz) >= 28 dB, e5m2 (and fnuz) >= 22 dB.
    min_db = CAST_MIN_DB[float8_dtype]
    hp = torch.randn(64, 128, dtype=hp_dtype)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    assert_consistent(x8)
    assert x8.float8_dtype == float8_dtype
    back = x8.to_hp()
    assert type(back) is torch.Tensor and back.dtype == hp_dtype
    assert_sqnr(hp, back, min_db)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_round_trip_sqnr_3d(float8_dtype, granularity):
    min_db = CAST_MIN_DB[float8_dtype]
    hp = torch.randn(4, 16, 32, dtype=torch.bfloat16)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    assert_consistent(x8)
    assert x8.axiswise_dim == (None if granularity == "tensorwise" else 2)
    assert_sqnr(hp, x8.to_hp(), min_db)


def test_rowwise_uses_one_scale_per_row():
    # Rows of very different magnitude: rowwise keeps each row accurate, tensorwise cannot.
    hp = torch.randn(8, 64) * torch.logspace(-6, 2, 8).unsqueeze(1)
    row8 = Float8Tensor.from_hp(hp, granularity="rowwise")
    ten8 = Float8Tensor.from_hp(hp, granularity=Granularity.TENSORWISE)
    assert row8.granularity is Granularity.ROWWISE and ten8.granularity is Granularity.TENSORWISE
    assert row8._scale.shape == (8, 1)
    for i in range(8):
        assert_sqnr(hp[i], row8.to_hp()[i], 28.0, f"rowwise row {i}")
    # The smallest row underflows almost entirely with one scale for the tensor.
    assert float(torch.count_nonzero(ten8._data[0].float())) < 64


@pytest.mark.parametrize("out_dtype", HP_DTYPES, ids=dtype_name)
def test_to_hp_with_dtype(out_dtype):
    hp = torch.randn(16, 16, dtype=torch.bfloat16)
    x8 = Float8Tensor.from_hp(hp)
    back = x8.to_hp(out_dtype)
    assert back.dtype == out_dtype
    assert torch.equal(back, (x8._data.float() / x8._scale).to(out_dtype))


# ----------------------------------------------------------------------------- guards


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_all_zero_input(float8_dtype, hp_dtype, granularity):
    hp = torch.zeros(8, 16, dtype=hp_dtype)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    assert torch.isfinite(x8._scale).all() and (x8._scale > 0).all()
    assert (x8._data.float() == 0).all()
    back = x8.to_hp()
    assert back.dtype == hp_dtype
    assert (back == 0).all() and not back.isnan().any()


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_fp16_tiny_amax_gives_finite_scale(float8_dtype, granularity):
    # 6e-8 rounds to fp16's smallest subnormal, 2**-24.
    hp = torch.full((4, 16), 6e-8, dtype=torch.float16)
    assert hp[0, 0].item() == 2.0**-24
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    assert torch.isfinite(x8._scale).all()
    assert torch.isfinite(x8._data.float()).all()
    # Scaled onto the format's max, the subnormal comes back exactly.
    assert torch.equal(x8.to_hp(), hp)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_fp16_subnormal_mix_round_trip(float8_dtype, granularity):
    hp = (torch.randn(64, 64) * 1e-5).to(torch.float16)  # mostly fp16 subnormals
    assert (hp.abs() < torch.finfo(torch.float16).smallest_normal).float().mean() > 0.5
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    assert torch.isfinite(x8._scale).all()
    assert_sqnr(hp, x8.to_hp(), CAST_MIN_DB[float8_dtype])


@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_largest_finite_input_round_trips_finite(float8_dtype, hp_dtype):
    hp_max = torch.finfo(hp_dtype).max
    hp = torch.tensor([hp_max, -hp_max, 1.0], dtype=hp_dtype)
    x8 = Float8Tensor.from_hp(hp, float8_dtype)
    assert torch.isfinite(x8._scale)
    back = x8.to_hp()
    assert torch.isfinite(back).all()
    assert back[:2].tolist() == [hp_max, -hp_max]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_non_finite_input_dynamic_tensorwise_is_all_nan(float8_dtype, bad):
    hp = torch.randn(8, 16, dtype=torch.bfloat16)
    hp[3, 5] = bad
    x8 = Float8Tensor.from_hp(hp, float8_dtype)
    # One scale for the tensor, and it is NaN: nothing finite-looking comes out.
    assert x8._scale.isnan()
    assert x8.to_hp().isnan().all()


@pytest.mark.device_param
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_non_finite_input_dynamic_rowwise_poisons_its_row(float8_dtype, bad):
    hp = torch.randn(8, 16, dtype=torch.bfloat16)
    clean = Float8Tensor.from_hp(hp, float8_dtype, granularity="rowwise")
    hp[3, 5] = bad
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity="rowwise")
    back = x8.to_hp()
    # The row holding the bad value is entirely NaN (its scale is NaN) ...
    assert x8._scale[3].isnan().all()
    assert back[3].isnan().all()
    # ... and every other row is exactly what a clean cast gives.
    others = [i for i in range(8) if i != 3]
    assert torch.equal(back[others], clean.to_hp()[others])


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_non_finite_input_explicit_scale_stays_nan(float8_dtype, bad, granularity):
    hp = torch.randn(4, 16)
    hp[1, 2] = bad
    scale = 2.0 if granularity == "tensorwise" else torch.full((4, 1), 2.0)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity, scale=scale)
    back = x8.to_hp()
    # inf must not become a finite max: the element reads back as NaN.
    assert back[1, 2].isnan()
    assert x8._data[1, 2].float().isnan()
    finite = torch.isfinite(hp)
    assert torch.isfinite(back[finite]).all()


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_power_of_2_scale(float8_dtype, hp_dtype, granularity):
    hp = (torch.randn(16, 32) * torch.logspace(-3, 3, 16).unsqueeze(1)).to(hp_dtype)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity, power_of_2_scale=True)
    mantissa, _ = torch.frexp(x8._scale)
    assert (mantissa == 0.5).all(), f"not powers of two: {x8._scale.flatten().tolist()}"
    # Rounded down, never up: the largest magnitude stays inside the range.
    exact = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    assert (x8._scale <= exact._scale).all() and (x8._scale > exact._scale / 2).all()
    assert_sqnr(hp, x8.to_hp(), CAST_MIN_DB[float8_dtype])


def test_power_of_2_scale_all_zero_is_finite():
    x8 = Float8Tensor.from_hp(torch.zeros(4, 4), power_of_2_scale=True)
    assert torch.isfinite(x8._scale) and torch.frexp(x8._scale).mantissa == 0.5
    assert (x8.to_hp() == 0).all()


# ----------------------------------------------------------------------------- errors

BAD_INPUT_DTYPES = [torch.int32, torch.int64, torch.bool, torch.complex64, torch.float64]


@pytest.mark.parametrize("dtype", BAD_INPUT_DTYPES, ids=dtype_name)
def test_non_hp_input_dtype_raises(dtype):
    hp = torch.ones(4, 4).to(dtype)
    assert hp.dtype == dtype
    with pytest.raises(TypeError, match=rf"high-precision floating dtype.*got {dtype}"):
        Float8Tensor.from_hp(hp)


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_fp8_input_raises(dtype):
    hp = torch.ones(4, 4).to(dtype)
    with pytest.raises(TypeError, match=rf"high-precision floating dtype.*got {dtype}"):
        Float8Tensor.from_hp(hp)


def test_float8tensor_input_raises():
    x8 = Float8Tensor.from_hp(torch.randn(4, 4))
    with pytest.raises(TypeError, match=r"got a Float8Tensor \(call \.to_hp\(\) first\)"):
        Float8Tensor.from_hp(x8)


def test_non_tensor_input_raises():
    with pytest.raises(TypeError, match=r"from_hp expects a torch.Tensor; got list"):
        Float8Tensor.from_hp([1.0, 2.0])


@pytest.mark.parametrize("bad", [torch.float16, torch.int8, "e4m3", None])
def test_bad_float8_dtype_raises(bad):
    hp = torch.randn(4, 4)
    with pytest.raises(TypeError, match=r"float8_dtype must be one of torch.float8_e4m3fn"):
        Float8Tensor.from_hp(hp, bad)


@pytest.mark.parametrize("bad", ["colwise", "blockwise", 1, None])
def test_bad_granularity_raises(bad):
    hp = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"granularity must be one of 'tensorwise', 'rowwise'"):
        Float8Tensor.from_hp(hp, granularity=bad)


def test_rowwise_0d_raises():
    hp = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"rowwise scaling needs at least one dimension"):
        Float8Tensor.from_hp(hp, granularity="rowwise")


def test_tensorwise_scale_wrong_shape_raises():
    hp, scale = torch.randn(4, 8), torch.ones(4)
    with pytest.raises(ValueError, match=r"a tensorwise scale has one element; got shape \(4,\)"):
        Float8Tensor.from_hp(hp, scale=scale)


@pytest.mark.parametrize("bad_shape", [(4,), (1, 8), (4, 8), (2, 1)])
def test_rowwise_scale_wrong_shape_raises(bad_shape):
    hp, scale = torch.randn(4, 8), torch.ones(bad_shape)
    with pytest.raises(ValueError, match=r"rowwise scale for shape \(4, 8\) must have shape \(4, 1\)"):
        Float8Tensor.from_hp(hp, granularity="rowwise", scale=scale)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32], ids=dtype_name)
def test_scale_wrong_dtype_raises(dtype):
    hp, scale = torch.randn(4, 8), torch.ones((), dtype=dtype)
    with pytest.raises(TypeError, match=rf"scale must be float32; got {dtype}"):
        Float8Tensor.from_hp(hp, scale=scale)


@pytest.mark.parametrize("bad", [True, "2.0"])
def test_scale_wrong_python_type_raises(bad):
    hp = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"scale must be a float or an fp32 tensor"):
        Float8Tensor.from_hp(hp, scale=bad)


def test_bad_gemm_config_type_raises():
    hp, config = torch.randn(4, 8), {"out_dtype": torch.float32}
    with pytest.raises(TypeError, match=r"gemm_config must be a GemmConfig; got dict"):
        Float8Tensor.from_hp(hp, gemm_config=config)


def test_to_hp_bad_dtype_raises():
    x8 = Float8Tensor.from_hp(torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"to_hp dtype must have a high-precision floating dtype"):
        x8.to_hp(torch.float64)


@pytest.mark.device_param
def test_explicit_scale_is_used_as_given():
    hp = torch.randn(4, 8)
    scale = torch.tensor(3.0)
    x8 = Float8Tensor.from_hp(hp, scale=scale, gemm_config=GemmConfig(out_dtype=torch.float32))
    assert x8._scale.item() == 3.0
    assert x8.gemm_config == GemmConfig(out_dtype=torch.float32)
    assert torch.equal(bits(x8._data), bits((hp * 3.0).to(torch.float8_e4m3fn)))


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
def test_from_hp_to_hp_gradient_passes_through(hp_dtype, granularity):
    hp = torch.randn(8, 16, dtype=hp_dtype, requires_grad=True)
    upstream = torch.randn(8, 16, dtype=hp_dtype)
    x8 = Float8Tensor.from_hp(hp, granularity=granularity)
    assert x8.requires_grad
    x8.to_hp().backward(upstream)
    assert hp.grad.dtype == hp_dtype
    assert torch.equal(hp.grad, upstream)


def test_gradient_passes_through_explicit_scale():
    hp = torch.randn(8, 16, requires_grad=True)
    upstream = torch.randn(8, 16)
    Float8Tensor.from_hp(hp, scale=1e-3).to_hp().backward(upstream)  # everything saturates
    assert torch.equal(hp.grad, upstream)


# ----------------------------------------------------------------------------- repr


def _fixed() -> torch.Tensor:
    return torch.arange(-6, 6, dtype=torch.bfloat16).reshape(3, 4)


def test_repr_tensorwise():
    x8 = Float8Tensor.from_hp(_fixed())
    assert_expected_inline(
        repr(x8), """Float8Tensor(float8_e4m3fn, shape=(3, 4), orig_dtype=torch.bfloat16, tensorwise, scale=74.6667)"""
    )


def test_repr_rowwise():
    x8 = Float8Tensor.from_hp(_fixed(), torch.float8_e5m2, granularity="rowwise")
    assert_expected_inline(
        repr(x8),
        """Float8Tensor(float8_e5m2, shape=(3, 4), orig_dtype=torch.bfloat16, axiswise(dim=1), scale_shape=(3, 1))""",
    )


def test_repr_requires_grad():
    x8 = Float8Tensor.from_hp(_fixed().float().requires_grad_(), torch.float8_e4m3fnuz)
    assert_expected_inline(
        repr(x8),
        """Float8Tensor(float8_e4m3fnuz, shape=(3, 4), orig_dtype=torch.float32, tensorwise, scale=40, requires_grad=True)""",
    )


def test_scale_value_in_repr_matches_max_over_amax():
    x8 = Float8Tensor.from_hp(_fixed())
    assert math.isclose(x8._scale.item(), FORMATS[torch.float8_e4m3fn].max / 6.0, rel_tol=1e-7)


def test_repr_transposed_rowwise_3d():
    x8 = Float8Tensor.from_hp(_fixed().reshape(1, 3, 4), granularity="rowwise").transpose(1, 2)
    assert_expected_inline(
        repr(x8),
        """Float8Tensor(float8_e4m3fn, shape=(1, 4, 3), orig_dtype=torch.bfloat16, axiswise(dim=1), scale_shape=(1, 1, 3))""",
    )


@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 33), (1, 5), (5, 1), (3, 4, 16)])
def test_axiswise_amax_matches_one_pass_aminmax(hp_dtype, shape):
    # tensor_amax takes amin and amax separately along a dim on CPU (faster there than
    # aminmax): the same bits as the one-pass reduction, NaN, inf, -0.0 and zero rows included.
    from f8tensor.quant.scaling import tensor_amax

    x = (torch.randn(shape) * 10).to(hp_dtype)
    flat = x.view(-1)
    flat[0], flat[1], flat[-1] = float("nan"), -0.0, float("-inf")
    if shape[0] > 2:
        x[1].zero_()
    for dim in range(x.dim()):
        lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
        expected = torch.maximum(hi, lo.neg()).to(torch.float32)
        got = tensor_amax(x, dim)
        assert got.shape == expected.shape
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), dim
