"""The four FP8 formats: their numbers, saturation, and the scale rule on hand-made tensors."""

from __future__ import annotations

import pytest
import torch
from helpers import GRANULARITIES, HP_DTYPES, bits, dtype_name, reference_cast

from f8tensor import FLOAT8_DTYPES, FORMATS, Float8Tensor, GemmConfig, float8_max

EXPECTED_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.float8_e4m3fnuz: 240.0,
    torch.float8_e5m2fnuz: 57344.0,
}


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_each_format_has_its_own_max(float8_dtype):
    expected = EXPECTED_MAX[float8_dtype]
    assert FORMATS[float8_dtype].max == expected
    assert float8_max(float8_dtype) == expected
    # The max is representable: it survives a round trip through the format.
    assert torch.tensor(expected).to(float8_dtype).float().item() == expected


def test_formats_cover_the_four_dtypes():
    assert set(FORMATS) == set(FLOAT8_DTYPES) == set(EXPECTED_MAX)
    assert [FORMATS[d].name for d in FLOAT8_DTYPES] == [
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    ]


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_eps_is_the_spacing_above_one(float8_dtype):
    eps = FORMATS[float8_dtype].eps
    one_up = torch.tensor(1.0 + eps).to(float8_dtype).float().item()
    assert one_up == 1.0 + eps, f"1 + eps = {1.0 + eps} is not representable in {float8_dtype}"
    # Half an eps above one is a tie and rounds to even, i.e. back to 1.
    assert torch.tensor(1.0 + eps / 2).to(float8_dtype).float().item() == 1.0


def test_e5m2fnuz_eps_is_the_real_spacing():
    # torch.finfo(torch.float8_e5m2fnuz).eps reports 0.125 (torch 2.13), but 1.125 is not an
    # e5m2fnuz number: the spacing above 1 is 0.25, and FORMATS says so.
    assert FORMATS[torch.float8_e5m2fnuz].eps == 0.25
    assert torch.tensor(1.125).to(torch.float8_e5m2fnuz).float().item() != 1.125
    assert torch.tensor(1.25).to(torch.float8_e5m2fnuz).float().item() == 1.25


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_smallest_normal_and_subnormal_are_representable(float8_dtype):
    fmt = FORMATS[float8_dtype]
    for value in (fmt.smallest_normal, fmt.smallest_subnormal, -fmt.smallest_subnormal):
        assert torch.tensor(value).to(float8_dtype).float().item() == value
    # Below half the smallest subnormal everything rounds to zero.
    assert torch.tensor(fmt.smallest_subnormal * 0.49).to(float8_dtype).float().item() == 0.0
    assert fmt.smallest_subnormal == fmt.smallest_normal * 2.0**-fmt.mantissa_bits


@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_values_beyond_range_saturate_to_exactly_max(float8_dtype, hp_dtype):
    fmax = FORMATS[float8_dtype].max
    scale = 4.0
    # Every value lands beyond the range once multiplied by the scale (0.3 * 4 = 1.2 max).
    hp = torch.tensor([0.5 * fmax, -0.5 * fmax, 0.3 * fmax, -0.26 * fmax], dtype=hp_dtype)
    assert hp.dtype == hp_dtype and torch.isfinite(hp).all()
    x8 = Float8Tensor.from_hp(hp, float8_dtype, scale=scale)
    data = x8._data.float()
    assert data.tolist() == [fmax, -fmax, fmax, -fmax]
    back = x8.to_hp()
    assert back.dtype == hp_dtype
    assert torch.isfinite(back).all()
    assert back.float().tolist() == [fmax / scale, -fmax / scale, fmax / scale, -fmax / scale]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_huge_values_with_small_explicit_scale_saturate(float8_dtype, granularity):
    fmax = FORMATS[float8_dtype].max
    hp = torch.tensor([[1e30, -1e30, 3.0e38, 1.0]], dtype=torch.float32)
    scale = 1.0 if granularity == "tensorwise" else torch.ones(1, 1)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity, scale=scale)
    assert x8._data.float().tolist() == [[fmax, -fmax, fmax, 1.0]]


