"""Round 5 campaign: ``load_fp8_pretrained`` of checkpoints written here by hand, as a user would load them.

Checkpoints are quantized from the definition (multiplier = block amax / 448, bytes =
weight / multiplier in e4m3) and written with safetensors and a config.json in each test.
References: the dequantized weights (``bytes * multiplier``, what transformers'
``from_pretrained`` of an FP8 checkpoint computes) loaded into the plain model, and torch's
own optimizers, ``deepcopy``, ``state_dict`` and ``.to`` on that model. Tiny Llama models.
"""

from __future__ import annotations

import copy
import io
import json
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from f8tensor import Float8LinearConfig, sqnr
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear, FrozenFloat8Weight
from f8tensor.tensor.float8 import dequantize

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UP = "model.layers.0.mlp.up_proj"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["deepseek", "deepseek_ue8m0", "ct_block", "ct_channel", "ct_tensor", "mxfp8"]
# Logits of the loaded model (FP8 activations too) against the dequantized model's: measured
# 28.9-33.1 dB over KINDS x DTYPES (tensorwise lowest).
LOGITS_MIN_DB = 26.0


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no cpu kernel.*")
        yield


def _model(
    dtype: torch.dtype = torch.bfloat16,
    *,
    meta: bool = False,
    tie: bool = True,
    seed: int = 0,
    ffn: int = 256,
    bias: bool = False,
):
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=ffn,
        attention_bias=bias,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _is_linear(key: str) -> bool:
    return key.endswith(".weight") and key.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS


def _quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 bytes, on-disk scale, dense fp32 multiplier) of ``w`` from the definition."""
    w = w.float()
    n, k = w.shape
    if kind == "mxfp8":
        amax = w.reshape(n, k // 32, 32).abs().amax(-1)
        code = (torch.ceil(torch.log2(amax.clamp(min=2**-100) / 448)) + 127).clamp(0, 254).to(torch.uint8)
        m = torch.exp2(code.float() - 127)
        dense = m.repeat_interleave(32, 1)
        return (w / dense).to(torch.float8_e4m3fn), code, dense
    if kind in ("deepseek", "deepseek_ue8m0", "ct_block"):
        m = w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
        if kind == "deepseek_ue8m0":
            m = torch.exp2(torch.ceil(torch.log2(m)))  # powers of two, rounded up: no overflow
        dense = m.repeat_interleave(128, 0).repeat_interleave(128, 1)
    elif kind == "ct_channel":
        m = w.abs().amax(dim=1, keepdim=True) / 448
        dense = m.expand(n, k)
    else:
        m = w.abs().amax().reshape(1) / 448
        dense = m.expand(n, k)
    return (w / dense).to(torch.float8_e4m3fn), m.contiguous(), dense


def _quantization_config(kind: str) -> dict:
    if kind.startswith("deepseek"):
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        return {**q, "scale_fmt": "ue8m0"} if kind == "deepseek_ue8m0" else q
    if kind == "mxfp8":
        return {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0"}
    strategy = kind.removeprefix("ct_")
    weights = {"num_bits": 8, "type": "float", "strategy": strategy}
    weights["block_structure"] = [128, 128] if strategy == "block" else None
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def _write(path, source, kind: str = "deepseek", edit=None, shards: int = 1) -> dict[str, torch.Tensor]:
    """Write ``source`` quantized as ``kind``; returns {key: dequantized weight} of its linears."""
    os.makedirs(path, exist_ok=True)
    suffix = ".weight_scale_inv" if kind in ("deepseek", "deepseek_ue8m0", "mxfp8") else ".weight_scale"
    tensors, dequantized = {}, {}
    for key, value in source.state_dict().items():
        if key == "lm_head.weight" and source.config.tie_word_embeddings:
            continue  # tied: the file leaves it out
        if not _is_linear(key):
            tensors[key] = value.contiguous()
            continue
        data, scale, dense = _quantize(value, kind)
        tensors[key], tensors[key.removesuffix(".weight") + suffix] = data, scale
        dequantized[key] = data.float() * dense
    if edit is not None:
        edit(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        keys = sorted(tensors)
        weight_map = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[i::shards]}
            save_file(part, os.path.join(path, name))
            weight_map.update(dict.fromkeys(part, name))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = source.config.to_dict()
    config["quantization_config"] = _quantization_config(kind)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized


def _dequantized_model(source, dequantized: dict[str, torch.Tensor], dtype: torch.dtype):
    """The plain model holding the file's dequantized weights: the high-precision reference."""
    reference = copy.deepcopy(source).to(dtype)
    with torch.no_grad():
        for key, w in dequantized.items():
            reference.get_parameter(key).copy_(w.to(dtype))
    return reference


