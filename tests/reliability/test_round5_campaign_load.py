"""Round 5 campaign: ``load_fp8_pretrained`` of hand-written checkpoints: formats, dtypes and refusals.

Checkpoints come from :mod:`round5_checkpoints`; the reference is the plain model holding the
file's dequantized weights (what transformers' ``from_pretrained`` of an FP8 checkpoint computes).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from round5_checkpoints import (
    DTYPES,
    KINDS,
    LINEARS,
    LOGITS_MIN_DB,
    UP,
    build_model,
    deepseek_checkpoint,
    dequantized_model,
    frozen_layers,
    logits_of,
    quiet,
    write_checkpoint,
)

from f8tensor import Float8LinearConfig, sqnr
from f8tensor.export import load_fp8_pretrained
from f8tensor.tensor.float8 import dequantize


@pytest.fixture(autouse=True)
def _quiet():
    with quiet():
        yield


@pytest.fixture
def deepseek(tmp_path):
    return deepseek_checkpoint(tmp_path)


# ---------------------------------------------------------------- formats, dtypes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_frozen_load_computes_as_the_dequantized_model(tmp_path, kind, dtype):
    source = build_model(dtype)
    dequantized = write_checkpoint(str(tmp_path / kind), source, kind)
    model = load_fp8_pretrained(build_model(dtype, meta=True), str(tmp_path / kind))
    assert len(frozen_layers(model)) == len(LINEARS)
    logits, want = logits_of(model), logits_of(dequantized_model(source, dequantized, dtype))
    assert logits.dtype == want.dtype == dtype
    assert sqnr(want.float(), logits.float()) >= LOGITS_MIN_DB
    for key, w in dequantized.items():
        # The layer holds 1 / multiplier: two fp32 reciprocals, within an ulp of the file's.
        held = dequantize(model.get_submodule(key.removesuffix(".weight")).weight, torch.float32)
        torch.testing.assert_close(held, w, rtol=2**-22, atol=0, msg=key)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_trainable_load_holds_the_dequantized_weights_in_the_model_dtype(tmp_path, dtype):
    source = build_model(dtype)
    dequantized = write_checkpoint(str(tmp_path / "c"), source)
    model = load_fp8_pretrained(build_model(dtype), str(tmp_path / "c"), frozen=False)
    for key, w in dequantized.items():
        p = model.get_parameter(key)
        assert p.dtype == dtype and p.requires_grad and torch.equal(p.detach(), w.to(dtype)), key


def test_untied_lm_head_is_loaded_from_the_file(tmp_path):
    source = build_model(tie=False)
    write_checkpoint(str(tmp_path / "u"), source)
    model = load_fp8_pretrained(build_model(meta=True, tie=False), str(tmp_path / "u"))
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_tied_lm_head_stays_tied(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_meta_model_is_materialised_on_cpu(tmp_path):
    write_checkpoint(str(tmp_path / "m"), build_model(torch.float16))
    model = load_fp8_pretrained(build_model(torch.float16, meta=True), str(tmp_path / "m"))
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cpu"}
    assert torch.isfinite(logits_of(model)).all()


@pytest.mark.parametrize("shards", [2, 3])
def test_sharded_checkpoint_loads_as_one_file(tmp_path, deepseek, shards):
    path, source, _ = deepseek
    write_checkpoint(str(tmp_path / "sharded"), source, shards=shards)
    one, many = (
        load_fp8_pretrained(build_model(meta=True), path),
        load_fp8_pretrained(build_model(meta=True), str(tmp_path / "sharded")),
    )
    assert torch.equal(logits_of(one), logits_of(many))


def test_mxfp8_extreme_codes_load_exactly(tmp_path):
    def extremes(t):
        t[UP + ".weight_scale_inv"][0, 0] = 0  # 2**-127
        t[UP + ".weight_scale_inv"][0, 1] = 254  # 2**127

    write_checkpoint(str(tmp_path / "mx"), build_model(), "mxfp8", edit=extremes)
    model = load_fp8_pretrained(build_model(meta=True), str(tmp_path / "mx"))
    assert torch.equal(model.get_submodule(UP).checkpoint_scale[0, :2], torch.tensor([0, 254], dtype=torch.uint8))


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_scales_load_as_their_fp32_values(tmp_path, scale_dtype):
    def to_half(t):
        for k in [k for k in t if k.endswith("_scale_inv")]:
            t[k] = t[k].to(scale_dtype)

    write_checkpoint(str(tmp_path / "h"), build_model(), edit=to_half)
    model = load_fp8_pretrained(build_model(meta=True), str(tmp_path / "h"))
    held = torch.reciprocal(model.get_submodule(UP).weight._scale)
    torch.testing.assert_close(held, model.get_submodule(UP).checkpoint_scale.float(), rtol=2**-23, atol=0)


def test_zero_dim_tensorwise_scale_loads(tmp_path):
    def zero_dim(t):
        t[UP + ".weight_scale"] = t[UP + ".weight_scale"].reshape(())

    write_checkpoint(str(tmp_path / "z"), build_model(), "ct_tensor", edit=zero_dim)
    model = load_fp8_pretrained(build_model(meta=True), str(tmp_path / "z"))
    assert model.get_submodule(UP).weight._scale.dim() == 0


# --------------------------------------------------------------------- refusals

_SCALE = UP + ".weight_scale_inv"
_TINY = torch.finfo(torch.float32).tiny


def _fill(key: str, value: float):
    def edit(t):
        t[key] = t[key].index_fill(0, torch.tensor([0]), value)

    return edit


def _set(key: str, value):
    def edit(t):
        t[key] = value(t[key]) if callable(value) else value

    return edit


REFUSED = [
    ("scale_nan", _fill(_SCALE, float("nan")), "must hold finite positive multipliers"),
    ("scale_inf", _fill(_SCALE, float("inf")), "must hold finite positive multipliers"),
    ("scale_minus_inf", _fill(_SCALE, float("-inf")), "must hold finite positive multipliers"),
    ("scale_zero", _fill(_SCALE, 0.0), "must hold finite positive multipliers"),
    ("scale_negative", _fill(_SCALE, -0.01), "must hold finite positive multipliers"),
    # Found: a subnormal multiplier's reciprocal is inf in fp32: the weight read as zeros.
    ("scale_subnormal", _fill(_SCALE, 1e-40), r"1 / multiplier and 448 \* multiplier are finite"),
    ("scale_below_range", _fill(_SCALE, 2.9e-39), r"1 / multiplier and 448 \* multiplier are finite"),
    # Found: a multiplier above fp32 max / 448 made inf weights and NaN logits.
    ("scale_huge", _fill(_SCALE, 1e36), r"1 / multiplier and 448 \* multiplier are finite"),
    ("scale_fp32_max", _fill(_SCALE, 3.4e38), r"1 / multiplier and 448 \* multiplier are finite"),
    ("scale_fp64", _set(_SCALE, lambda s: s.double()), "must be an fp32"),
    ("scale_int", _set(_SCALE, lambda s: s.int()), "must be an fp32"),
    ("scale_shape", _set(_SCALE, lambda s: s.t().contiguous()[:1]), "weight_scale_inv has shape"),
    ("scale_missing", lambda t: t.pop(_SCALE), "stored in torch.float8_e4m3fn with no weight_scale_inv"),
    ("weight_missing", lambda t: t.pop(UP + ".weight"), "has no model.layers.0.mlp.up_proj.weight beside it"),
    ("weight_e5m2", _set(UP + ".weight", lambda w: w.float().to(torch.float8_e5m2)), "must be a 2D float8_e4m3fn"),
    ("weight_bf16", _set(UP + ".weight", lambda w: w.float().bfloat16()), "must be a 2D float8_e4m3fn"),
    ("weight_shape", _set(UP + ".weight", lambda w: w[:128]), r"up_proj.weight has shape \(128, 128\)"),
    ("norm_missing", lambda t: t.pop("model.norm.weight"), "lacks 1 of the model's tensors: model.norm.weight"),
    ("embed_missing", lambda t: t.pop("model.embed_tokens.weight"), "lacks .* model.embed_tokens.weight"),
    ("extra_tensor", _set("extra.weight", torch.zeros(2)), "extra.weight in the checkpoint is not in the model"),
    (
        "extra_fp8_module",
        _set("model.layers.0.mlp.extra_proj.weight_scale_inv", torch.ones(1, 1)),
        "has no model.layers.0.mlp.extra_proj.weight beside it",
    ),
    ("norm_shape", _set("model.norm.weight", lambda w: w[:64]), "model.norm.weight has shape"),
]


@pytest.mark.parametrize("edit, match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_bad_checkpoint_is_refused_and_the_model_unchanged(tmp_path, edit, match):
    source = build_model()
    write_checkpoint(str(tmp_path / "bad"), source, edit=edit)
    model = build_model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_fp8_pretrained(model, str(tmp_path / "bad"))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("edit_kind", ["ct_channel", "ct_tensor"])
def test_subnormal_compressed_tensors_scale_is_refused(tmp_path, edit_kind):
    write_checkpoint(str(tmp_path / "ct"), build_model(), edit_kind, edit=_fill(UP + ".weight_scale", 1e-40))
    with pytest.raises(ValueError, match=r"weight_scale must hold finite positive multipliers in"):
        load_fp8_pretrained(build_model(), str(tmp_path / "ct"))


def test_channel_scale_without_its_column_is_refused(tmp_path):
    write_checkpoint(
        str(tmp_path / "ct"), build_model(), "ct_channel", edit=_set(UP + ".weight_scale", lambda s: s.reshape(-1))
    )
    with pytest.raises(ValueError, match=r"up_proj.weight_scale has shape \(256,\); the weight needs \(256, 1\)"):
        load_fp8_pretrained(build_model(), str(tmp_path / "ct"))


def test_mxfp8_nan_code_is_refused(tmp_path):
    write_checkpoint(str(tmp_path / "mx"), build_model(), "mxfp8", edit=_fill(_SCALE, 255))
    with pytest.raises(ValueError, match="e8m0 NaN code 255"):
        load_fp8_pretrained(build_model(), str(tmp_path / "mx"))


@pytest.mark.parametrize("value", [_TINY, 7.5e35], ids=["smallest_normal", "near_max"])
def test_multipliers_inside_the_range_load_finite(tmp_path, value):
    write_checkpoint(str(tmp_path / "r"), build_model(torch.float32), edit=_fill(_SCALE, value))
    model = load_fp8_pretrained(build_model(torch.float32, meta=True), str(tmp_path / "r"))
    assert torch.isfinite(dequantize(model.get_submodule(UP).weight, torch.float32)).all()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"fmt": "e5m2"}, "fmt must be 'e4m3'"),
        ({"weight_block_size": [64, 64]}, "weight_block_size"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not read"),
        ({"scale_fmt": "e8m0"}, "scale_fmt must be absent or 'ue8m0'"),
    ],
    ids=["fmt_e5m2", "block_64", "bitsandbytes", "scale_fmt"],
)
def test_unread_quantization_config_is_refused(deepseek, change, match):
    path, _, _ = deepseek
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(change)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=match):
        load_fp8_pretrained(build_model(), path)


def test_index_naming_a_missing_shard_is_refused(tmp_path, deepseek):
    _, source, _ = deepseek
    path = str(tmp_path / "sharded")
    write_checkpoint(path, source, shards=2)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError):
        load_fp8_pretrained(build_model(), path)


def test_loading_twice_names_the_frozen_layer(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    with pytest.raises(NotImplementedError, match="already holds a frozen FP8 weight"):
        load_fp8_pretrained(model, path)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"config": "rowwise"}, TypeError, "config must be a Float8LinearConfig; got str"),
        ({"frozen": 1}, TypeError, "frozen must be a bool; got 1"),
        (
            {"config": Float8LinearConfig.from_recipe("rowwise", enable_fsdp_float8_all_gather=True)},
            ValueError,
            "no FP8 all-gather",
        ),
    ],
    ids=["config_str", "frozen_int", "frozen_all_gather"],
)
def test_bad_arguments_are_refused_by_name(deepseek, kwargs, error, match):
    path, _, _ = deepseek
    with pytest.raises(error, match=match):
        load_fp8_pretrained(build_model(), path, **kwargs)


def test_missing_directory_names_its_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_fp8_pretrained(build_model(), tmp_path / "nowhere")


def test_trainable_load_with_fp8_all_gather_wraps_the_masters(deepseek):
    from f8tensor import Float8AllGatherWeight

    path, _, dequantized = deepseek
    config = Float8LinearConfig.from_recipe("blockwise", enable_fsdp_float8_all_gather=True)
    model = load_fp8_pretrained(build_model(meta=True), pathlib.Path(path), frozen=False, config=config)
    up = model.get_submodule(UP)
    assert isinstance(up.weight, Float8AllGatherWeight)
    assert torch.equal(up.weight._hp, dequantized[UP + ".weight"].bfloat16())


def test_fp8_norm_without_a_scale_is_refused_by_name(tmp_path):
    write_checkpoint(
        str(tmp_path / "n"), build_model(), edit=_set("model.norm.weight", lambda w: w.float().to(torch.float8_e4m3fn))
    )
    with pytest.raises(NotImplementedError, match="model.norm.weight is a 1D FP8 tensor"):
        load_fp8_pretrained(build_model(), str(tmp_path / "n"))
