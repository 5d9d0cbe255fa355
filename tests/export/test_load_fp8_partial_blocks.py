"""FP8 checkpoints whose 128x128 blocks do not divide a weight: partial last blocks, loaded and written.

DeepSeek-V3 stores ``kv_a_proj_with_mqa`` (576 rows) with a scale of ``ceil(N/128) x ceil(K/128)``;
compressed-tensors' block strategy does the same. A tiny DeepSeek-V3 (hidden 256, one dense layer)
has the same shapes: ``kv_a_proj_with_mqa`` (192, 256), ``gate_proj``/``up_proj`` (320, 256) and
``down_proj`` (256, 320). Checkpoints come from :func:`_write_by_hand` (the definition, its own
safetensors and config.json) and from ``save_fp8_pretrained``.
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
from transformers import AutoModelForCausalLM, DeepseekV3Config
from transformers.core_model_loading import revert_weight_conversion

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training, sqnr
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear
from f8tensor.nn import linear_autograd

VOCAB, HIDDEN = 256, 256
E4M3_MAX = 448.0
# The linears the checkpoint quantizes (lm_head stays bf16, as in DeepSeek's releases).
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARTIAL = {  # weights whose blocks do not divide them: (shape, scale shape)
    "model.layers.0.self_attn.kv_a_proj_with_mqa": ((192, 256), (2, 2)),
    "model.layers.0.mlp.gate_proj": ((320, 256), (3, 2)),
    "model.layers.0.mlp.up_proj": ((320, 256), (3, 2)),
    "model.layers.0.mlp.down_proj": ((256, 320), (2, 3)),
}
KINDS = ("deepseek", "deepseek_ue8m0", "ct_block")
# kind -> (format, strategy, scale_fmt) of save_fp8_pretrained
SAVE_AS = {
    "deepseek": ("fp8_block", None, None),
    "deepseek_ue8m0": ("fp8_block", None, "ue8m0"),
    "ct_block": ("compressed_tensors", "block", None),
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no cpu kernel.*")
        yield


def _config(ffn: int = 320) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=ffn,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
    )


def _model(meta: bool = False, ffn: int = 320, moe: bool = False) -> torch.nn.Module:
    """The tiny DeepSeek-V3; ``moe``: its layer is MoE (4 experts of intermediate 192, one shared expert)."""
    config = _config(ffn)
    if moe:
        config.first_k_dense_replace, config.moe_intermediate_size = 0, 192
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _linears(model) -> dict[str, torch.nn.Module]:
    return {fqn: m for fqn, m in model.named_modules() if fqn.rsplit(".", 1)[-1] in LINEARS}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _scale_key(file: dict, fqn: str) -> str:
    return next(k for k in (f"{fqn}.weight_scale_inv", f"{fqn}.weight_scale") if k in file)


def _dense(m: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """DeepSeek's dequantization multiplier: each block's value over its rows and columns, cut to (n, k)."""
    return m.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _write_by_hand(path: str, model, kind: str) -> dict[str, torch.Tensor]:
    """Quantize ``model``'s linears per 128x128 block (partial last blocks their own) and write the checkpoint
    under its checkpoint names (experts one linear each)."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for key, value in revert_weight_conversion(model, model.state_dict()).items():
        fqn = key.removesuffix(".weight")
        if fqn.rsplit(".", 1)[-1] not in LINEARS:
            tensors[key] = value.contiguous()
            continue
        w = value.float()
        n, k = w.shape
        rows, cols = -(-n // 128), -(-k // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[:n, :k] = w.abs()
        m = padded.reshape(rows, 128, cols, 128).amax(dim=(1, 3)) / E4M3_MAX
        if kind == "deepseek_ue8m0":
            m = torch.exp2(torch.ceil(torch.log2(m)))  # powers of two, rounded up: no overflow
        tensors[key] = (w / _dense(m, n, k)).to(torch.float8_e4m3fn)
        tensors[fqn + (".weight_scale_inv" if kind.startswith("deepseek") else ".weight_scale")] = m.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    if kind.startswith("deepseek"):
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if kind == "deepseek_ue8m0":
            q["scale_fmt"] = "ue8m0"
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
        q = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }
    config = model.config.to_dict()
    config["quantization_config"] = q
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


