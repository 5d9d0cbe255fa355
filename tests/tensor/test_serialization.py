"""flatten/unflatten are exact inverses; torch.save / torch.load(weights_only=True) round-trip bit for bit."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from helpers import GRANULARITIES, HP_DTYPES, assert_bitwise_equal_f8, dtype_name

from f8tensor import FLOAT8_DTYPES, BLOCK_1x128, BLOCK_128x128, Float8Tensor, GemmConfig, MX_1x32

GEMMS = [GemmConfig(), GemmConfig(out_dtype=torch.float32, use_fast_accum=True, pad_inner_dim=True)]


def _unflatten(x8: Float8Tensor) -> Float8Tensor:
    names, meta = x8.__tensor_flatten__()
    inner = {name: getattr(x8, name) for name in names}
    return Float8Tensor.__tensor_unflatten__(inner, meta, x8.shape, x8.stride())


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("gemm", GEMMS, ids=["default_gemm", "custom_gemm"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_flatten_unflatten_exact_inverse(float8_dtype, hp_dtype, granularity, gemm):
    hp = torch.randn(8, 32, dtype=hp_dtype)
    x8 = Float8Tensor.from_hp(hp, float8_dtype, granularity=granularity, gemm_config=gemm)
    names, meta = x8.__tensor_flatten__()
    assert names == ["_data", "_scale"]
    # Metadata is plain, hashable and compares by value.
    assert hash(meta) == hash(x8.__tensor_flatten__()[1])
    y = _unflatten(x8)
    assert_bitwise_equal_f8(y, x8)
    assert y.__tensor_flatten__() == (names, meta)
    assert y.stride() == x8.stride()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_flatten_unflatten_of_a_view(granularity):
    x8 = Float8Tensor.from_hp(torch.randn(4, 6, 32), granularity=granularity).transpose(0, 1)[1:5]
    y = _unflatten(x8)
    assert_bitwise_equal_f8(y, x8)
    assert y.stride() == x8.stride()


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_save_load_weights_only(float8_dtype, granularity):
    x8 = Float8Tensor.from_hp(
        torch.randn(16, 32, dtype=torch.bfloat16), float8_dtype, granularity=granularity, gemm_config=GEMMS[1]
    )
    y = _save_load(x8)
    assert_bitwise_equal_f8(y, x8)
    assert torch.equal(y.to_hp(), x8.to_hp())


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_save_load_inside_a_dict(float8_dtype, granularity):
    x8 = Float8Tensor.from_hp(torch.randn(16, 32), float8_dtype, granularity=granularity)
    plain = torch.randn(5)
    loaded = _save_load({"w8": x8, "plain": plain, "nested": [x8.t()]})
    assert_bitwise_equal_f8(loaded["w8"], x8)
    assert torch.equal(loaded["plain"], plain)
    assert_bitwise_equal_f8(loaded["nested"][0], x8.t())
    assert loaded["nested"][0].stride() == x8.t().stride()


@pytest.mark.device_param
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_state_dict_round_trip(granularity):
    def fp8_linear(weight: torch.Tensor) -> torch.nn.Linear:
        m = torch.nn.Linear(32, 16)
        w8 = Float8Tensor.from_hp(weight, granularity=granularity)
        m.weight = torch.nn.Parameter(w8, requires_grad=False)
        return m

    src = fp8_linear(torch.randn(16, 32))
    sd = _save_load(src.state_dict())
    assert type(sd["weight"]) is Float8Tensor
    assert_bitwise_equal_f8(sd["weight"], src.weight.detach())

    dst = fp8_linear(torch.zeros(16, 32))
    dst.load_state_dict(sd)
    assert type(dst.weight.data) is Float8Tensor
    assert_bitwise_equal_f8(dst.weight.detach(), src.weight.detach())
    assert torch.equal(dst.bias, src.bias)
    x = torch.randn(4, 32)
    assert torch.equal(dst(x), src(x))


# Block-scaled tensors (the per-dim block travels in the checkpoint; the scale's dtype, fp32
# or e8m0, with the scale). Sizes leave partial edge blocks.
BLOCK_CASES = {
    "1x128": ((4, 200), BLOCK_1x128),
    "128x128": ((130, 200), BLOCK_128x128),
    "mx_1x32": ((4, 96), MX_1x32),
    "per_expert": ((3, 8, 16), (1, 0, 0)),
}


def _pickle_round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


ROUND_TRIPS = {"torch_save_weights_only": _save_load, "pickle": _pickle_round_trip, "deepcopy": copy.deepcopy}


@pytest.mark.device_param
@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_tensor_round_trips_bit_exact(case, how):
    shape, granularity = BLOCK_CASES[case]
    x8 = Float8Tensor.from_hp(torch.randn(shape, dtype=torch.bfloat16), granularity=granularity, gemm_config=GEMMS[1])
    w8 = torch.nn.Parameter(Float8Tensor.from_hp(torch.randn(shape), granularity=granularity), requires_grad=False)
    loaded = ROUND_TRIPS[how]({"x8": x8, "w8": w8})
    assert_bitwise_equal_f8(loaded["x8"], x8)
    assert loaded["x8"]._block == x8._block and x8._block == x8.block
    assert torch.equal(loaded["x8"].to_hp(), x8.to_hp())
    assert isinstance(loaded["w8"], torch.nn.Parameter) and not loaded["w8"].requires_grad
    assert_bitwise_equal_f8(loaded["w8"].detach(), w8.detach())
    if how == "deepcopy":  # a copy, not an alias
        assert loaded["x8"]._data.data_ptr() != x8._data.data_ptr()
        assert loaded["x8"]._scale.data_ptr() != x8._scale.data_ptr()
