"""fp8_state_dict and iter_fp8_weights: the checkpoint's tensors in memory, one layer at a time.

The reference is the file: every tensor ``save_fp8_pretrained`` writes with the same arguments,
read back with safetensors, must be in the dict under the same name with the same dtype, shape
and bytes, and nothing else may be. The generator's memory is counted with weak references to
what it yields: a tensor of one layer must be gone once the next layer's are made.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from f8tensor import BLOCK_128x128, CastConfig, Float8LinearConfig, Float8Tensor, convert_to_float8_training
from f8tensor.export import fp8_state_dict, iter_fp8_weights, load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear

VOCAB = 256
_TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
EXPORTS = [
    ("fp8_block", None),
    ("mxfp8", None),
    ("compressed_tensors", "tensor"),
    ("compressed_tensors", "channel"),
    ("compressed_tensors", "block"),
]


def _llama(layers: int = 1, tied: bool = True) -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def _qwen3_moe() -> torch.nn.Module:
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(cfg)


def _mixtral() -> torch.nn.Module:
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=2,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(cfg)


MODELS = {"llama": (_llama, "blockwise"), "qwen3_moe": (_qwen3_moe, "rowwise"), "mixtral": (_mixtral, "tensorwise")}


def _train(model: torch.nn.Module, steps: int = 2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(_TOKENS, labels=_TOKENS).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request):
    build, recipe = MODELS[request.param]
    torch.manual_seed(0)
    model = build()
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    _train(model)
    return request.param, model


def _file(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), key
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), key


@pytest.mark.parametrize(("fmt", "strategy"), EXPORTS, ids=[s or f for f, s in EXPORTS])
def test_state_dict_is_the_file(trained, fmt, strategy, tmp_path):
    name, model = trained
    save_fp8_pretrained(model, tmp_path / "out", format=fmt, strategy=strategy, max_shard_size="100KB")
    disk = _file(tmp_path / "out")
    state = fp8_state_dict(model, format=fmt, strategy=strategy)
    _assert_same_tensors(state, disk)
    # a tied lm_head is left out as the file leaves it out; an untied one is in both
    assert ("lm_head.weight" in state) is (name != "llama")
    assert "model.embed_tokens.weight" in state and "model.norm.weight" in state
    assert state["lm_head.weight" if name != "llama" else "model.embed_tokens.weight"].dtype != torch.float8_e4m3fn
    # the generator yields the same pairs, each name once
    names = [k for k, _ in iter_fp8_weights(model, format=fmt, strategy=strategy)]
    assert len(names) == len(set(names)) and set(names) == set(disk)


def test_untied_lm_head_of_a_dense_model_is_in_the_dict(tmp_path):
    torch.manual_seed(0)
    model = _llama(tied=False)
    state = fp8_state_dict(model)
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight)
    assert not torch.equal(state["lm_head.weight"], model.model.embed_tokens.weight)
    save_fp8_pretrained(model, tmp_path / "out")
    _assert_same_tensors(state, _file(tmp_path / "out"))


@pytest.mark.parametrize(
    ("recipe", "fmt", "strategy"), [("blockwise", "fp8_block", None), ("rowwise", "compressed_tensors", "channel")]
)
def test_a_frozen_base_streams_its_files_bytes(recipe, fmt, strategy, tmp_path):
    torch.manual_seed(0)
    model = _llama(tied=False)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    save_fp8_pretrained(model, tmp_path / "out", format=fmt, strategy=strategy)
    torch.manual_seed(1)
    frozen = load_fp8_pretrained(_llama(tied=False), str(tmp_path / "out"))
    assert sum(isinstance(m, FrozenFloat8Linear) for m in frozen.modules()) == 7
    _assert_same_tensors(fp8_state_dict(frozen, format=fmt, strategy=strategy), _file(tmp_path / "out"))


def test_fp8_weight_and_scale_are_the_cast_of_the_master(trained):
    """From the definition: the weight's bytes are Float8Tensor.from_hp's, the scale its exact
    fp32 reciprocal (one value per 128x128 block for fp8_block)."""
    _, model = trained
    state = fp8_state_dict(model, format="fp8_block")
    w = model.model.layers[0].self_attn.o_proj.weight.detach()
    t = Float8Tensor.from_hp(w, granularity=BLOCK_128x128)
    key = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(state[key].view(torch.uint8), t._data.view(torch.uint8))
    assert torch.equal(state[key + "_scale_inv"].view(torch.int32), torch.reciprocal(t._scale).view(torch.int32))


def _storage_ptrs(model: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


def test_generator_holds_one_layers_new_tensors_at_a_time():
    """Every tensor the generator made (not a model parameter) is tracked by weak reference,
    with the tensor it is a view of. While a layer's tensors are yielded, none of another
    layer's may be alive; and the alive bytes never exceed one layer's."""
    torch.manual_seed(0)
    model = _llama(layers=4)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("rowwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    owned = _storage_ptrs(model)
    tracked: list[tuple[str, weakref.ref, int]] = []
    layer_bytes: dict[str, int] = {}
    peak = 0
    for name, t in iter_fp8_weights(model, format="compressed_tensors", strategy="channel"):
        if t.untyped_storage().data_ptr() in owned:
            continue
        layer = ".".join(name.split(".")[:3])
        assert layer.startswith("model.layers."), name  # outside the layers, the model's own tensors
        layer_bytes[layer] = layer_bytes.get(layer, 0) + t.untyped_storage().nbytes()
        for obj in (t, t._base):
            if obj is not None:
                tracked.append((layer, weakref.ref(obj), obj.untyped_storage().nbytes()))
        del t
        gc.collect()
        alive = [(lay, n) for lay, ref, n in tracked if ref() is not None]
        assert {lay for lay, _ in alive} <= {layer}, (name, sorted({lay for lay, _ in alive}))
        peak = max(peak, sum(n for _, n in alive))
    assert len(layer_bytes) == 4
    assert 0 < peak <= max(layer_bytes.values()) * 2  # a weight and its view's base, at most


def test_generator_leaves_grad_mode_alone_between_items():
    model = _llama()
    weights = iter_fp8_weights(model)
    next(weights)
    assert torch.is_grad_enabled()


def test_arguments_are_checked_when_the_generator_is_made():
    model = _llama()
    with pytest.raises(ValueError, match=r"iter_fp8_weights: format must be one of .*'fp8'"):
        iter_fp8_weights(model, format="fp8")
    with pytest.raises(ValueError, match=r"iter_fp8_weights: strategy= applies to format='compressed_tensors'"):
        iter_fp8_weights(model, strategy="channel")
    with pytest.raises(TypeError, match=r"iter_fp8_weights: gather must be a bool; got 'yes'"):
        iter_fp8_weights(model, gather="yes")
    with pytest.raises(TypeError, match=r"fp8_state_dict|iter_fp8_weights: model must be a transformers"):
        fp8_state_dict(torch.nn.Linear(128, 128))


def test_non_finite_weight_is_refused_by_name():
    model = _llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"up_proj.weight holds non-finite values"):
        fp8_state_dict(model)


# ----------------------------------------------------------------------------- scale_fmt="ue8m0"


def _pow2_config() -> Float8LinearConfig:
    weight = CastConfig(dtype=torch.float8_e4m3fn, granularity=BLOCK_128x128, power_of_2_scale=True)
    return Float8LinearConfig.from_recipe("blockwise", weight=weight)


def test_ue8m0_writes_powers_of_two_and_says_so(tmp_path):
    import json

    torch.manual_seed(0)
    model = _llama().float()
    convert_to_float8_training(model, config=_pow2_config(), module_filter_fn=lambda m, fqn: fqn != "lm_head")
    _train(model)
    save_fp8_pretrained(model, tmp_path / "out", format="fp8_block", scale_fmt="ue8m0")
    with open(tmp_path / "out" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["quant_method"], qc["scale_fmt"], qc["weight_block_size"]) == ("fp8", "ue8m0", [128, 128])
    disk = _file(tmp_path / "out")
    _assert_same_tensors(fp8_state_dict(model, format="fp8_block", scale_fmt="ue8m0"), disk)
    scales = [v for k, v in disk.items() if k.endswith("_scale_inv")]
    assert len(scales) == 7
    for s in scales:
        assert s.dtype == torch.float32
        mantissa, _ = torch.frexp(s)
        assert torch.equal(mantissa, torch.full_like(s, 0.5))  # every multiplier a power of two
    # the bytes and scale of the training cast with power-of-two scales
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    t = Float8Tensor.from_hp(w, granularity=BLOCK_128x128, power_of_2_scale=True)
    key = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(disk[key].view(torch.uint8), t._data.view(torch.uint8))
    assert torch.equal(disk[key + "_scale_inv"], torch.reciprocal(t._scale))


def test_ue8m0_is_refused_without_power_of_two_scales_or_with_another_format(tmp_path):
    model = _llama()
    unconverted = r"model.layers.0.self_attn.q_proj.weight is not cast with power_of_2_scale=True"
    with pytest.raises(ValueError, match=r"iter_fp8_weights: scale_fmt='ue8m0' .*" + unconverted):
        iter_fp8_weights(model, scale_fmt="ue8m0")
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    with pytest.raises(
        ValueError, match=r"fp8_state_dict|iter_fp8_weights: .*q_proj.weight is not cast with power_of_2"
    ):
        fp8_state_dict(model, format="fp8_block", scale_fmt="ue8m0")
    with pytest.raises(ValueError, match=r"scale_fmt must be None, or one of .* got scale_fmt='ue8m0', format='mxfp8'"):
        fp8_state_dict(model, format="mxfp8", scale_fmt="ue8m0")
    with pytest.raises(ValueError, match=r"scale_fmt must be None, or one of \('ue8m0',\) .*got scale_fmt='e8m0'"):
        iter_fp8_weights(model, scale_fmt="e8m0")