def _structured() -> torch.nn.Module:
    """A bf16 model whose partial blocks hold values 16x larger: a partial block read with another block's
    scale (or a multiplier cut on the wrong side) costs tens of dB."""
    torch.manual_seed(0)
    source = _model()
    with torch.no_grad():
        for fqn in PARTIAL:
            w = source.get_submodule(fqn).weight
            n, k = w.shape
            w[n - n % 128 :] *= 16
            w[:, k - k % 128 :] *= 16
    return source


def _hand(tmp_path, kind: str) -> tuple[torch.nn.Module, str, dict[str, torch.Tensor]]:
    source = _structured()
    path = str(tmp_path / kind)
    return source, path, _write_by_hand(path, source, kind)


def _record_weight_operands(monkeypatch) -> list[torch.Tensor]:
    """The FP8 bytes of every forward product's weight operand (the mm's second operand, transposed)."""
    seen: list[torch.Tensor] = []
    real = linear_autograd.matmul

    def recording(a, b, **kwargs):
        seen.append(b._data.t())
        return real(a, b, **kwargs)

    monkeypatch.setattr(linear_autograd, "matmul", recording)
    return seen


def _check_holds_and_multiplies_the_file(model, file, seen) -> None:
    """Every linear frozen on the file's bytes and (ceil-shaped) multipliers; each forward product read them."""
    assert set(_linears(model)) >= set(PARTIAL)
    for fqn, layer in _linears(model).items():
        assert isinstance(layer, FrozenFloat8Linear) and layer.multiplies_file_bytes, fqn
        data, stored = file[f"{fqn}.weight"], file[_scale_key(file, fqn)]
        assert torch.equal(_bits(layer.weight._data), _bits(data)), fqn
        # Two fp32 reciprocals: at most one ulp apart.
        assert torch.allclose(torch.reciprocal(layer.weight._scale), stored, rtol=2**-23, atol=0), fqn
        assert any(s.shape == data.shape and torch.equal(_bits(s), _bits(data)) for s in seen), fqn
    for fqn, (shape, scale_shape) in PARTIAL.items():
        assert tuple(file[f"{fqn}.weight"].shape) == shape
        assert tuple(file[_scale_key(file, fqn)].shape) == scale_shape


