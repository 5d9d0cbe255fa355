"""Float8LinearConfig and its parts: recipes, validation messages, dataclasses.replace."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from f8tensor import (
    FP4_CAST_DTYPE,
    RECIPES,
    BlockGranularity,
    CastConfig,
    DelayedScalingConfig,
    Float8Linear,
    Float8LinearConfig,
    GemmOverride,
    Granularity,
    MX_1x32_FLOOR,
    NVFP4_1x16,
    ScalingType,
)
from f8tensor.quant import config as config_module
from f8tensor.quant.config import MAX_HISTORY_LEN, CastSpec, max_margin
from f8tensor.quant.recipes import RECIPE_FIELDS

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
    with pytest.raises(
        ValueError,
        match=r"granularity must be one of 'tensorwise', 'rowwise', 'BLOCK_1x128', .*'MX_1x32', .*; got 'colwise'$",
    ):
        CastConfig(E4M3, granularity="colwise")


def test_bad_scaling():
    with pytest.raises(ValueError, match=r"scaling must be one of 'dynamic', 'delayed'; got 'static'"):
        CastConfig(E4M3, scaling="static")


def test_rowwise_with_delayed_scaling():
    with pytest.raises(
        ValueError, match="delayed scaling keeps one amax history per tensor: it needs granularity='tensorwise'"
    ):
        CastConfig(E4M3, granularity="rowwise", scaling="delayed")


def test_power_of_2_scale_must_be_bool():
    with pytest.raises(TypeError, match=r"CastConfig.power_of_2_scale must be a bool; got 1"):
        CastConfig(E4M3, power_of_2_scale=1)  # type: ignore[arg-type]


def test_e5m2_times_e5m2_forward():
    with pytest.raises(ValueError, match=r"the forward \(input x weight\) GEMM would multiply two e5m2 tensors"):
        Float8LinearConfig(input=CastConfig(E5M2), weight=CastConfig(E5M2))


def test_e5m2_times_e5m2_grad_input():
    with pytest.raises(
        ValueError, match=r"the grad_input \(grad_output x weight\) GEMM would multiply two e5m2 tensors"
    ):
        Float8LinearConfig(weight=CastConfig(E5M2))


def test_e5m2_times_e5m2_grad_weight():
    with pytest.raises(
        ValueError, match=r"the grad_weight \(grad_output x input\) GEMM would multiply two e5m2.*use e4m3"
    ):
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
    with pytest.raises(
        ValueError,
        match=r"unknown recipe 'fp8'; choose one of \['blockwise', 'delayed', 'mxfp4', 'mxfp8', 'nvfp4', 'rowwise', 'rowwise_with_gw_hp', 'tensorwise'\]",
    ):
        Float8LinearConfig.from_recipe("fp8")


def test_unknown_recipe_override():
    with pytest.raises(TypeError, match=r"unknown Float8LinearConfig field 'pad_inner'; fields are .*pad_inner_dim"):
        Float8LinearConfig.from_recipe("tensorwise", pad_inner=True)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8"])
def test_fsdp_float8_all_gather_for_every_recipe(recipe):
    assert Float8LinearConfig.from_recipe(recipe, enable_fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather


def test_fsdp_float8_all_gather_with_tensorwise():
    assert Float8LinearConfig.from_recipe(
        "tensorwise", enable_fsdp_float8_all_gather=True
    ).enable_fsdp_float8_all_gather


def test_operand_must_be_a_cast_config():
    with pytest.raises(TypeError, match=r"Float8LinearConfig.weight must be a CastConfig; got 'rowwise'"):
        Float8LinearConfig(weight="rowwise")  # type: ignore[arg-type]


def test_delayed_must_be_a_delayed_scaling_config():
    with pytest.raises(TypeError, match=r"Float8LinearConfig.delayed must be a DelayedScalingConfig; got 16"):
        Float8LinearConfig(delayed=16)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", ["weight_grad_in_hp", "pad_inner_dim", "use_fast_accum", "enable_fsdp_float8_all_gather", "collect_stats"]
)
def test_flags_must_be_bool(field):
    with pytest.raises(TypeError, match=rf"Float8LinearConfig.{field} must be a bool; got 1"):
        Float8LinearConfig(**{field: 1})


def test_float8_linear_rejects_a_non_config():
    with pytest.raises(
        TypeError,
        match=r"config must be a Float8LinearConfig \(e.g. Float8LinearConfig.from_recipe\('rowwise'\)\); got str",
    ):
        Float8Linear(32, 32, config="rowwise")  # type: ignore[arg-type]


def test_float8_linear_rejects_unaligned_dims():
    with pytest.raises(
        ValueError,
        match=r"Float8Linear\(30, 64\): FP8 GEMMs need .* multiples of 16; pass a config with pad_inner_dim=True",
    ):
        Float8Linear(30, 64)


def test_float8_linear_from_float_rejects_a_non_linear():
    with pytest.raises(TypeError, match="from_float expects an nn.Linear; got Conv1d"):
        Float8Linear.from_float(torch.nn.Conv1d(16, 16, 1))


# ----------------------------------------------------------------------------- every refusal, in full
#
# Each refusal's whole message: what was wrong and what is allowed (anchored, so that a
# message that lost or gained words fails).

_FP8 = "torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz"


def _full(message: str) -> str:
    return "^" + re.escape(message) + "$"


def test_cast_config_refusals_in_full():
    with pytest.raises(
        TypeError,
        match=_full(
            f"CastConfig.dtype must be one of {_FP8} (or torch.float4_e2m1fn_x2, FP4_CAST_DTYPE, with an NVFP4/MXFP4 "
            "granularity); got torch.float16"
        ),
    ):
        CastConfig(torch.float16)
    with pytest.raises(
        ValueError, match=_full("CastConfig.rounding must be one of ('nearest', 'stochastic'); got 'up'")
    ):
        CastConfig(E4M3, rounding="up")
    with pytest.raises(
        ValueError, match=_full("delayed scaling keeps one amax history per tensor: it needs granularity='tensorwise'")
    ):
        CastConfig(E4M3, granularity="rowwise", scaling="delayed")
    with pytest.raises(
        ValueError, match=_full("a Float8Linear operand's block has 2 entries (rows, contracted); got (1, 1, 128)")
    ):
        CastConfig(E4M3, granularity=(1, 1, 128))


def test_fp4_cast_config_refusals_in_full():
    fp4_granularity = "an FP4 CastConfig needs an FP4 granularity: NVFP4_1x16, NVFP4_16x16 (e4m3fn scales) or MXFP4_1x32 (e8m0 scales); got "
    for granularity in (BlockGranularity((1, 16)), BlockGranularity((1, 64), torch.float8_e8m0fnu), "rowwise"):
        parsed = BlockGranularity(*granularity) if isinstance(granularity, BlockGranularity) else Granularity.ROWWISE
        with pytest.raises(ValueError, match=_full(fp4_granularity + repr(parsed))):
            CastConfig(FP4_CAST_DTYPE, granularity)
    dynamic = "FP4 casts take dynamic block scales (no delayed scaling, no power_of_2_scale)"
    with pytest.raises(ValueError, match=_full(dynamic)):
        CastConfig(FP4_CAST_DTYPE, NVFP4_1x16, power_of_2_scale=True)
    with pytest.raises(ValueError, match=_full(dynamic)):
        CastConfig(FP4_CAST_DTYPE, NVFP4_1x16, scaling="delayed")
    with pytest.raises(
        ValueError, match=_full(f"e4m3fn block scales are NVFP4's: use dtype=FP4_CAST_DTYPE with {NVFP4_1x16!r}")
    ):
        CastConfig(E4M3, NVFP4_1x16)


def test_delayed_scaling_config_bounds_and_refusals_in_full():
    """history_len in [1, MAX_HISTORY_LEN], margin in [0, the largest max_margin]: both ends
    of each range are accepted, one past them refused with the range."""
    largest = max(max_margin(d) for d in (E4M3, E5M2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz))
    for ok in (
        DelayedScalingConfig(history_len=1),
        DelayedScalingConfig(history_len=MAX_HISTORY_LEN),
        DelayedScalingConfig(margin=largest),
    ):
        assert ok.history_len in (1, MAX_HISTORY_LEN, 16)
    with pytest.raises(ValueError, match=_full("DelayedScalingConfig.history_len must be an int >= 1; got 0")):
        DelayedScalingConfig(history_len=0)
    with pytest.raises(
        ValueError,
        match=_full(
            f"DelayedScalingConfig.history_len must be in [1, {MAX_HISTORY_LEN}] (every delayed cast reduces the whole "
            f"window, and each layer keeps three); got {MAX_HISTORY_LEN + 1}"
        ),
    ):
        DelayedScalingConfig(history_len=MAX_HISTORY_LEN + 1)
    with pytest.raises(
        ValueError, match=_full("DelayedScalingConfig.reduction must be one of ('max', 'most_recent'); got 'mean'")
    ):
        DelayedScalingConfig(reduction="mean")
    with pytest.raises(ValueError, match=_full("DelayedScalingConfig.margin must be an int >= 0; got -1")):
        DelayedScalingConfig(margin=-1)
    with pytest.raises(
        ValueError,
        match=_full(
            f"DelayedScalingConfig.margin must be in [0, {largest}] (and at most {max_margin(E4M3)} for e4m3fn); got {largest + 1}"
        ),
    ):
        DelayedScalingConfig(margin=largest + 1)


def test_max_margin_keeps_the_amax_a_normal_number():
    """floor(log2(max / smallest_normal)): e4m3fn 448 / 2**-6, e5m2 57344 / 2**-14."""
    assert (max_margin(E4M3), max_margin(E5M2)) == (
        math.floor(math.log2(448 * 2**6)),
        math.floor(math.log2(57344 * 2**14)),
    )
    assert max_margin(torch.float8_e4m3fnuz) == math.floor(math.log2(240 * 2**7))


def test_float8_linear_config_refusals_in_full():
    delayed = Float8LinearConfig.from_recipe("delayed")
    at_most = dataclasses.replace(delayed, delayed=DelayedScalingConfig(margin=max_margin(E4M3)))
    assert at_most.delayed.margin == 14
    with pytest.raises(
        ValueError,
        match=_full(
            "DelayedScalingConfig.margin=15 would scale the input's amax below the smallest normal torch.float8_e4m3fn "
            "number (flushing the tensor to zero); the most torch.float8_e4m3fn allows is 14"
        ),
    ):
        dataclasses.replace(delayed, delayed=DelayedScalingConfig(margin=15))
    with pytest.raises(
        ValueError,
        match=_full(
            "every operand must use one FP8 family, fn (e4m3fn, e5m2) or fnuz (e4m3fnuz, e5m2fnuz): the GEMMs multiply "
            "them together; got input=torch.float8_e4m3fn, weight=torch.float8_e4m3fnuz, grad_output=torch.float8_e5m2"
        ),
    ):
        Float8LinearConfig(weight=CastConfig(torch.float8_e4m3fnuz))
    with pytest.raises(
        ValueError,
        match=_full(
            "the forward (input x weight) GEMM would multiply two e5m2 tensors, which torch._scaled_mm refuses; use e4m3 for one of them"
        ),
    ):
        Float8LinearConfig(
            input=CastConfig(torch.float8_e5m2fnuz),
            weight=CastConfig(torch.float8_e5m2fnuz),
            grad_output=CastConfig(torch.float8_e4m3fnuz),
        )
    with pytest.raises(
        ValueError,
        match=_full("FP4 casts and per-GEMM formats use dynamic scaling; this config also asks for delayed scaling"),
    ):
        dataclasses.replace(delayed, gemm_overrides={("forward", "input"): None})
    with pytest.raises(
        ValueError,
        match=_full(
            "enable_fsdp_float8_all_gather gathers FP8 weights; FP4 casts and per-GEMM formats are not gathered in low "
            "precision (leave it False: FSDP2 gathers these weights in high precision)"
        ),
    ):
        Float8LinearConfig.from_recipe("nvfp4", enable_fsdp_float8_all_gather=True)
    for name in ("hadamard_wgrad", "four_over_six", "emulate"):
        with pytest.raises(TypeError, match=_full(f"Float8LinearConfig.{name} must be a bool; got 1")):
            Float8LinearConfig(**{name: 1})
    with pytest.raises(TypeError, match=_full("Float8LinearConfig.input must be a CastConfig; got None")):
        Float8LinearConfig(input=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=_full("Float8LinearConfig.delayed must be a DelayedScalingConfig; got 16")):
        Float8LinearConfig(delayed=16)  # type: ignore[arg-type]


def test_from_recipe_refusals_in_full():
    fields = ", ".join(f.name for f in dataclasses.fields(Float8LinearConfig))
    assert fields.startswith("input, weight, grad_output, weight_grad_in_hp, delayed")
    with pytest.raises(TypeError, match=_full(f"unknown Float8LinearConfig field 'pad_inner'; fields are {fields}")):
        Float8LinearConfig.from_recipe("tensorwise", pad_inner=True)


def test_with_gemm_formats_names_its_argument_in_refusals():
    config = Float8LinearConfig.from_recipe("mxfp8")
    merged = config.with_gemm_formats({("grad_weight", "input"): None}, pad_inner_dim=True)
    assert merged.pad_inner_dim and merged.gemm_overrides == (GemmOverride("grad_weight", "input", None),)
    field = "with_gemm_formats(overrides) (merged into gemm_overrides)"
    with pytest.raises(
        ValueError, match=_full(f"{field}: unknown GEMM 'backward'; GEMMs are forward, grad_input, grad_weight")
    ):
        config.with_gemm_formats({("backward", "input"): None})
    with pytest.raises(
        ValueError,
        match=_full("gemm_overrides: the forward GEMM multiplies input and weight; got operand 'grad_output'"),
    ):
        Float8LinearConfig(gemm_overrides={("forward", "grad_output"): None})


def test_operand_spec_from_the_granularity():
    """The CastSpec of a GEMM operand, written out from each granularity's definition."""
    rows, tiles, mx = CastConfig(E5M2, "rowwise"), CastConfig(E4M3, (1, 128)), CastConfig(E4M3, MX_1x32_FLOOR)
    assert CastConfig(E4M3).operand_spec(1) == CastSpec(E4M3)
    assert CastConfig(E4M3).operand_spec(2, ndim=3, per_expert=True) == CastSpec(E4M3, (1, 0, 0))
    assert rows.operand_spec(1) == CastSpec(E5M2, (1, 0))
    assert rows.operand_spec(0) == CastSpec(E5M2, (0, 1))
    assert rows.operand_spec(-2, ndim=3) == CastSpec(E5M2, (1, 0, 1))
    assert tiles.operand_spec(1) == CastSpec(E4M3, (1, 128))
    assert tiles.operand_spec(0) == CastSpec(E4M3, (128, 1))
    assert mx.operand_spec(0, ndim=3) == CastSpec(E4M3, (1, 32, 1), torch.float8_e8m0fnu, "floor")
    pow2 = CastConfig(E4M3, "rowwise", power_of_2_scale=True, rounding="stochastic")
    assert pow2.operand_spec(1) == CastSpec(E4M3, (1, 0), torch.float32, "rceil", True, "stochastic")


