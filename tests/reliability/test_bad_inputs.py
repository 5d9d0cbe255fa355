"""Bad input and faults: every case gets a correct result or a clear error (what was wrong,
what is allowed), never silent corruption, a crash deep inside PyTorch, or lost state.

One test per defect of the reliability campaign (issue 15), grouped as the campaign found
them; crafted checkpoints live in core/test_crafted_checkpoints.py.
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from helpers import MATMUL_E5M2_MIN_DB, MATMUL_MIN_DB, assert_sqnr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import f8tensor.nn.linear_autograd
import f8tensor.tensor
from f8tensor import (
    BLOCK_1x128,
    CastConfig,
    DelayedScalingConfig,
    Float8AllGatherWeight,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    MX_1x32,
    convert_to_float8_training,
    enable_float8_stats,
    float8_mm,
    float8_stats,
    format_float8_stats,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DELAYED = Float8LinearConfig.from_recipe("delayed")
FSDP8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True)


def _save_load(obj, weights_only=True):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


# ============================================================================ silent corruption


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64])
def test_linear_refuses_int_and_float64_inputs(dtype):
    layer = Float8Linear(32, 16)
    with pytest.raises(TypeError, match=rf"Float8Linear input must be a floating tensor of dtype .*; got {dtype}"):
        layer(torch.ones(4, 32, dtype=dtype))


def test_linear_float64_error_says_why():
    with pytest.raises(TypeError, match=r"float64 has no FP8 GEMM on GPUs"):
        Float8Linear(32, 16)(torch.ones(4, 32, dtype=torch.float64))


def test_linear_under_autocast_still_refuses_int_inputs():
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=r"got torch.int64"):
        Float8Linear(32, 16)(torch.ones(4, 32, dtype=torch.int64))


@pytest.mark.parametrize("scale", [1e39, 1e300, 1e-46, 1e-40])
def test_explicit_python_scale_is_range_checked_in_fp32(scale):
    with pytest.raises(ValueError, match=r"scale must be a positive finite fp32 number in \[1.175e-38, 3.403e\+38\]"):
        Float8Tensor.from_hp(torch.randn(4, 16), scale=scale)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -2.0])
def test_explicit_tensor_scale_is_range_checked(value):
    with pytest.raises(ValueError, match=r"scale must hold positive finite fp32 numbers"):
        Float8Tensor.from_hp(torch.randn(4, 16), scale=torch.tensor(value))


def test_explicit_rowwise_scale_with_one_bad_row_is_refused():
    scale = torch.ones(4, 1)
    scale[2] = torch.inf
    with pytest.raises(ValueError, match=r"got inf"):
        Float8Tensor.from_hp(torch.randn(4, 16), granularity="rowwise", scale=scale)


def test_explicit_scale_at_the_edges_of_the_range_still_works():
    hp = torch.randn(4, 16)
    x8 = Float8Tensor.from_hp(hp, scale=1e30)  # everything saturates, nothing becomes inf
    assert torch.isfinite(x8.to_hp()).all()
    small = Float8Tensor.from_hp(hp, scale=2.0**-100)  # everything flushes to zero, no NaN
    assert torch.equal(small.to_hp(), torch.zeros_like(hp))


@pytest.mark.gpu
@pytest.mark.parametrize("value", [-1.0, 0.0, math.inf])
def test_bad_tensor_scale_on_a_gpu_reads_back_nan_without_a_sync(value):
    # Device values are not read at the entry (that would be a sync): they become NaN.
    x8 = Float8Tensor.from_hp(torch.randn(4, 16, device="cuda"), scale=torch.tensor(value, device="cuda"))
    assert torch.isnan(x8.to_hp()).all()


@pytest.mark.parametrize("float8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("inf", [math.inf, -math.inf])
def test_float8_mm_inf_bias_with_fp8_output_stays_non_finite(float8_dtype, inf):
    a8, w8 = Float8Tensor.from_hp(torch.randn(16, 32)), Float8Tensor.from_hp(torch.randn(32, 32))
    bias = torch.zeros(32)
    bias[3] = inf
    out = float8_mm(a8, w8.t(), bias=bias, out_dtype=float8_dtype, out_scale=1.0).to_hp()
    assert not torch.isfinite(out[:, 3]).any()
    assert torch.isfinite(out[:, :3]).all()


@pytest.mark.parametrize("out_scale", [0.0, math.nan, math.inf, 1e300, -1.0, 1e-46])
def test_float8_mm_out_scale_number_is_validated(out_scale):
    a8 = Float8Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"float8_mm out_scale must be a positive finite fp32 number"):
        float8_mm(a8, a8.t(), out_dtype=E4M3, out_scale=out_scale)


@pytest.mark.parametrize("out_scale", [0.0, math.nan, math.inf, -1.0])
def test_float8_mm_out_scale_tensor_values_are_validated(out_scale):
    a8 = Float8Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"float8_mm out_scale must hold positive finite fp32 numbers"):
        float8_mm(a8, a8.t(), out_dtype=E4M3, out_scale=torch.tensor(out_scale))


def test_float8_mm_out_scale_shape_and_type():
    a8 = Float8Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"out_scale must be one number \(a tensor of 1 element\); got shape \(2,\)"):
        float8_mm(a8, a8.t(), out_dtype=E4M3, out_scale=torch.ones(2))
    with pytest.raises(TypeError, match=r"out_scale must be a float or an fp32 tensor; got str"):
        float8_mm(a8, a8.t(), out_dtype=E4M3, out_scale="1.0")
    with pytest.raises(TypeError, match=r"out_scale must be a float or a float32 tensor; got dtype torch.float64"):
        float8_mm(a8, a8.t(), out_dtype=E4M3, out_scale=torch.tensor(1.0, dtype=torch.float64))
    # A 1-element tensor of any shape is one number.
    out = float8_mm(a8, a8.t(), out_dtype=E4M3, out_scale=torch.tensor([0.5]))
    assert out._scale.shape == () and out._scale.item() == 0.5


@pytest.mark.parametrize("margin", [15, 20, 127])
def test_delayed_margin_that_flushes_e4m3_is_refused(margin):
    with pytest.raises(ValueError, match=r"margin"):
        Float8LinearConfig.from_recipe("delayed", delayed=DelayedScalingConfig(margin=margin))


def test_delayed_margin_within_range_still_trains():
    config = Float8LinearConfig.from_recipe("delayed", delayed=DelayedScalingConfig(margin=2))
    layer = Float8Linear(32, 16, config=config)
    x = torch.randn(8, 32, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad.abs().sum() > 0


def test_history_len_has_an_upper_bound_with_a_reason():
    with pytest.raises(ValueError, match=r"history_len must be in \[1, 1024\] \(every delayed cast reduces"):
        DelayedScalingConfig(history_len=10**9)


def test_deferred_init_resets_delayed_state():
    with torch.device("meta"):
        layer = Float8Linear(32, 16, config=DELAYED)
    layer.to_empty(device="cpu")
    for name in ("amax_history_input", "scale_input", "delayed_calls"):
        getattr(layer, name).fill_(1e30)  # what uninitialized memory may hold
    layer.reset_parameters()
    assert torch.equal(layer.amax_history_input, torch.zeros(16))
    assert torch.equal(layer.amax_history_grad_output, torch.zeros(16))
    assert torch.equal(layer.scale_input, torch.ones(())) and torch.equal(layer.scale_weight, torch.ones(()))
    assert torch.equal(layer.delayed_calls, torch.tensor([[-1.0, 1.0, 1.0]]).expand(8, 3))
    x = torch.randn(8, 32)
    ref = x @ layer.weight.detach().t() + layer.bias.detach()
    assert_sqnr(ref, layer(x), 25.0, "first step after deferred init")  # measured 27.7 dB


def test_deferred_init_resets_stats_buffers():
    with torch.device("meta"):
        layer = Float8Linear(32, 16, config=Float8LinearConfig(collect_stats=True))
    layer.to_empty(device="cpu")
    layer.float8_stats_input.fill_(7.0)
    layer.reset_parameters()
    assert torch.isnan(layer.float8_stats_input).all()


def test_tied_embedding_and_lm_head_stay_one_parameter():
    emb, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    model = convert_to_float8_training(nn.Sequential(emb, head), config=FSDP8)
    assert isinstance(model[1], Float8Linear)
    assert model[1].weight is model[0].weight
    assert len(list(model.parameters())) == 1
    # The embedding needs the high-precision weight: the FP8 all-gather is off for it, and
    # the layer's config says so.
    assert not isinstance(model[1].weight, Float8AllGatherWeight)
    assert not model[1].config.enable_fsdp_float8_all_gather
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.tensor([[1, 2, 3, 4]])).sum().backward()
    opt.step()  # one update, not two
    grad = model[0].weight.grad
    assert torch.allclose(model[0].weight.detach(), before - 0.5 * grad)


def test_weight_tied_between_two_fp8_layers_stays_one_wrapped_parameter():
    a, b = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
    b.weight = a.weight
    model = convert_to_float8_training(nn.Sequential(a, b), config=FSDP8)
    assert model[0].weight is model[1].weight
    assert isinstance(model[0].weight, Float8AllGatherWeight)
    assert len(list(model.parameters())) == 1


def test_delayed_layer_called_twice_under_checkpointing_uses_each_calls_scale():
    base = nn.Linear(64, 64)
    plain = Float8Linear.from_float(copy.deepcopy(base), DELAYED)
    ckpt = Float8Linear.from_float(copy.deepcopy(base), DELAYED)
    # Different amaxes: on the first step (empty history) each call has its own scale.
    x1, x2 = torch.randn(16, 64), 5 * torch.randn(16, 64)
    (plain(x1).sum() + plain(x2).pow(2).sum()).backward()
    # Each call checkpointed on its own: both are recomputed in backward, the second first.
    first = checkpoint(lambda t: ckpt(t).sum(), x1, use_reentrant=False)
    second = checkpoint(lambda t: ckpt(t).pow(2).sum(), x2, use_reentrant=False)
    (first + second).backward()
    assert torch.equal(plain.weight.grad, ckpt.weight.grad)
    assert torch.equal(plain.bias.grad, ckpt.bias.grad)


# ============================================================================ crashes


@pytest.mark.parametrize("in_features, out_features", [(0, 16), (16, 0), (0, 0)])
def test_zero_feature_linear_computes_like_nn_linear(in_features, out_features):
    ref = nn.Linear(in_features, out_features)
    layer = Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig())
    x = torch.randn(4, in_features, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), ref(x_ref)
    assert y.shape == (4, out_features)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_forward_on_the_meta_device():
    with torch.device("meta"):
        layer = Float8Linear(32, 16)
        y = layer(torch.randn(4, 32))
    assert y.device.type == "meta" and y.shape == (4, 16)


def test_assign_load_of_plain_checkpoint_into_meta_model_puts_fresh_buffers_on_the_weights_device():
    with torch.device("meta"):
        layer = Float8Linear(32, 16, config=DELAYED)
    layer.load_state_dict(nn.Linear(32, 16).state_dict(), assign=True)
    for name, buf in layer.named_buffers():
        assert buf.device.type == "cpu", name
    assert torch.equal(layer.scale_input, torch.ones(()))
    assert torch.equal(layer.amax_history_input, torch.zeros(16))
    layer(torch.randn(4, 32)).sum().backward()  # no device mismatch


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("piece", ["slice", "split", "column_slice"])
@pytest.mark.parametrize("how", ["torch.save", "deepcopy", "pickle"])
def test_views_save_and_copy(granularity, piece, how):
    x8 = Float8Tensor.from_hp(torch.randn(8, 32), granularity=granularity)
    view = {"slice": x8[2:5], "split": x8.split(3)[1], "column_slice": x8.t()[3:9]}[piece]
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(view, buf)
        # Only the view's own bytes are stored, not its base's 256.
        assert buf.getbuffer().nbytes < 2400
        buf.seek(0)
        out = torch.load(buf, weights_only=True)
    elif how == "deepcopy":
        out = copy.deepcopy(view)
    else:
        out = pickle.loads(pickle.dumps(view))
    assert type(out) is Float8Tensor and out.shape == view.shape
    assert torch.equal(out.to_hp(), view.to_hp())
    assert out._axiswise_dim == view._axiswise_dim


# ============================================================================ unclear errors


def test_zero_dim_input_to_linear():
    with pytest.raises(ValueError, match=r"Float8Linear input must have at least one dimension"):
        Float8Linear(32, 16)(torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_bool_and_complex_inputs_to_linear(dtype):
    with pytest.raises(TypeError, match=rf"Float8Linear input must be a floating tensor .*; got {dtype}"):
        Float8Linear(32, 16)(torch.ones(4, 32, dtype=dtype))


def test_int_tensor_matmul_gets_the_librarys_message():
    w8 = Float8Tensor.from_hp(torch.randn(32, 32))
    with pytest.raises(
        TypeError, match=r"the plain operand of an FP8 matmul must have a high-precision floating dtype"
    ):
        torch.ones(4, 32, dtype=torch.int64) @ w8.t()
    with pytest.raises(
        TypeError, match=r"the plain operand of an FP8 matmul must have a high-precision floating dtype"
    ):
        w8 @ torch.ones(32, 4, dtype=torch.int32)


def test_power_of_2_scale_must_be_a_bool_in_from_hp():
    with pytest.raises(TypeError, match=r"power_of_2_scale must be a bool; got 'no'"):
        Float8Tensor.from_hp(torch.randn(4, 16), power_of_2_scale="no")


def test_from_hp_refuses_arguments_that_would_do_nothing():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"power_of_2_scale rounds a computed scale; a given scale is used as is"):
        Float8Tensor.from_hp(x, scale=0.3, power_of_2_scale=True)
    with pytest.raises(ValueError, match=r"with rounding='nearest' it has no effect"):
        Float8Tensor.from_hp(x, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None; got int"):
        Float8Tensor.from_hp(x, rounding="stochastic", generator=0)
    assert Float8Tensor.from_hp(x, power_of_2_scale=True)._scale.log2().frac().item() == 0.0
    assert Float8Tensor.from_hp(x, scale=0.3)._scale.item() == pytest.approx(0.3)


@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_fnuz_mixed_with_fn_is_refused_by_the_config(role):
    fields = {"input": CastConfig(E4M3), "weight": CastConfig(E4M3), "grad_output": CastConfig(E5M2)}
    fields[role] = CastConfig(torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match=r"one FP8 family, fn \(e4m3fn, e5m2\) or fnuz"):
        Float8LinearConfig(**fields)


def test_all_fnuz_config_is_fine(monkeypatch):
    config = Float8LinearConfig(
        input=CastConfig(torch.float8_e4m3fnuz),
        weight=CastConfig(torch.float8_e4m3fnuz),
        grad_output=CastConfig(torch.float8_e5m2fnuz),
    )
    # The layer trains with it: each of its three GEMMs multiplies fnuz casts (the CPU
    # reference re-casts them for its kernel), at the formats' accuracy.
    products = []
    real = f8tensor.nn.linear_autograd.matmul

    def recorded(a, b, *args, **kwargs):
        products.append((a._data.dtype, b._data.dtype))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(f8tensor.nn.linear_autograd, "matmul", recorded)
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)
    layer = Float8Linear.from_float(copy.deepcopy(ref), config)
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    x_ref, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(x_ref).backward(g)
    y = layer(x_f8)
    y.backward(g)
    e4, e5 = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    assert products == [(e4, e4), (e5, e4), (e5, e4)], products  # output, grad_input, grad_weight
    # Measured 27.85 (output), 23.98 (grad_input, an e5m2fnuz operand), 25.69 dB (grad_weight).
    assert_sqnr(ref(x), y, MATMUL_MIN_DB, "fnuz output")
    assert_sqnr(x_ref.grad, x_f8.grad, MATMUL_E5M2_MIN_DB, "fnuz grad_input")
    assert_sqnr(ref.weight.grad, layer.weight.grad, MATMUL_E5M2_MIN_DB, "fnuz grad_weight")
    assert torch.equal(ref.bias.grad, layer.bias.grad)


def test_convert_refuses_a_non_module():
    with pytest.raises(TypeError, match=r"convert_to_float8_training expects an nn.Module; got str"):
        convert_to_float8_training("model")


def test_enable_stats_refuses_a_non_module():
    with pytest.raises(TypeError, match=r"enable_float8_stats expects an nn.Module .*; got str"):
        enable_float8_stats("m")


def test_format_stats_refuses_a_foreign_dict():
    with pytest.raises(ValueError, match=r"format_float8_stats expects the dict float8_stats returns.*got 'foo': 1.0"):
        format_float8_stats({"foo": 1.0})


def test_stats_after_a_nan_input_show_nan_not_zero():
    model = enable_float8_stats(nn.Sequential(Float8Linear(32, 16)))
    x = torch.randn(4, 32)
    x[1, 2] = torch.nan
    model(x)
    stats = float8_stats(model)
    assert math.isnan(stats["0/input/amax"])
    assert math.isnan(stats["0/input/saturated_frac"])  # not a reassuring 0 %
    cells = next(row for row in format_float8_stats(stats).splitlines() if " input " in row).split()
    # layer, role, sat %, sat #, uflow %, uflow #, amax, scale, headroom (no history column: not delayed)
    assert cells[2] == "nan" and cells[3] == "0" and cells[6] == "nan" and cells[7] == "nan"
    weight_line = next(row for row in format_float8_stats(stats).splitlines() if " weight " in row)
    assert "nan" not in weight_line


def test_double_backward_names_the_layer_and_a_way_out():
    layer = Float8Linear(32, 16)
    x = torch.randn(4, 32, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    # First-order gradients are the ordinary ones.
    (gx_ref,) = torch.autograd.grad(layer(x).pow(2).sum(), x)
    assert torch.equal(gx.detach(), gx_ref)
    with pytest.raises(
        RuntimeError, match=r"Float8Linear\(in_features=32, out_features=16\): double backward .*module_filter_fn"
    ):
        gx.pow(2).sum().backward()


# ============================================================================ lost data


def test_assign_load_keeps_the_fp8_all_gather_weight():
    layer = Float8Linear(32, 16, config=FSDP8)
    layer.load_state_dict(nn.Linear(32, 16).state_dict(), assign=True)
    assert isinstance(layer.weight, Float8AllGatherWeight)
    assert isinstance(layer.weight, nn.Parameter)


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_whole_model_save_keeps_the_fp8_all_gather_weight(how):
    model = nn.Sequential(Float8Linear(32, 16, config=FSDP8))
    out = _save_load(model, weights_only=False) if how == "torch.save" else copy.deepcopy(model)
    assert isinstance(out[0].weight, Float8AllGatherWeight)
    assert torch.equal(out[0].weight.detach()._hp, model[0].weight.detach()._hp)


def test_pickle_round_trip():
    x8 = Float8Tensor.from_hp(torch.randn(8, 32, dtype=torch.bfloat16), E5M2, granularity="rowwise")
    out = pickle.loads(pickle.dumps(x8))
    assert torch.equal(out._data.view(torch.uint8), x8._data.view(torch.uint8))
    assert torch.equal(out._scale, x8._scale) and out._orig_dtype == torch.bfloat16


# ============================================================================ neighbours


def test_float64_layers_are_refused_where_they_are_made():
    with pytest.raises(TypeError, match=r"Float8Linear parameters must have dtype .*; got dtype=torch.float64"):
        Float8Linear(32, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"from_float: FP8 casts start from .* weights; got torch.float64"):
        Float8Linear.from_float(nn.Linear(32, 16).double())
    with pytest.raises(TypeError, match=r"Float8Linear weight must have dtype .*; got torch.float64"):
        Float8Linear(32, 16).double()(torch.randn(4, 32))


def test_precompute_refuses_a_non_module():
    from f8tensor import precompute_float8_scales_for_fsdp

    with pytest.raises(TypeError, match=r"precompute_float8_scales_for_fsdp expects an nn.Module; got str"):
        precompute_float8_scales_for_fsdp("model")


def test_recipe_name_of_the_wrong_type():
    with pytest.raises(ValueError, match=r"unknown recipe \['tensorwise'\]"):
        Float8LinearConfig.from_recipe(["tensorwise"])


def test_float8_stats_refuses_a_non_module():
    with pytest.raises(TypeError, match=r"float8_stats expects an nn.Module"):
        float8_stats("m")


def test_float8_mm_bias_of_the_wrong_kind():
    a8 = Float8Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(TypeError, match=r"float8_mm bias must have a high-precision floating dtype"):
        float8_mm(a8, a8.t(), bias=torch.ones(16, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"float8_mm: bias must be None or a high-precision tensor; got Float8Tensor"):
        float8_mm(a8, a8.t(), bias=Float8Tensor.from_hp(torch.ones(16)))


def test_float8_tensor_input_to_linear_says_what_to_do():
    # A tensorwise layer takes only its own input cast (what the FP8 sequence gather hands
    # over); a rowwise-cast input is refused with what to do.
    x8 = f8tensor.tensor.cast_to_float8(torch.randn(4, 32), torch.float8_e4m3fn, axiswise_dim=-1)
    with pytest.raises(TypeError, match=r"pass a high-precision tensor \(call .to_hp\(\) first\)"):
        Float8Linear(32, 16)(x8)


# ============================================================================ property test


# Valid operand formats per recipe: never two e5m2 operands in one FP8 GEMM (forward
# input x weight, grad_input grad_output x weight, grad_weight grad_output x input); the
# recipe with a high-precision weight gradient also takes e5m2 input and grad_output. The fn
# family only: CPU's _scaled_mm has no fnuz kernels (fnuz configs are checked below).
_VALID_FORMATS = [(E4M3, E4M3, E4M3), (E4M3, E4M3, E5M2), (E4M3, E5M2, E4M3), (E5M2, E4M3, E4M3)]
_VALID_FORMATS_GW_HP = [*_VALID_FORMATS, (E5M2, E4M3, E5M2)]


@st.composite
def _valid_linear_configs(draw):
    recipe = draw(st.sampled_from(["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"]))
    dtypes = draw(st.sampled_from(_VALID_FORMATS_GW_HP if recipe == "rowwise_with_gw_hp" else _VALID_FORMATS))
    pow2 = draw(st.booleans())
    # margin: each step of it costs a bit of the FP8 range (delayed scaling); up to 4 keeps
    # the SQNR bar below meaningful.
    margin = draw(st.integers(0, 4))
    history_len = draw(st.sampled_from([1, 4, 1024]))
    features = draw(st.sampled_from([(16, 32), (0, 16), (24, 16), (16, 16)]))
    pad = draw(st.booleans()) if features[0] % 16 == 0 and features[1] % 16 == 0 else True
    base = Float8LinearConfig.from_recipe(recipe)
    casts = {
        role: CastConfig(d, getattr(base, role).granularity, getattr(base, role).scaling, pow2)
        for role, d in zip(("input", "weight", "grad_output"), dtypes)
    }
    config = Float8LinearConfig.from_recipe(
        recipe, **casts, delayed=DelayedScalingConfig(history_len=history_len, margin=margin), pad_inner_dim=pad
    )
    return config, features


# Output, input and weight gradients against nn.Linear (fp32). Measured over the grid of all
# 4 recipes x valid formats x pow2 x margin {0, 2, 4} x history {1, 1024} x three shapes (576
# configs, seed 0): 20.67 dB minimum (delayed, e5m2 grad_output, margin 4), 21.95 with e4m3
# everywhere. The bar sits 2.5 dB under the minimum.
_RANDOM_CONFIG_MIN_DB = 18.0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_valid_linear_configs())
def test_random_valid_configs_train_accurately(case):
    config, features = case
    torch.manual_seed(0)
    ref = nn.Linear(*features)
    layer = Float8Linear.from_float(copy.deepcopy(ref), config)
    x = torch.randn(8, features[0])
    grad_out = torch.randn(8, features[1])
    x_ref, x_f8 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(grad_out)
    y = layer(x_f8)
    y.backward(grad_out)
    assert torch.isfinite(y).all()
    assert torch.isfinite(x_f8.grad).all() and torch.isfinite(layer.weight.grad).all()
    if features[0] == 0:  # an empty product: the output is the bias, the weight gradient empty
        assert torch.equal(y, y_ref) and torch.equal(layer.weight.grad, ref.weight.grad)
        return
    assert_sqnr(y_ref, y, _RANDOM_CONFIG_MIN_DB, f"{config} output")
    assert_sqnr(x_ref.grad, x_f8.grad, _RANDOM_CONFIG_MIN_DB, f"{config} grad_input")
    assert_sqnr(ref.weight.grad, layer.weight.grad, _RANDOM_CONFIG_MIN_DB, f"{config} grad_weight")
    assert torch.equal(layer.bias.grad, ref.bias.grad)


_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@pytest.mark.parametrize(
    "recipe, dtypes, delayed, features, pad, error",
    [
        ("tensorwise", (E4M3, E4M3, E5M2), (0, 0), (16, 32), False, r"history_len must be an int >= 1; got 0"),
        ("delayed", (E4M3, E4M3, E5M2), (1025, 0), (16, 32), False, r"history_len must be in \[1, 1024\]"),
        ("rowwise", (E4M3, E4M3, E5M2), (16, -2), (16, 32), False, r"margin must be an int >= 0; got -2"),
        (
            "tensorwise",
            (E4M3, _FNUZ[0], E5M2),
            (16, 0),
            (16, 32),
            False,
            r"one FP8 family, fn \(e4m3fn, e5m2\) or fnuz",
        ),
        (
            "rowwise",
            (E5M2, E5M2, E4M3),
            (16, 0),
            (16, 32),
            False,
            r"forward \(input x weight\) GEMM would multiply two e5m2",
        ),
        (
            "tensorwise",
            (E4M3, E5M2, E5M2),
            (16, 0),
            (16, 32),
            False,
            r"grad_input \(grad_output x weight\) GEMM would multiply two e5m2",
        ),
        (
            "delayed",
            (E5M2, E4M3, E5M2),
            (16, 0),
            (16, 32),
            False,
            r"grad_weight \(grad_output x input\) GEMM would multiply two e5m2",
        ),
        (
            "rowwise",
            (E4M3, E4M3, E5M2),
            (16, 0),
            (24, 16),
            False,
            r"Float8Linear\(24, 16\): FP8 GEMMs need in_features and out_features to be multiples of 16",
        ),
    ],
    ids=[
        "history_0",
        "history_1025",
        "margin_-2",
        "fn_fnuz_mix",
        "fwd_e5m2_e5m2",
        "dgrad_e5m2_e5m2",
        "wgrad_e5m2_e5m2",
        "unaligned_no_pad",
    ],
)
def test_invalid_configs_are_refused_naming_the_problem(recipe, dtypes, delayed, features, pad, error):
    base = Float8LinearConfig.from_recipe(recipe)
    casts = {
        role: CastConfig(d, getattr(base, role).granularity, getattr(base, role).scaling)
        for role, d in zip(("input", "weight", "grad_output"), dtypes)
    }
    history_len, margin = delayed

    def config():
        return Float8LinearConfig.from_recipe(
            recipe, **casts, delayed=DelayedScalingConfig(history_len=history_len, margin=margin), pad_inner_dim=pad
        )

    if features == (16, 32):  # a config defect: refused when the config is built
        with pytest.raises(ValueError, match=error):
            config()
    else:  # a valid config, dims it cannot take: refused when the layer is built
        layer_config = config()
        with pytest.raises(ValueError, match=error):
            Float8Linear(*features, config=layer_config)


def test_explicit_block_scales_are_range_checked():
    # fp32 block scales: the same fp32 range check as tensorwise ones.
    bad = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match=r"scale must hold positive finite fp32 numbers"):
        Float8Tensor.from_hp(torch.randn(2, 256), granularity=(1, 128), scale=bad)
    # e8m0 (MX) scales: every code but 0xFF (NaN) is a power of two 2**-127..2**127.
    codes = torch.full((2, 2), 127, dtype=torch.uint8)
    ok = Float8Tensor.from_hp(torch.randn(2, 64), granularity=MX_1x32, scale=codes.view(torch.float8_e8m0fnu))
    assert ok._scale.dtype == torch.float8_e8m0fnu
    codes[0, 1] = 0xFF
    with pytest.raises(ValueError, match=r"scale must hold e8m0 powers of two; got NaN"):
        Float8Tensor.from_hp(torch.randn(2, 64), granularity=MX_1x32, scale=codes.view(torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match=r"power_of_2_scale must be a bool"):
        Float8Tensor.from_hp(torch.randn(2, 256), granularity=BLOCK_1x128, power_of_2_scale=1)
