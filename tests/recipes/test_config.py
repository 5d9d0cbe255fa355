"""Float8LinearConfig and its parts: recipes, validation messages, dataclasses.replace."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from f8tensor import (
    RECIPES,
    CastConfig,
    DelayedScalingConfig,
    Float8Linear,
    Float8LinearConfig,
    Granularity,
    ScalingType,
)

from linear_utils import RECIPE_NAMES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----------------------------------------------------------------------------- recipes


def test_recipe_table():
    tw = Float8LinearConfig.from_recipe("tensorwise")
    assert (tw.input, tw.weight, tw.grad_output) == (CastConfig(E4M3), CastConfig(E4M3), CastConfig(E5M2))
    assert not tw.weight_grad_in_hp and not tw.any_delayed

    rw = Float8LinearConfig.from_recipe("rowwise")
    for cast in (rw.input, rw.weight, rw.grad_output):
        assert cast == CastConfig(E4M3, Granularity.ROWWISE, ScalingType.DYNAMIC)
    assert not rw.weight_grad_in_hp

    gw = Float8LinearConfig.from_recipe("rowwise_with_gw_hp")
    assert gw.weight_grad_in_hp
    assert (gw.input, gw.weight, gw.grad_output) == (rw.input, rw.weight, rw.grad_output)

    dl = Float8LinearConfig.from_recipe("delayed")
    assert (dl.input.dtype, dl.weight.dtype, dl.grad_output.dtype) == (E4M3, E4M3, E5M2)
    assert dl.input.delayed and dl.weight.delayed and dl.grad_output.delayed and dl.any_delayed
    assert dl.delayed == DelayedScalingConfig(history_len=16, reduction="max", margin=0)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_from_recipe_returns_the_named_config(recipe):
    config = Float8LinearConfig.from_recipe(recipe)
    assert config == RECIPES[recipe]
    assert isinstance(hash(config), int)  # frozen, hence usable as a torch.compile guard


def test_from_recipe_overrides_and_delayed_settings():
    config = Float8LinearConfig.from_recipe(
        "delayed", delayed=DelayedScalingConfig(history_len=4, reduction="most_recent", margin=2), pad_inner_dim=True
    )
    assert config.delayed.history_len == 4
    assert config.delayed.reduction == "most_recent"
    assert config.delayed.margin == 2
    assert config.pad_inner_dim
    assert RECIPES["delayed"].delayed.history_len == 16  # the table itself is untouched
    layer = Float8Linear(32, 32, config=config)
    assert layer.amax_history_input.shape == (4,)


def test_cast_config_accepts_strings_and_stores_enums():
    cast = CastConfig(E4M3, granularity="rowwise", scaling="dynamic")
    assert cast.granularity is Granularity.ROWWISE
    assert cast.scaling is ScalingType.DYNAMIC


# ----------------------------------------------------------------------------- dataclasses.replace


def test_dataclasses_replace_derives_a_variant():
    base = Float8LinearConfig.from_recipe("tensorwise")
    padded = dataclasses.replace(base, pad_inner_dim=True)
    assert padded.pad_inner_dim and not base.pad_inner_dim
    assert padded.input == base.input

    pow2 = dataclasses.replace(base, weight=dataclasses.replace(base.weight, power_of_2_scale=True))
    assert pow2.weight.power_of_2_scale and not base.weight.power_of_2_scale


def test_dataclasses_replace_validates_again():
    base = Float8LinearConfig.from_recipe("delayed")
    delayed = dataclasses.replace(base.delayed, margin=20)  # valid on its own; too large for e4m3
    with pytest.raises(ValueError, match="would scale the input.s amax below the smallest normal"):
        dataclasses.replace(base, delayed=delayed)


def test_config_is_frozen():
    config = Float8LinearConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pad_inner_dim = True  # type: ignore[misc]


# ----------------------------------------------------------------------------- validation


def test_bad_cast_dtype():
    with pytest.raises(TypeError, match=r"CastConfig.dtype must be one of torch.float8_e4m3fn, torch.float8_e5m2"):
        CastConfig(torch.float16)


def test_bad_granularity():
    with pytest.raises(ValueError, match=r"granularity must be one of 'tensorwise', 'rowwise'; got 'colwise'"):
        CastConfig(E4M3, granularity="colwise")


def test_bad_scaling():
    with pytest.raises(ValueError, match=r"scaling must be one of 'dynamic', 'delayed'; got 'static'"):
        CastConfig(E4M3, scaling="static")


def test_rowwise_with_delayed_scaling():
    with pytest.raises(ValueError, match="delayed scaling keeps one amax history per tensor: it needs granularity='tensorwise'"):
        CastConfig(E4M3, granularity="rowwise", scaling="delayed")


def test_power_of_2_scale_must_be_bool():
    with pytest.raises(TypeError, match=r"CastConfig.power_of_2_scale must be a bool; got 1"):
        CastConfig(E4M3, power_of_2_scale=1)  # type: ignore[arg-type]


def test_e5m2_times_e5m2_forward():
    with pytest.raises(ValueError, match=r"the forward \(input x weight\) GEMM would multiply two e5m2 tensors"):
        Float8LinearConfig(input=CastConfig(E5M2), weight=CastConfig(E5M2))


def test_e5m2_times_e5m2_grad_input():
    with pytest.raises(ValueError, match=r"the grad_input \(grad_output x weight\) GEMM would multiply two e5m2 tensors"):
        Float8LinearConfig(weight=CastConfig(E5M2))


def test_e5m2_times_e5m2_grad_weight():
    with pytest.raises(ValueError, match=r"the grad_weight \(grad_output x input\) GEMM would multiply two e5m2.*use e4m3"):
        Float8LinearConfig(input=CastConfig(E5M2))


def test_e5m2_input_allowed_when_the_weight_gradient_stays_in_high_precision():
    config = Float8LinearConfig(input=CastConfig(E5M2), weight_grad_in_hp=True)
    assert config.input.dtype == E5M2


@pytest.mark.parametrize("history_len", [0, -3, True, 2.0, "16"])
def test_bad_history_len(history_len):
    with pytest.raises(ValueError, match=rf"history_len must be an int >= 1; got {history_len!r}"):
        DelayedScalingConfig(history_len=history_len)


def test_bad_history_reduction():
    with pytest.raises(ValueError, match=r"reduction must be one of \('max', 'most_recent'\); got 'mean'"):
        DelayedScalingConfig(reduction="mean")


@pytest.mark.parametrize("margin", [-1, 0.5, False])
def test_bad_margin(margin):
    with pytest.raises(ValueError, match=rf"margin must be an int >= 0; got {margin!r}"):
        DelayedScalingConfig(margin=margin)


def test_unknown_recipe():
    with pytest.raises(ValueError, match=r"unknown recipe 'fp8'; choose one of \['blockwise', 'delayed', 'mxfp4', 'mxfp8', 'nvfp4', 'rowwise', 'rowwise_with_gw_hp', 'tensorwise'\]"):
        Float8LinearConfig.from_recipe("fp8")


def test_unknown_recipe_override():
    with pytest.raises(TypeError, match=r"unknown Float8LinearConfig field 'pad_inner'; fields are .*pad_inner_dim"):
        Float8LinearConfig.from_recipe("tensorwise", pad_inner=True)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8"])
def test_fsdp_float8_all_gather_for_every_recipe(recipe):
    assert Float8LinearConfig.from_recipe(recipe, enable_fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather


def test_fsdp_float8_all_gather_with_tensorwise():
    assert Float8LinearConfig.from_recipe("tensorwise", enable_fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather


def test_operand_must_be_a_cast_config():
    with pytest.raises(TypeError, match=r"Float8LinearConfig.weight must be a CastConfig; got 'rowwise'"):
        Float8LinearConfig(weight="rowwise")  # type: ignore[arg-type]


def test_delayed_must_be_a_delayed_scaling_config():
    with pytest.raises(TypeError, match=r"Float8LinearConfig.delayed must be a DelayedScalingConfig; got 16"):
        Float8LinearConfig(delayed=16)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["weight_grad_in_hp", "pad_inner_dim", "use_fast_accum", "enable_fsdp_float8_all_gather", "collect_stats"])
def test_flags_must_be_bool(field):
    with pytest.raises(TypeError, match=rf"Float8LinearConfig.{field} must be a bool; got 1"):
        Float8LinearConfig(**{field: 1})


def test_float8_linear_rejects_a_non_config():
    with pytest.raises(TypeError, match=r"config must be a Float8LinearConfig \(e.g. Float8LinearConfig.from_recipe\('rowwise'\)\); got str"):
        Float8Linear(32, 32, config="rowwise")  # type: ignore[arg-type]


def test_float8_linear_rejects_unaligned_dims():
    with pytest.raises(ValueError, match=r"Float8Linear\(30, 64\): FP8 GEMMs need .* multiples of 16; pass a config with pad_inner_dim=True"):
        Float8Linear(30, 64)


def test_float8_linear_from_float_rejects_a_non_linear():
    with pytest.raises(TypeError, match="from_float expects an nn.Linear; got Conv1d"):
        Float8Linear.from_float(torch.nn.Conv1d(16, 16, 1))
