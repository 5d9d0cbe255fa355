"""load_fp8_pretrained: FP8 checkpoints (f8tensor's and hand-written ones) into frozen FP8 layers.

Checkpoints come from two writers: ``save_fp8_pretrained`` and :func:`_write_by_hand` here,
which quantizes from the definition (multiplier = block amax / 448, bytes = w / multiplier in
e4m3) and writes safetensors and config.json itself. Tiny Llama models (dims multiples of 128).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training, sqnr
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear
from f8tensor.nn import linear_autograd

VOCAB, HIDDEN, FFN = 256, 128, 256
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0

# (format, strategy, scale_fmt, recipe of the exporting model)
WRITES = [
    ("fp8_block", None, None, "blockwise"),
    ("fp8_block", None, "ue8m0", "blockwise_pow2"),
    ("mxfp8", None, None, "mxfp8"),
    ("compressed_tensors", "tensor", None, "tensorwise"),
    ("compressed_tensors", "channel", None, "rowwise"),
    ("compressed_tensors", "block", None, "blockwise"),
]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no cpu kernel.*")
        yield


def _config(ffn: int = FFN) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=ffn,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )


def _model(meta: bool = False, ffn: int = FFN) -> torch.nn.Module:
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(_config(ffn), dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_config(_config(ffn), dtype=torch.bfloat16)


def _recipe(name: str) -> Float8LinearConfig:
    if name == "blockwise_pow2":
        c = Float8LinearConfig.from_recipe("blockwise")
        pow2 = {
            r: dataclasses.replace(getattr(c, r), power_of_2_scale=True) for r in ("input", "weight", "grad_output")
        }
        return dataclasses.replace(c, **pow2)
    return Float8LinearConfig.from_recipe(name)


def _exported(tmp_path, fmt, strategy, scale_fmt, recipe) -> str:
    torch.manual_seed(0)
    model = _model()
    convert_to_float8_training(model, config=_recipe(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    out = str(tmp_path / "ckpt")
    save_fp8_pretrained(model, out, format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    return out


def _linears(model) -> dict[str, torch.nn.Module]:
    return {fqn: m for fqn, m in model.named_modules() if fqn.rsplit(".", 1)[-1] in LINEARS}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _scale_key(file: dict, fqn: str) -> str:
    return next(k for k in (f"{fqn}.weight_scale_inv", f"{fqn}.weight_scale") if k in file)


def _multiplier_of(layer) -> torch.Tensor:
    """The on-disk multiplier of a frozen layer's held scale (the definition: 1 / _scale)."""
    s = layer.weight._scale
    if s.dtype == torch.float8_e8m0fnu:
        return (254 - s.view(torch.uint8).to(torch.int16)).to(torch.uint8)
    return torch.reciprocal(s)