def _ids() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randint(0, 256, (2, 16))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _frozen(model) -> dict[str, FrozenFloat8Linear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, FrozenFloat8Linear)}


def _bytes(model) -> dict[str, torch.Tensor]:
    return {fqn: m.weight._data.view(torch.uint8).clone() for fqn, m in _frozen(model).items()}


@pytest.fixture
def deepseek(tmp_path):
    """(path, source model, dequantized weights) of a DeepSeek-V3-block checkpoint of a bf16 model."""
    source = _model()
    path = str(tmp_path / "deepseek")
    return path, source, _write(path, source)


# ---------------------------------------------------------------- formats, dtypes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_frozen_load_computes_as_the_dequantized_model(tmp_path, kind, dtype):
    source = _model(dtype)
    dequantized = _write(str(tmp_path / kind), source, kind)
    model = load_fp8_pretrained(_model(dtype, meta=True), str(tmp_path / kind))
    assert len(_frozen(model)) == len(LINEARS)
    logits, want = _logits(model), _logits(_dequantized_model(source, dequantized, dtype))
    assert logits.dtype == want.dtype == dtype
    assert sqnr(want.float(), logits.float()) >= LOGITS_MIN_DB
    for key, w in dequantized.items():
        # The layer holds 1 / multiplier: two fp32 reciprocals, within an ulp of the file's.
        held = dequantize(model.get_submodule(key.removesuffix(".weight")).weight, torch.float32)
        torch.testing.assert_close(held, w, rtol=2**-22, atol=0, msg=key)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_trainable_load_holds_the_dequantized_weights_in_the_model_dtype(tmp_path, dtype):
    source = _model(dtype)
    dequantized = _write(str(tmp_path / "c"), source)
    model = load_fp8_pretrained(_model(dtype), str(tmp_path / "c"), frozen=False)
    for key, w in dequantized.items():
        p = model.get_parameter(key)
        assert p.dtype == dtype and p.requires_grad and torch.equal(p.detach(), w.to(dtype)), key


