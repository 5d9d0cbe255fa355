"""Hand-written FP8 checkpoints for the round 5 campaign (tests/reliability/test_round5_campaign_load*.py).

Checkpoints are quantized from the definition (multiplier = block amax / 448, bytes =
weight / multiplier in e4m3) and written with safetensors and a config.json. The reference
model holds the dequantized weights (``bytes * multiplier``). Tiny Llama models.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from collections.abc import Iterator

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from f8tensor.export.frozen import FrozenFloat8Linear

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UP = "model.layers.0.mlp.up_proj"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["deepseek", "deepseek_ue8m0", "ct_block", "ct_channel", "ct_tensor", "mxfp8"]
# Logits of the loaded model (FP8 activations too) against the dequantized model's: measured
# 28.9-33.1 dB over KINDS x DTYPES (tensorwise lowest).
LOGITS_MIN_DB = 26.0


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Block-scaled products on a CPU run emulated: their warning is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no cpu kernel.*")
        yield


def build_model(
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


def is_linear(key: str) -> bool:
    return key.endswith(".weight") and key.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS


def quantize_by_hand(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        # A partial last block (a dim 128 does not divide) gets a scale of its own.
        bn, bk = -(-n // 128), -(-k // 128)
        padded = torch.zeros(bn * 128, bk * 128)
        padded[:n, :k] = w
        m = padded.reshape(bn, 128, bk, 128).abs().amax(dim=(1, 3)) / 448
        if kind == "deepseek_ue8m0":
            m = torch.exp2(torch.ceil(torch.log2(m)))  # powers of two, rounded up: no overflow
        dense = m.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    elif kind == "ct_channel":
        m = w.abs().amax(dim=1, keepdim=True) / 448
        dense = m.expand(n, k)
    else:
        m = w.abs().amax().reshape(1) / 448
        dense = m.expand(n, k)
    return (w / dense).to(torch.float8_e4m3fn), m.contiguous(), dense


def quantization_config(kind: str) -> dict:
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


def write_checkpoint(path, source, kind: str = "deepseek", edit=None, shards: int = 1) -> dict[str, torch.Tensor]:
    """Write ``source`` quantized as ``kind``; returns {key: dequantized weight} of its linears."""
    os.makedirs(path, exist_ok=True)
    suffix = ".weight_scale_inv" if kind in ("deepseek", "deepseek_ue8m0", "mxfp8") else ".weight_scale"
    tensors, dequantized = {}, {}
    for key, value in source.state_dict().items():
        if key == "lm_head.weight" and source.config.tie_word_embeddings:
            continue  # tied: the file leaves it out
        if not is_linear(key):
            tensors[key] = value.contiguous()
            continue
        data, scale, dense = quantize_by_hand(value, kind)
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
    config["quantization_config"] = quantization_config(kind)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized


def dequantized_model(source, dequantized: dict[str, torch.Tensor], dtype: torch.dtype):
    """The plain model holding the file's dequantized weights: the high-precision reference."""
    reference = copy.deepcopy(source).to(dtype)
    with torch.no_grad():
        for key, w in dequantized.items():
            reference.get_parameter(key).copy_(w.to(dtype))
    return reference


def token_ids() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randint(0, 256, (2, 16))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids()).logits


def frozen_layers(model) -> dict[str, FrozenFloat8Linear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, FrozenFloat8Linear)}


def frozen_bytes(model) -> dict[str, torch.Tensor]:
    return {fqn: m.weight._data.view(torch.uint8).clone() for fqn, m in frozen_layers(model).items()}


def deepseek_checkpoint(tmp_path) -> tuple[str, torch.nn.Module, dict[str, torch.Tensor]]:
    """(path, source model, dequantized weights) of a DeepSeek-V3-block checkpoint of a bf16 model."""
    source = build_model()
    path = str(tmp_path / "deepseek")
    return path, source, write_checkpoint(path, source)