# Hand-made tensors: x * scale, rounded by hand, then saturated.
#   hp * 4 = [4, -10, 1.2000000477 (0.3 in fp32 times 4), 4000]
HAND_HP = [1.0, -2.5, 0.3, 1000.0]
HAND_DATA = {
    # 1.2 lies between 1.125 and 1.25 (3 mantissa bits) -> 1.25; 4000 saturates.
    torch.float8_e4m3fn: [4.0, -10.0, 1.25, 448.0],
    torch.float8_e4m3fnuz: [4.0, -10.0, 1.25, 240.0],
    # 2 mantissa bits: 1.2 -> 1.25, 4000 -> 4096 (spacing 512 in [2048, 4096)).
    torch.float8_e5m2: [4.0, -10.0, 1.25, 4096.0],
    torch.float8_e5m2fnuz: [4.0, -10.0, 1.25, 4096.0],
}


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_scale_rule_exact_on_hand_made_tensorwise(float8_dtype):
    hp = torch.tensor(HAND_HP, dtype=torch.float32)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, scale=4.0)
    assert x8._scale.dim() == 0 and x8._scale.item() == 4.0
    assert x8._data.dtype == float8_dtype
    assert x8._data.float().tolist() == HAND_DATA[float8_dtype]
    assert x8.to_hp().tolist() == [v / 4.0 for v in HAND_DATA[float8_dtype]]


def test_scale_rule_exact_on_hand_made_rowwise():
    hp = torch.tensor([[1.0, -3.0], [0.5, 100.0]], dtype=torch.float32)
    scale = torch.tensor([[2.0], [8.0]])
    x8 = Float8Tensor.from_hp(hp, torch.float8_e4m3fn, granularity="rowwise", scale=scale)
    assert x8._scale.tolist() == [[2.0], [8.0]]
    # Row 1: 100 * 8 = 800 saturates to 448, which reads back as 448 / 8 = 56.
    assert x8._data.float().tolist() == [[2.0, -6.0], [4.0, 448.0]]
    assert x8.to_hp().tolist() == [[1.0, -3.0], [0.5, 56.0]]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_scale_rule_bitwise_against_reference(float8_dtype, hp_dtype, granularity):
    hp = (torch.randn(16, 32) * 5).to(hp_dtype)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity)
    # _data == saturate(hp.float() * _scale), bit for bit.
    assert torch.equal(bits(x8._data), bits(reference_cast(hp, x8._scale, float8_dtype)))
    # to_hp() == _data.float() / _scale, rounded once to the original dtype.
    expected = (x8._data.float() / x8._scale).to(hp_dtype)
    assert torch.equal(x8.to_hp(), expected)
    # The dynamic scale maps the largest magnitude (per tensor or per row) onto the max.
    fmax = FORMATS[float8_dtype].max
    amax_data = x8._data.float().abs().amax(dim=None if granularity == "tensorwise" else -1)
    assert (amax_data == fmax).all()


# GemmConfig is a plain NamedTuple (torch.compile builds it inside graphs), so it is
# validated where it enters the public API: Float8Tensor.from_hp(gemm_config=...).


def test_gemm_config_rejects_fp8_out_dtype():
    cfg = GemmConfig(out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"out_dtype.*float8_e4m3fn.*float8_mm"):
        Float8Tensor.from_hp(torch.randn(16, 16), gemm_config=cfg)


def test_gemm_config_rejects_float64_out_dtype():
    cfg = GemmConfig(out_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"GemmConfig.out_dtype must be None or one of"):
        cfg.validated()


def test_gemm_config_rejects_non_bool_flags():
    cfg = GemmConfig(pad_inner_dim=1)
    with pytest.raises(TypeError, match=r"GemmConfig.pad_inner_dim must be a bool"):
        Float8Tensor.from_hp(torch.randn(16, 16), gemm_config=cfg)


def test_gemm_config_accepts_allowed_values():
    cfg = GemmConfig(out_dtype=torch.float16, use_fast_accum=True, pad_inner_dim=True)
    assert cfg.validated() is cfg