def _check_saved_as(model, tmp_path, file, kind) -> None:
    fmt, strategy, scale_fmt = SAVE_AS[kind]
    again = str(tmp_path / f"{kind}_again")
    save_fp8_pretrained(model, again, format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    file2 = load_file(os.path.join(again, "model.safetensors"))
    assert file2.keys() == file.keys()
    for key in file:
        assert file2[key].dtype == file[key].dtype, key
        assert torch.equal(_bits(file2[key]), _bits(file[key])), key


@pytest.mark.parametrize("kind", KINDS)
def test_hand_written_partial_blocks_load_frozen_multiply_the_file_and_save_back(tmp_path, monkeypatch, kind):
    source, path, file = _hand(tmp_path, kind)
    model = load_fp8_pretrained(_model(meta=True), path)
    seen = _record_weight_operands(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        got, want = model(ids).logits.float(), source(ids).logits.float()
    _check_holds_and_multiplies_the_file(model, file, seen)
    # Against the bf16 model the file was quantized from (measured: 19.5 to 19.9 dB; its dequantized weights
    # in bf16 alone: 21.5 to 22.2 dB, the partial blocks' 16x values amplified through the layer).
    assert sqnr(want, got) > 18
    for fqn in PARTIAL:  # each partial layer against the file's definition, in fp32
        layer, data = model.get_submodule(fqn), file[f"{fqn}.weight"]
        w = data.float() * _dense(file[_scale_key(file, fqn)], *data.shape)
        x = torch.randn(32, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
        grad_out = torch.randn(32, layer.out_features, dtype=torch.bfloat16)
        out = layer(x)
        out.backward(grad_out)
        # measured: 31.3 to 32.1 dB (the input cast per 1x128); one scale for every block would give 0.7 dB
        assert sqnr(x.detach().float() @ w.t(), out.detach().float()) > 30, fqn
        assert sqnr(grad_out.float() @ w, x.grad.float()) > 30, fqn  # measured: 31.3 to 32.1 dB
    # Gradients reach the inputs through every frozen product, partial blocks included.
    model.model.embed_tokens.weight.requires_grad_(True)
    model(ids, labels=ids).loss.backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    _check_saved_as(model, tmp_path, file, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_hand_written_partial_blocks_load_as_masters_equal_to_the_definition(tmp_path, kind):
    _, path, file = _hand(tmp_path, kind)
    model = load_fp8_pretrained(_model(), path, frozen=False)
    for fqn, layer in _linears(model).items():
        assert type(layer) is Float8Linear and layer.weight.requires_grad, fqn
        data = file[f"{fqn}.weight"]
        want = (data.float() * _dense(file[_scale_key(file, fqn)], *data.shape)).to(torch.bfloat16)
        assert torch.equal(layer.weight.detach(), want), fqn
    ids = torch.randint(0, VOCAB, (2, 16))
    model(ids, labels=ids).loss.backward()
    for fqn in PARTIAL:
        grad = model.get_submodule(fqn).weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, fqn


def _recipe(kind: str) -> Float8LinearConfig:
    config = Float8LinearConfig.from_recipe("blockwise")
    if kind != "deepseek_ue8m0":
        return config
    pow2 = {
        r: dataclasses.replace(getattr(config, r), power_of_2_scale=True) for r in ("input", "weight", "grad_output")
    }
    return dataclasses.replace(config, **pow2)


@pytest.mark.parametrize("kind", KINDS)
def test_written_partial_blocks_round_trip_byte_for_byte(tmp_path, monkeypatch, kind):
    source = _structured()
    convert_to_float8_training(source, config=_recipe(kind), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    assert set(PARTIAL) <= set(source.float8_converted_fqns)
    fmt, strategy, scale_fmt = SAVE_AS[kind]
    path = str(tmp_path / "ckpt")
    save_fp8_pretrained(source, path, format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    file = load_file(os.path.join(path, "model.safetensors"))
    # The written scales are the definition's: each block's amax / 448 (its own rows and columns only).
    for fqn, (shape, _) in PARTIAL.items():
        w, m = source.get_submodule(fqn).weight.detach().float(), file[_scale_key(file, fqn)]
        back = file[f"{fqn}.weight"].float() * _dense(m, *shape)
        assert sqnr(w, back) > 30, fqn  # measured: 31.4 to 31.6 dB

    model = load_fp8_pretrained(_model(meta=True), path)
    seen = _record_weight_operands(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        got, want = model(ids).logits.float(), source(ids).logits.float()
    _check_holds_and_multiplies_the_file(model, file, seen)
    # The trained model multiplies the same bytes with the same input casts: equal logits.
    assert torch.equal(got, want)
    _check_saved_as(model, tmp_path, file, kind)
    with (
        open(os.path.join(path, "config.json")) as f1,
        open(os.path.join(tmp_path, f"{kind}_again", "config.json")) as f2,
    ):
        assert json.load(f1)["quantization_config"] == json.load(f2)["quantization_config"]


def test_compressed_tensors_reads_the_written_partial_blocks_as_the_definition(tmp_path):
    # Another reader: transformers' compressed-tensors loader, dequantizing on CPU. (Its DeepSeek-format CPU
    # dequantizer infers a block as rows // scale rows and does not read partial blocks.)
    pytest.importorskip("compressed_tensors")
    source = _structured()
    convert_to_float8_training(
        source, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    path = str(tmp_path / "ct")
    save_fp8_pretrained(source, path, format="compressed_tensors", strategy="block")
    file = load_file(os.path.join(path, "model.safetensors"))
    read = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )
    for fqn in _linears(source):
        data = file[f"{fqn}.weight"]
        want = (data.float() * _dense(file[f"{fqn}.weight_scale"], *data.shape)).to(torch.bfloat16)
        assert torch.equal(read.get_submodule(fqn).weight.detach(), want), fqn


# ------------------------------------------------------------------ refusals


def test_a_floor_shaped_block_scale_is_refused_naming_the_ceil_shape(tmp_path):
    _, path, file = _hand(tmp_path, "deepseek")
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    file[key] = file[key][:1].contiguous()  # a writer that drops the partial last block
    save_file(file, os.path.join(path, "model.safetensors"))
    model = _model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"kv_a_proj_with_mqa.weight_scale_inv has shape \(1, 2\); the weight needs \(2, 2\)"
    ):
        load_fp8_pretrained(model, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_mxfp8_still_needs_k_a_multiple_of_32(tmp_path):
    torch.manual_seed(0)
    source = _model(ffn=336)  # down_proj K = 336: ten groups of 32 and 16 left over
    path = str(tmp_path / "mx")
    os.makedirs(path)
    tensors = dict(source.state_dict())
    key = "model.layers.0.mlp.down_proj"
    tensors[key + ".weight"] = torch.zeros(256, 336, dtype=torch.float8_e4m3fn)
    tensors[key + ".weight_scale_inv"] = torch.full((256, 11), 127, dtype=torch.uint8)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    config = source.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="down_proj.weight has K=336: MXFP8 blocks of 32 need K a multiple of 32"):
        load_fp8_pretrained(_model(ffn=336), path)


# ------------------------------------------------------------------ experts


def test_hand_written_partial_expert_blocks_load_trainable_and_refuse_frozen(tmp_path):
    torch.manual_seed(0)
    source = _model(moe=True)
    path = str(tmp_path / "moe")
    file = _write_by_hand(path, source, "deepseek")
    assert tuple(file["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"].shape) == (2, 2)
    model = _model(moe=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"experts.down_proj \(4, 256, 192\) has K=192, which 128x128 blocks do not"):
        load_fp8_pretrained(model, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    # down_proj in bf16: gate_up_proj is refused, gate's partial last block would share a block with up's first.
    only_gate_up = dict(file)
    for e, value in enumerate(source.model.layers[0].mlp.experts.down_proj.detach()):
        only_gate_up[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = value.contiguous()
        del only_gate_up[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"]
    save_file(only_gate_up, os.path.join(path, "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"gate_up_proj \(4, 384, 256\) takes model.layers.0.mlp.experts.0.gate_proj.weight as rows 0:192",
    ):
        load_fp8_pretrained(model, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    save_file(file, os.path.join(path, "model.safetensors"))

    model = load_fp8_pretrained(model, path, frozen=False)
    experts = model.model.layers[0].mlp.experts
    for e in range(4):
        for name, rows in (("gate_proj", slice(0, 192)), ("up_proj", slice(192, 384))):
            data = file[f"model.layers.0.mlp.experts.{e}.{name}.weight"]
            scale = file[f"model.layers.0.mlp.experts.{e}.{name}.weight_scale_inv"]
            want = (data.float() * _dense(scale, *data.shape)).to(torch.bfloat16)
            assert torch.equal(experts.gate_up_proj.detach()[e, rows], want), (e, name)
        data = file[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        scale = file[f"model.layers.0.mlp.experts.{e}.down_proj.weight_scale_inv"]
        want = (data.float() * _dense(scale, *data.shape)).to(torch.bfloat16)
        assert torch.equal(experts.down_proj.detach()[e], want), e
    ids = torch.randint(0, VOCAB, (2, 16))
    model(ids, labels=ids).loss.backward()
    assert experts.gate_up_proj.grad is not None and torch.isfinite(experts.gate_up_proj.grad).all()


def test_export_refuses_a_split_inside_a_block_naming_the_weight(tmp_path):
    torch.manual_seed(0)
    model = _model(moe=True)
    with torch.no_grad():  # block rows 128..255 scaled apart from 256..383 (rceil scales of random draws can tie)
        model.model.layers[0].mlp.experts.gate_up_proj[:, 128:256] *= 8
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.float8_converted_fqns
    # The fused (4, 384, 256) experts are cast in 128-row blocks; up_proj (rows 192..383) starts inside one.
    with pytest.raises(ValueError, match=r"experts.0.up_proj.weight: the model's weight conversion cuts it out"):
        save_fp8_pretrained(model, tmp_path / "x", format="fp8_block")
    assert not (tmp_path / "x").exists()