def test_untied_lm_head_is_loaded_from_the_file(tmp_path):
    source = _model(tie=False)
    _write(str(tmp_path / "u"), source)
    model = load_fp8_pretrained(_model(meta=True, tie=False), str(tmp_path / "u"))
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_tied_lm_head_stays_tied(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_meta_model_is_materialised_on_cpu(tmp_path):
    _write(str(tmp_path / "m"), _model(torch.float16))
    model = load_fp8_pretrained(_model(torch.float16, meta=True), str(tmp_path / "m"))
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cpu"}
    assert torch.isfinite(_logits(model)).all()


@pytest.mark.parametrize("shards", [2, 3])
def test_sharded_checkpoint_loads_as_one_file(tmp_path, deepseek, shards):
    path, source, _ = deepseek
    _write(str(tmp_path / "sharded"), source, shards=shards)
    one, many = (
        load_fp8_pretrained(_model(meta=True), path),
        load_fp8_pretrained(_model(meta=True), str(tmp_path / "sharded")),
    )
    assert torch.equal(_logits(one), _logits(many))


def test_mxfp8_extreme_codes_load_exactly(tmp_path):
    def extremes(t):
        t[UP + ".weight_scale_inv"][0, 0] = 0  # 2**-127
        t[UP + ".weight_scale_inv"][0, 1] = 254  # 2**127

    _write(str(tmp_path / "mx"), _model(), "mxfp8", edit=extremes)
    model = load_fp8_pretrained(_model(meta=True), str(tmp_path / "mx"))
    assert torch.equal(model.get_submodule(UP).checkpoint_scale[0, :2], torch.tensor([0, 254], dtype=torch.uint8))


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_scales_load_as_their_fp32_values(tmp_path, scale_dtype):
    def to_half(t):
        for k in [k for k in t if k.endswith("_scale_inv")]:
            t[k] = t[k].to(scale_dtype)

    _write(str(tmp_path / "h"), _model(), edit=to_half)
    model = load_fp8_pretrained(_model(meta=True), str(tmp_path / "h"))
    held = torch.reciprocal(model.get_submodule(UP).weight._scale)
    torch.testing.assert_close(held, model.get_submodule(UP).checkpoint_scale.float(), rtol=2**-23, atol=0)


def test_zero_dim_tensorwise_scale_loads(tmp_path):
    def zero_dim(t):
        t[UP + ".weight_scale"] = t[UP + ".weight_scale"].reshape(())

    _write(str(tmp_path / "z"), _model(), "ct_tensor", edit=zero_dim)
    model = load_fp8_pretrained(_model(meta=True), str(tmp_path / "z"))
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
    (
        "fp8_norm_without_scale",
        _set("model.norm.weight", lambda w: w.float().to(torch.float8_e4m3fn)),
        "model.norm.weight is stored in torch.float8_e4m3fn",
    ),
    ("norm_shape", _set("model.norm.weight", lambda w: w[:64]), "model.norm.weight has shape"),
]


@pytest.mark.parametrize("edit, match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_bad_checkpoint_is_refused_and_the_model_unchanged(tmp_path, edit, match):
    source = _model()
    _write(str(tmp_path / "bad"), source, edit=edit)
    model = _model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_fp8_pretrained(model, str(tmp_path / "bad"))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("edit_kind", ["ct_channel", "ct_tensor"])
def test_subnormal_compressed_tensors_scale_is_refused(tmp_path, edit_kind):
    _write(str(tmp_path / "ct"), _model(), edit_kind, edit=_fill(UP + ".weight_scale", 1e-40))
    with pytest.raises(ValueError, match=r"weight_scale must hold finite positive multipliers in"):
        load_fp8_pretrained(_model(), str(tmp_path / "ct"))


def test_channel_scale_without_its_column_is_refused(tmp_path):
    _write(str(tmp_path / "ct"), _model(), "ct_channel", edit=_set(UP + ".weight_scale", lambda s: s.reshape(-1)))
    with pytest.raises(ValueError, match=r"up_proj.weight_scale has shape \(256,\); the weight needs \(256, 1\)"):
        load_fp8_pretrained(_model(), str(tmp_path / "ct"))


def test_mxfp8_nan_code_is_refused(tmp_path):
    _write(str(tmp_path / "mx"), _model(), "mxfp8", edit=_fill(_SCALE, 255))
    with pytest.raises(ValueError, match="e8m0 NaN code 255"):
        load_fp8_pretrained(_model(), str(tmp_path / "mx"))


@pytest.mark.parametrize("value", [_TINY, 7.5e35], ids=["smallest_normal", "near_max"])
def test_multipliers_inside_the_range_load_finite(tmp_path, value):
    _write(str(tmp_path / "r"), _model(torch.float32), edit=_fill(_SCALE, value))
    model = load_fp8_pretrained(_model(torch.float32, meta=True), str(tmp_path / "r"))
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
        load_fp8_pretrained(_model(), path)


def test_index_naming_a_missing_shard_is_refused(tmp_path, deepseek):
    _, source, _ = deepseek
    path = str(tmp_path / "sharded")
    _write(path, source, shards=2)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError):
        load_fp8_pretrained(_model(), path)