def _dense_multiplier(m: torch.Tensor, shape) -> torch.Tensor:
    """A stored multiplier broadcast over the weight, from the format's definition."""
    n, k = shape
    if m.dtype == torch.uint8:
        m = torch.exp2(m.float() - 127)
    m = m.float()
    if m.numel() == 1:
        return m.reshape(1, 1).expand(n, k)
    return m.repeat_interleave(n // m.shape[0], 0).repeat_interleave(k // m.shape[1], 1)


def _write_by_hand(path: str, model, kind: str) -> dict[str, torch.Tensor]:
    """Quantize ``model``'s linears from the definition and write the checkpoint; returns the tensors."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied: the file leaves it out
        fqn = key.removesuffix(".weight")
        if fqn.rsplit(".", 1)[-1] not in LINEARS:
            tensors[key] = value.contiguous()
            continue
        w = value.float()
        n, k = w.shape
        if kind in ("deepseek", "deepseek_ue8m0", "ct_block"):
            amax = w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
        elif kind == "ct_channel":
            amax = w.abs().amax(dim=1, keepdim=True)
        else:
            amax = w.abs().amax().reshape(1)
        m = amax / E4M3_MAX
        if kind == "deepseek_ue8m0":
            m = torch.exp2(torch.ceil(torch.log2(m)))  # powers of two, rounded up: no overflow
        tensors[key] = (w / _dense_multiplier(m, w.shape)).to(torch.float8_e4m3fn)
        tensors[fqn + (".weight_scale_inv" if kind.startswith("deepseek") else ".weight_scale")] = m.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    if kind.startswith("deepseek"):
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if kind == "deepseek_ue8m0":
            q["scale_fmt"] = "ue8m0"
    else:
        strategy = kind.removeprefix("ct_")
        q = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "block_structure": [128, 128] if strategy == "block" else None,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    config = model.config.to_dict()
    config["quantization_config"] = q
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


def _record_weight_operands(monkeypatch) -> list[torch.Tensor]:
    """The FP8 bytes of every forward product's weight operand (the mm's second operand, transposed)."""
    seen: list[torch.Tensor] = []
    real = linear_autograd.matmul

    def recording(a, b, **kwargs):
        seen.append(b._data.t())
        return real(a, b, **kwargs)

    monkeypatch.setattr(linear_autograd, "matmul", recording)
    return seen


def _check_frozen_holds_file(model, file: dict) -> None:
    for fqn, layer in _linears(model).items():
        assert isinstance(layer, FrozenFloat8Linear), fqn
        assert torch.equal(_bits(layer.weight._data), _bits(file[f"{fqn}.weight"])), fqn
        stored = file[_scale_key(file, fqn)]
        held = _multiplier_of(layer).reshape(stored.shape)
        if stored.dtype == torch.uint8:
            assert torch.equal(held, stored), fqn  # e8m0 codes: exact
        else:
            # Two fp32 reciprocals: at most one ulp apart.
            assert torch.allclose(held, stored.float(), rtol=2**-23, atol=0), fqn


@pytest.mark.parametrize(("fmt", "strategy", "scale_fmt", "recipe"), WRITES)
def test_round_trip_holds_the_file_bytes_and_writes_them_back(tmp_path, monkeypatch, fmt, strategy, scale_fmt, recipe):
    path = _exported(tmp_path, fmt, strategy, scale_fmt, recipe)
    file = load_file(os.path.join(path, "model.safetensors"))
    model = load_fp8_pretrained(_model(meta=True), path)
    _check_frozen_holds_file(model, file)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())

    # The forward multiplies the file's bytes (recipe granularity = the checkpoint's).
    seen = _record_weight_operands(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    weights = [_bits(file[f"{fqn}.weight"]) for fqn in _linears(model)]
    assert len(seen) == len(weights)
    for w in weights:
        assert any(s.shape == w.shape and torch.equal(_bits(s), w) for s in seen)

    # Saved again in the same format: every tensor's bytes as in the file.
    again = str(tmp_path / "again")
    save_fp8_pretrained(model, again, format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    file2 = load_file(os.path.join(again, "model.safetensors"))
    assert file2.keys() == file.keys()
    for key in file:
        assert file2[key].dtype == file[key].dtype, key
        assert torch.equal(_bits(file2[key]), _bits(file[key])), key
    with open(os.path.join(path, "config.json")) as f1, open(os.path.join(again, "config.json")) as f2:
        assert json.load(f1)["quantization_config"] == json.load(f2)["quantization_config"]


@pytest.mark.parametrize(("fmt", "strategy", "scale_fmt", "recipe"), WRITES)
def test_trainable_masters_are_the_dequantized_file(tmp_path, fmt, strategy, scale_fmt, recipe):
    path = _exported(tmp_path, fmt, strategy, scale_fmt, recipe)
    file = load_file(os.path.join(path, "model.safetensors"))
    model = load_fp8_pretrained(_model(), path, frozen=False)
    for fqn, layer in _linears(model).items():
        assert type(layer) is Float8Linear and layer.weight.requires_grad, fqn
        data = file[f"{fqn}.weight"]
        want = (data.float() * _dense_multiplier(file[_scale_key(file, fqn)], data.shape)).to(torch.bfloat16)
        assert torch.equal(layer.weight.detach(), want), fqn
    ids = torch.randint(0, VOCAB, (2, 16))
    model(ids, labels=ids).loss.backward()
    assert all(_linears(model)[f].weight.grad is not None for f in _linears(model))


@pytest.mark.parametrize("kind", ["deepseek", "deepseek_ue8m0", "ct_tensor", "ct_channel", "ct_block"])
def test_reads_checkpoints_written_by_hand(tmp_path, monkeypatch, kind):
    torch.manual_seed(0)
    source = _model()
    path = str(tmp_path / kind)
    file = _write_by_hand(path, source, kind)
    model = load_fp8_pretrained(_model(meta=True), path)
    _check_frozen_holds_file(model, file)
    for key, value in file.items():  # embeddings and norms: loaded as they are
        if value.dtype == torch.bfloat16:
            assert torch.equal(model.get_parameter(key).detach(), value), key
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seen = _record_weight_operands(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        got, want = model(ids).logits.float(), source(ids).logits.float()
    for fqn in _linears(model):
        assert any(
            torch.equal(_bits(s), _bits(file[f"{fqn}.weight"])) for s in seen if s.shape == file[f"{fqn}.weight"].shape
        )
    # Against the bf16 model the file was quantized from (measured: 27.6 to 28.5 dB).
    assert sqnr(want, got) > 25


def test_frozen_weights_are_fp8_and_refuse_gradients(tmp_path):
    path = _exported(tmp_path, "fp8_block", None, None, "blockwise")
    model = load_fp8_pretrained(_model(meta=True), path)
    layer = model.model.layers[0].mlp.up_proj
    with pytest.raises(RuntimeError, match="frozen=False"):
        layer.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen=False"):
        model.requires_grad_(True)
    held = elements = 0
    for layer in _linears(model).values():
        w = layer.weight
        assert w._data.dtype == torch.float8_e4m3fn and not w.requires_grad
        held += sum(t.numel() * t.element_size() for t in (w._data, w._scale, layer.checkpoint_scale))
        elements += w.numel()
    # Measured: 1.0005 bytes per weight element (128x128 fp32 scales, twice).
    assert held / elements <= 1.001
    assert not any(p.requires_grad for p in model.parameters() if p.dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("fmt", "strategy", "recipe", "limit"),
    [
        ("compressed_tensors", "channel", "rowwise", 1.07),  # measured 1.056 (K=128 or 256, fp32 scale twice per row)
        ("mxfp8", None, "mxfp8", 1.07),  # measured 1.0625 (e8m0 per 32, twice)
    ],
)
def test_frozen_bytes_per_element_of_finer_scales(tmp_path, fmt, strategy, recipe, limit):
    model = load_fp8_pretrained(_model(meta=True), _exported(tmp_path, fmt, strategy, None, recipe))
    held = sum(
        sum(t.numel() * t.element_size() for t in (m.weight._data, m.weight._scale, m.checkpoint_scale))
        for m in _linears(model).values()
    )
    assert held / sum(m.weight.numel() for m in _linears(model).values()) <= limit


def test_lora_trains_on_a_frozen_fp8_base(tmp_path):
    peft = pytest.importorskip("peft")
    path = _exported(tmp_path, "fp8_block", None, None, "blockwise")
    model = load_fp8_pretrained(_model(meta=True), path)
    before = {fqn: m.weight._data.clone() for fqn, m in _linears(model).items()}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=list(LINEARS)))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 32))
    losses = []
    for _ in range(8):
        loss = lora(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # measured: 5.59 -> 4.78
    for fqn, m in _linears(model).items():
        assert torch.equal(_bits(m.weight._data), _bits(before[fqn])), fqn


def test_another_recipe_recasts_the_file_weights_per_call(tmp_path):
    path = _exported(tmp_path, "fp8_block", None, None, "blockwise")
    model = load_fp8_pretrained(_model(meta=True), path, config=Float8LinearConfig.from_recipe("rowwise"))
    layer = model.model.layers[0].mlp.up_proj
    assert not layer.multiplies_file_bytes
    ids = torch.randint(0, VOCAB, (2, 16))
    ref = load_fp8_pretrained(_model(meta=True), path)
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    assert sqnr(want, got) > 25  # measured: 28.2 dB (rowwise casts of the same weights)


# ------------------------------------------------------------------ refusals


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def _hand_checkpoint(tmp_path, kind="deepseek", edit=None, ffn=FFN) -> str:
    torch.manual_seed(0)
    path = str(tmp_path / "bad")
    tensors = _write_by_hand(path, _model(ffn=ffn), kind)
    if edit is not None:
        edit(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def _set(key, value):
    def edit(t):
        t[key] = value(t[key]) if callable(value) else value

    return edit


_SCALE = "model.layers.0.mlp.up_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop(_SCALE), "up_proj.weight is stored in torch.float8_e4m3fn with no weight_scale_inv"),
        (_set(_SCALE, lambda s: s[:1]), "up_proj.weight_scale_inv has shape"),
        (
            _set(_SCALE, lambda s: s.index_fill(0, torch.tensor([0]), float("inf"))),
            "up_proj.weight_scale_inv must hold finite positive",
        ),
        (
            _set(_SCALE, lambda s: s.index_fill(0, torch.tensor([0]), float("nan"))),
            "up_proj.weight_scale_inv must hold finite positive",
        ),
        (
            _set(_SCALE, lambda s: s.index_fill(0, torch.tensor([0]), 0.0)),
            "up_proj.weight_scale_inv must hold finite positive",
        ),
        (_set(_SCALE, lambda s: -s), "up_proj.weight_scale_inv must hold finite positive"),
        (_set("model.layers.0.mlp.up_proj.weight", lambda w: w[:128]), r"up_proj.weight has shape \(128, 128\)"),
        (_set("model.norm.weight", lambda w: w[:64]), "model.norm.weight has shape"),
        (lambda t: t.pop("model.norm.weight"), "lacks 1 of the model's tensors: model.norm.weight"),
        (_set("extra.weight", torch.zeros(2)), "extra.weight in the checkpoint is not in the model"),
    ],
)
def test_bad_checkpoint_is_refused_and_the_model_unchanged(tmp_path, edit, match):
    path = _hand_checkpoint(tmp_path, edit=edit)
    model = _model()
    before = _state(model)
    with pytest.raises(ValueError, match=match):
        load_fp8_pretrained(model, path)
    _unchanged(model, before)


def test_no_quantization_config_is_refused(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "bf16")
    before = _state(model)
    with pytest.raises(ValueError, match="has no quantization_config"):
        load_fp8_pretrained(model, tmp_path / "bf16")
    _unchanged(model, before)


def test_ue8m0_scales_not_powers_of_two_are_refused(tmp_path):
    path = _hand_checkpoint(tmp_path, "deepseek_ue8m0", edit=_set(_SCALE, lambda s: s * 1.5))
    model = _model()
    before = _state(model)
    with pytest.raises(
        ValueError, match="up_proj.weight_scale_inv: scale_fmt 'ue8m0' needs every multiplier a power of two"
    ):
        load_fp8_pretrained(model, path)
    _unchanged(model, before)


def test_frozen_refuses_a_delayed_config(tmp_path):
    path = _exported(tmp_path, "compressed_tensors", "tensor", None, "tensorwise")
    with pytest.raises(ValueError, match="pass such a config or frozen=False"):
        load_fp8_pretrained(_model(), path, config=Float8LinearConfig.from_recipe("delayed"))


def test_frozen_load_into_a_meta_model_starts_a_delayed_input_fresh(tmp_path):
    # A delayed input (the weight dynamic, as frozen allows): a meta-built model's state came
    # back NaN, its input scale stuck at 1.0, silently; it must be a CPU-built model's.
    path = _exported(tmp_path, "compressed_tensors", "tensor", None, "tensorwise")
    config = Float8LinearConfig(input=Float8LinearConfig.from_recipe("delayed").input)
    models = [load_fp8_pretrained(_model(meta=meta), path, config=config) for meta in (False, True)]
    on_cpu, on_meta = (_linears(m) for m in models)
    for fqn, layer in on_cpu.items():
        for name, buf in layer.named_buffers(recurse=False):
            torch.testing.assert_close(on_meta[fqn].get_buffer(name), buf, rtol=0, atol=0, equal_nan=True)
    ids = torch.randint(0, VOCAB, (2, 16))
    for _ in range(3):  # the histories fill: the scales move off 1.0 alike
        logits = [m(ids).logits for m in models]
        for m, out in zip(models, logits):
            out.float().sum().backward()
    assert torch.equal(logits[0], logits[1])
    layer = on_meta["model.layers.0.mlp.up_proj"]
    assert float(layer.scale_input) != 1.0


# ------------------------------------------------------------------ scale_fmt="ue8m0" on save


def test_ue8m0_export_writes_powers_of_two_and_names_them(tmp_path):
    path = _exported(tmp_path, "fp8_block", None, "ue8m0", "blockwise_pow2")
    file = load_file(os.path.join(path, "model.safetensors"))
    scales = [v for k, v in file.items() if k.endswith("weight_scale_inv")]
    assert scales and all(v.dtype == torch.float32 and (torch.frexp(v).mantissa == 0.5).all() for v in scales)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["scale_fmt"] == "ue8m0"
    plain = _exported(tmp_path / "plain", "fp8_block", None, None, "blockwise")
    with open(os.path.join(plain, "config.json")) as f:
        assert "scale_fmt" not in json.load(f)["quantization_config"]


def test_ue8m0_export_refuses_a_recipe_without_power_of_two_scales(tmp_path):
    model = _model()
    convert_to_float8_training(model, config=_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    with pytest.raises(ValueError, match="is not cast with power_of_2_scale=True"):
        save_fp8_pretrained(model, tmp_path / "x", format="fp8_block", scale_fmt="ue8m0")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("fmt", "scale_fmt"), [("mxfp8", "ue8m0"), ("compressed_tensors", "ue8m0"), ("fp8_block", "e8m0")]
)
def test_ue8m0_export_refuses_other_formats_and_names(tmp_path, fmt, scale_fmt):
    model = _model()
    convert_to_float8_training(
        model, config=_recipe("blockwise_pow2"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    with pytest.raises(ValueError, match="scale_fmt must be None, or one of"):
        save_fp8_pretrained(model, tmp_path / "x", format=fmt, scale_fmt=scale_fmt)