def test_gemm_override_refusals_in_full():
    form = (
        "a dict {(gemm, operand): CastConfig or None} or a sequence of GemmOverride(gemm, operand, cast) "
        "(or (gemm, operand, cast) tuples), e.g. {('forward', 'input'): None}"
    )
    with pytest.raises(TypeError, match=_full(f"gemm_overrides must be {form}; got 'forward'")):
        Float8LinearConfig(gemm_overrides="forward")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=_full(
            f"gemm_overrides: each entry must be a GemmOverride(gemm, operand, cast) or a (gemm, operand, cast) tuple; "
            f"got ('forward', 'input') (gemm_overrides must be {form})"
        ),
    ):
        Float8LinearConfig(gemm_overrides=[("forward", "input")])  # type: ignore[list-item]
    with pytest.raises(
        TypeError,
        match=_full(
            f"gemm_overrides: a GEMM override is keyed by (gemm, operand); got 'forward' (gemm_overrides must be {form})"
        ),
    ):
        Float8LinearConfig(gemm_overrides={"forward": None})  # type: ignore[dict-item]
    for key in ("ab", ("forward", "input", "weight")):
        with pytest.raises(
            TypeError,
            match=_full(
                f"gemm_overrides: a GEMM override is keyed by (gemm, operand); got {key!r} (gemm_overrides must be {form})"
            ),
        ):
            Float8LinearConfig(gemm_overrides={key: None})  # type: ignore[dict-item]
    with pytest.raises(
        TypeError,
        match=_full("gemm_overrides: a GEMM override's cast is a CastConfig or None (high precision); got 'e4m3'"),
    ):
        Float8LinearConfig(gemm_overrides={("forward", "input"): "e4m3"})  # type: ignore[dict-item]
    with pytest.raises(
        ValueError,
        match=_full("gemm_overrides: per-GEMM formats use dynamic scaling; a delayed CastConfig cannot be an override"),
    ):
        Float8LinearConfig(gemm_overrides={("forward", "input"): CastConfig(E4M3, scaling="delayed")})


def test_the_recipe_builder_makes_the_recipe_table():
    """``RECIPES`` is built at import; the builder, called again, makes the same configs,
    each role a CastConfig and every other field as the recipe names it."""
    for name, fields in RECIPE_FIELDS.items():
        built = config_module._recipe(fields)
        assert built == RECIPES[name]
        for role in ("input", "weight", "grad_output"):
            assert isinstance(getattr(built, role), CastConfig)
        for key, value in fields.items():
            if key not in ("input", "weight", "grad_output"):
                assert getattr(built, key) == value