def test_loading_twice_names_the_frozen_layer(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    with pytest.raises(NotImplementedError, match="already holds a frozen FP8 weight"):
        load_fp8_pretrained(model, path)


# ---------------------------------------------------------- a loaded model in use


@pytest.mark.parametrize("make", ["adamw", "sgd_momentum", "f8tensor_adamw"])
def test_optimizer_steps_leave_the_frozen_bytes(deepseek, make):
    import f8tensor.optim

    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    before, norm = _bytes(model), model.model.norm.weight.detach().clone()
    params = list(model.parameters())
    opt = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1),
        "f8tensor_adamw": lambda: f8tensor.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    }[make]()
    for _ in range(2):
        model(_ids(), labels=_ids()).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(_bytes(model)[k], v) for k, v in before.items())
    assert all(m.weight.grad is None for m in _frozen(model).values())
    assert not torch.equal(model.model.norm.weight, norm)  # the rest trains, as in torch


def test_requires_grad_on_the_whole_model_is_refused_by_name(deepseek):
    # torch would set every parameter; a frozen FP8 weight cannot train (deliberate, named).
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    with pytest.raises(RuntimeError, match="frozen=False"):
        model.requires_grad_(True)


def test_state_dict_round_trips_through_torch_save(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other = load_fp8_pretrained(_model(meta=True, seed=1), path)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert all(isinstance(m.weight, FrozenFloat8Weight) for m in _frozen(other).values())
    assert torch.equal(_logits(other), _logits(model))


def test_state_dict_loads_into_the_plain_model_as_the_dequantized_weights(deepseek):
    path, _, dequantized = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    plain = _model(seed=1)
    plain.load_state_dict(model.state_dict())
    for key, w in dequantized.items():
        assert torch.equal(plain.get_parameter(key), w.bfloat16()), key


def test_deepcopy_keeps_the_frozen_weights(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    copied = copy.deepcopy(model)
    assert all(isinstance(m.weight, FrozenFloat8Weight) for m in _frozen(copied).values())
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert torch.equal(_logits(copied), _logits(model))
    with pytest.raises(RuntimeError, match="frozen=False"):
        copied.get_submodule(UP).weight.requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_to_dtype_keeps_the_bytes_and_computes_in_it(deepseek, dtype):
    path, source, dequantized = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    before = _bytes(model)
    model.to(dtype)
    assert all(torch.equal(_bytes(model)[k], v) for k, v in before.items())
    assert all(isinstance(m.weight, FrozenFloat8Weight) and m.weight.dtype == dtype for m in _frozen(model).values())
    logits = _logits(model)
    assert logits.dtype == dtype
    assert sqnr(_logits(_dequantized_model(source, dequantized, dtype)).float(), logits.float()) >= LOGITS_MIN_DB


def test_frozen_layer_takes_another_recipe_as_loading_with_it(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    for layer in _frozen(model).values():
        layer.config = Float8LinearConfig.from_recipe("rowwise")
    loaded = load_fp8_pretrained(_model(meta=True), path, config=Float8LinearConfig.from_recipe("rowwise"))
    assert torch.equal(_logits(model), _logits(loaded))


@pytest.mark.parametrize("recipe", ["delayed", "nvfp4"])
def test_frozen_layer_refuses_a_recipe_it_cannot_hold(deepseek, recipe):
    path, _, _ = deepseek
    layer = _frozen(load_fp8_pretrained(_model(meta=True), path))[UP]
    config = layer.config
    with pytest.raises(ValueError, match="a frozen FP8 weight is cast dynamically"):
        layer.config = Float8LinearConfig.from_recipe(recipe)
    assert layer.config is config


def test_peft_lora_trains_only_the_adapters(deepseek):
    peft = pytest.importorskip("peft")
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    before = _bytes(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(named) == 4 and all("lora_" in n for n, _ in named)  # A and B of q_proj and v_proj
    trainable = [p for _, p in named]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(_ids(), labels=_ids()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = {k.removesuffix(".base_layer"): v for k, v in _bytes(model.get_base_model()).items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("kind", ["deepseek", "ct_channel", "ct_tensor"])
def test_compiled_frozen_layer_equals_eager(tmp_path, kind):
    # Found: dynamo rebuilt the frozen weight as a plain Float8Tensor and refused the graph.
    _write(str(tmp_path / kind), _model(), kind)
    layer = _frozen(load_fp8_pretrained(_model(meta=True), str(tmp_path / kind)))[UP]
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [compiled(xs[0]), layer(xs[1])]
    for y in ys:
        y.float().square().sum().backward()
    assert torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)


# ------------------------------------------------------------------ saving again

# (hand-written kind, save_fp8_pretrained format, strategy, scale_fmt)
RESAVES = [
    ("deepseek", "fp8_block", None, None),
    ("deepseek_ue8m0", "fp8_block", None, "ue8m0"),
    ("ct_block", "compressed_tensors", "block", None),
    ("ct_channel", "compressed_tensors", "channel", None),
    ("ct_tensor", "compressed_tensors", "tensor", None),
    ("mxfp8", "mxfp8", None, None),
]


def _fp8_entries(path: str) -> dict[str, torch.Tensor]:
    file = load_file(os.path.join(path, "model.safetensors"))
    return {k: v.view(torch.uint8) if v.element_size() == 1 else v for k, v in file.items() if "proj" in k}


@pytest.mark.parametrize("to_fp16", [False, True], ids=["as_loaded", "after_to_fp16"])
@pytest.mark.parametrize(("kind", "fmt", "strategy", "scale_fmt"), RESAVES, ids=[r[0] for r in RESAVES])
def test_frozen_model_saves_the_file_bytes_back(tmp_path, kind, fmt, strategy, scale_fmt, to_fp16):
    # Found: model.to(torch.float16) rounded the held file multiplier (a buffer) to fp16.
    path = str(tmp_path / kind)
    _write(path, _model(), kind)
    model = load_fp8_pretrained(_model(meta=True), path)
    if to_fp16:
        model.to(torch.float16)
    save_fp8_pretrained(model, tmp_path / "again", format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    written, again = _fp8_entries(path), _fp8_entries(str(tmp_path / "again"))
    assert written.keys() == again.keys()
    assert all(torch.equal(again[k], v) for k, v in written.items())


def test_ue8m0_save_of_a_frozen_non_power_of_two_checkpoint_is_refused(deepseek, tmp_path):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    with pytest.raises(ValueError, match="scale_fmt='ue8m0' needs power-of-two scales; a frozen weight's are not"):
        save_fp8_pretrained(model, tmp_path / "ue8m0", scale_fmt="ue8m0")
    assert not (tmp_path / "ue8m0").exists()


def test_ue8m0_save_of_a_trainable_recipe_without_power_of_two_is_refused(deepseek, tmp_path):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path, frozen=False)
    with pytest.raises(ValueError, match="is not cast with power_of_2_scale=True"):
        save_fp8_pretrained(model, tmp_path / "ue8m0", scale_fmt="ue8m0")


def test_ue8m0_checkpoint_trains_and_saves_powers_of_two(tmp_path):
    path = str(tmp_path / "ue8m0")
    _write(path, _model(), "deepseek_ue8m0")
    model = load_fp8_pretrained(_model(meta=True), path, frozen=False)  # default: power-of-two recipe
    model(_ids(), labels=_ids()).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    save_fp8_pretrained(model, tmp_path / "again", scale_fmt="ue8m0")
    scales = [v for k, v in _fp8_entries(str(tmp_path / "again")).items() if k.endswith("_scale_inv")]
    assert scales and all(bool((torch.frexp(s).mantissa == 0.5).all()) for s in scales)
    reloaded = load_fp8_pretrained(_model(meta=True), str(tmp_path / "again"))
    assert torch.isfinite(_logits(reloaded)).all()


def test_trainable_model_saved_and_reloaded_frozen_computes_the_same(deepseek, tmp_path):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path, frozen=False)
    save_fp8_pretrained(model, tmp_path / "again")
    # The masters are the file's dequantized weights: cast again, the same bytes and logits.
    assert _fp8_entries(str(tmp_path / "again")).keys() == _fp8_entries(path).keys()
    reloaded = load_fp8_pretrained(_model(meta=True), str(tmp_path / "again"))
    assert torch.equal(_logits(reloaded), _logits(load_fp8_pretrained(_model(meta=True), path)))


def test_refused_double_names_the_dtype_and_to_restores(deepseek):
    # Deliberate: FP8 weights stand for bf16/fp16/fp32 only. torch's _apply converts module by
    # module, so the modules before the first frozen layer are already fp64 when it refuses:
    # .to(the model's dtype) restores them.
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    before = _bytes(model)
    with pytest.raises(TypeError, match="high-precision floating dtype"):
        model.double()
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.equal(_bytes(model)[k], v) for k, v in before.items())


# ------------------------------------------------------- shapes and whole-model use


def _ct_channel_odd(tmp_path) -> tuple[str, torch.nn.Module]:
    """A per-channel checkpoint of a model whose MLP is 200 wide (not a multiple of 16)."""
    source = _model(ffn=200)
    path = str(tmp_path / "odd")
    _write(path, source, "ct_channel")
    return path, source


def test_frozen_dims_the_recipe_cannot_take_are_refused_before_any_change(tmp_path):
    # Found: the embeddings were overwritten, then Float8Linear refused the 200-wide layer.
    path, _ = _ct_channel_odd(tmp_path)
    model = _model(ffn=200, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"down_proj \(200 -> 128\) has dims .* pad_inner_dim=True"):
        load_fp8_pretrained(model, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_frozen_odd_dims_load_with_padding(tmp_path):
    path, source = _ct_channel_odd(tmp_path)
    config = Float8LinearConfig.from_recipe("rowwise", pad_inner_dim=True)
    model = load_fp8_pretrained(_model(ffn=200, meta=True), path, config=config)
    assert len(_frozen(model)) == len(LINEARS)
    assert sqnr(_logits(source).float(), _logits(model).float()) >= LOGITS_MIN_DB  # measured 28.7 dB


def test_trainable_odd_dims_stay_high_precision_holding_the_file(tmp_path):
    # As convert_to_float8_training: layers FP8 GEMMs cannot take are left in high precision (logged).
    path, source = _ct_channel_odd(tmp_path)
    model = load_fp8_pretrained(_model(ffn=200, meta=True), path, frozen=False)
    up = model.get_submodule(UP)
    assert type(up) is torch.nn.Linear and UP not in model.float8_converted_fqns
    assert sqnr(source.get_submodule(UP).weight.float(), up.weight.float()) >= 30.0


def test_linear_biases_load_as_the_file(tmp_path):
    source = _model(bias=True)
    _write(str(tmp_path / "b"), source)
    model = load_fp8_pretrained(_model(bias=True, meta=True), str(tmp_path / "b"))
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, FrozenFloat8Linear) and q.bias.requires_grad
    assert torch.equal(q.bias, source.get_submodule("model.layers.0.self_attn.q_proj").bias)


def test_torch_save_of_the_whole_model_keeps_the_weights_frozen(deepseek):
    # Found: unpickled, the weights came back as plain Float8Tensors that accepted requires_grad.
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(isinstance(m.weight, FrozenFloat8Weight) for m in _frozen(loaded).values())
    assert torch.equal(_logits(loaded), _logits(model))
    with pytest.raises(RuntimeError, match="frozen=False"):
        loaded.get_submodule(UP).weight.requires_grad_(True)


def test_eval_mode_is_kept(deepseek):
    path, _, _ = deepseek
    model = _model()
    model.eval()
    load_fp8_pretrained(model, path)
    assert not any(m.training for m in _frozen(model).values())


def test_gradient_checkpointing_trains_the_rest(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    model.gradient_checkpointing_enable()
    model.train()
    model(_ids(), labels=_ids(), use_cache=False).loss.backward()
    assert model.model.norm.weight.grad is not None
    assert all(m.weight.grad is None for m in _frozen(model).values())


def test_generate_keeps_the_prompt_and_adds_tokens(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(_model(meta=True), path)
    ids = _ids()[:1, :4]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], ids)
