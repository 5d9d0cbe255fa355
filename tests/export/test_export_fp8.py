"""save_fp8_pretrained: FP8 checkpoints that transformers (and vLLM / SGLang) load.

Tiny Llama, Qwen3-MoE and Mixtral models (dims multiples of 128) are converted, trained two
steps, exported in each format, and loaded with ``AutoModelForCausalLM.from_pretrained`` on
CPU (which dequantizes). The loaded model's logits must equal, bit for bit, those of the same
model with each FP8 weight replaced by its dequantized cast, computed here from the
definition: ``Float8Tensor.from_hp(w, granularity)._data.float() * reciprocal(_scale)`` cast
to the model's dtype. The safetensors headers are read as raw JSON (names, dtypes, shapes).
"""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from f8tensor import (
    BLOCK_128x128,
    Float8ExpertWeight,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    MX_1x32,
    convert_to_float8_training,
)
from f8tensor.export import FORMATS, save_fp8_pretrained

VOCAB, HIDDEN = 256, 128


def _llama() -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    )
    # bf16 parameters (the loader dequantizes to bf16); buffers such as RoPE's stay fp32, as from_pretrained keeps them
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _qwen3_moe() -> torch.nn.Module:
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(cfg)  # fp32 masters


def _mixtral() -> torch.nn.Module:
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=2,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(cfg)


# model -> (builder, recipe): the recipes cover the three default compressed-tensors strategies.
MODELS = {"llama": (_llama, "blockwise"), "qwen3_moe": (_qwen3_moe, "rowwise"), "mixtral": (_mixtral, "tensorwise")}
# (format, strategy)
EXPORTS = [
    ("fp8_block", None),
    ("mxfp8", None),
    ("compressed_tensors", "tensor"),
    ("compressed_tensors", "channel"),
    ("compressed_tensors", "block"),
]
GRANULARITY = {
    "fp8_block": BLOCK_128x128,
    "mxfp8": MX_1x32,
    "tensor": "tensorwise",
    "channel": "rowwise",
    "block": BLOCK_128x128,
}
_TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request):
    """A converted model trained two steps (each model built once per module)."""
    build, recipe = MODELS[request.param]
    torch.manual_seed(0)
    model = build()
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(_TOKENS, labels=_TOKENS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss)
    return request.param, model


def _plain_weight(p: torch.Tensor) -> torch.Tensor:
    return p._hp.detach() if isinstance(p, Float8ExpertWeight) else p.detach()


def _dequantized(w: torch.Tensor, granularity) -> torch.Tensor:
    """What a loader must reproduce: the cast's bytes times the fp32 reciprocal of its scale."""
    t = Float8Tensor.from_hp(w, granularity=granularity)
    inv = torch.reciprocal(t._scale.float())
    if isinstance(granularity, type(BLOCK_128x128)):
        bn, bk = granularity.block
        inv = inv.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
    return (t._data.float() * inv).to(w.dtype)


def _reference(name: str, model: torch.nn.Module, granularity) -> torch.nn.Module:
    """A plain copy of ``model`` whose FP8 weights (Float8Linear, expert tensors) hold their dequantized casts."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for fqn, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            state[f"{fqn}.weight"] = _dequantized(mod.weight.detach(), granularity)
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(p, Float8ExpertWeight):
                w = _plain_weight(p)
                state[f"{fqn}.{pname}"] = torch.stack([_dequantized(w[e], granularity) for e in range(w.shape[0])])
    ref = MODELS[name][0]()
    ref.load_state_dict(state, strict=True)
    return ref.eval()


def _json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _headers(directory: str) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(_header(os.path.join(directory, name)))
    return out


def _load(directory: str, fmt: str):
    kwargs = {}
    if fmt == "compressed_tensors":
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, **kwargs)


@pytest.mark.parametrize(("fmt", "strategy"), EXPORTS, ids=[s or f for f, s in EXPORTS])
def test_export_loads_with_bit_equal_logits(trained, fmt, strategy, tmp_path):
    name, model = trained
    if fmt == "compressed_tensors":
        pytest.importorskip("compressed_tensors")
        if strategy == "block" and name == "mixtral":  # Qwen3-MoE's experts here are one 128x128 block each
            pytest.skip(
                "transformers 5.24 integrations/compressed_tensors.py (CompressedTensorsDequantize) multiplies "
                "FP8 experts as quant.float() * scale without expanding a block scale to its 128x128 blocks: "
                "a (256, 128) expert weight times its (2, 1) scale fails with a size mismatch"
            )
    out = str(tmp_path / "export")
    save_fp8_pretrained(model, out, format=fmt, strategy=strategy)
    qc = _json(os.path.join(out, "config.json"))["quantization_config"]
    skipped = qc["ignore" if fmt == "compressed_tensors" else "modules_to_not_convert"]
    assert "lm_head" in skipped and "model.embed_tokens" in skipped and "model.norm" in skipped
    assert any(s.endswith("input_layernorm") for s in skipped)
    if name == "qwen3_moe":
        assert "model.layers.0.self_attn.q_norm" in skipped and "model.layers.0.mlp.gate" in skipped
    if name == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate" in skipped  # the checkpoint's name of the router

    granularity = GRANULARITY[strategy or fmt]
    loaded, info = _load(out, fmt)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    ref = _reference(name, model, granularity)
    assert loaded.dtype == ref.dtype
    with torch.no_grad():
        got, want = loaded(_TOKENS).logits, ref(_TOKENS).logits
    assert torch.equal(got, want), (got - want).abs().max()


def _expected_header(name: str, model: torch.nn.Module, fmt: str, strategy: str | None) -> dict:
    """{key: (dtype, shape)} written from the model's modules and the format's definition."""
    hp = {torch.float32: "F32", torch.bfloat16: "BF16"}[next(model.parameters()).dtype]
    suffix = "_scale" if fmt == "compressed_tensors" else "_scale_inv"

    def scale(n: int, k: int) -> tuple[str, list[int]]:
        kind = strategy or fmt
        return {
            "fp8_block": ("F32", [n // 128, k // 128]),
            "block": ("F32", [n // 128, k // 128]),
            "mxfp8": ("U8", [n, k // 32]),
            "channel": ("F32", [n, 1]),
            "tensor": ("F32", [1]),
        }[kind]

    out: dict[str, tuple[str, list[int]]] = {}
    for fqn, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            key = f"{fqn}.{pname}"
            if isinstance(mod, Float8Linear) and pname == "weight":
                out[key] = ("F8_E4M3", list(p.shape))
                out[key + suffix] = scale(*p.shape)
            elif isinstance(p, Float8ExpertWeight):
                e, n, k = p.shape
                moe = "block_sparse_moe" if name == "mixtral" else "mlp"
                names = (
                    {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
                    if name == "mixtral"
                    else {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
                )
                parts = names[pname]
                prefix = fqn.replace(".mlp.", f".{moe}.")
                for i in range(e):
                    for part in parts:
                        key = f"{prefix}.{i}.{part}.weight"
                        out[key] = ("F8_E4M3", [n // len(parts), k])
                        out[key + suffix] = scale(n // len(parts), k)
            elif not (name == "llama" and key == "lm_head.weight"):  # tied: saved once, as the embedding
                out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.") if name == "mixtral" else key] = (
                    hp,
                    list(p.shape),
                )
    return out


@pytest.mark.parametrize(("fmt", "strategy"), EXPORTS, ids=[s or f for f, s in EXPORTS])
def test_headers_names_dtypes_shapes_and_exact_scales(trained, fmt, strategy, tmp_path):
    from safetensors import safe_open

    name, model = trained
    out = str(tmp_path / "export")
    save_fp8_pretrained(model, out, format=fmt, strategy=strategy, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))  # sharded as save_pretrained shards
    header = {k: (v["dtype"], v["shape"]) for k, v in _headers(out).items()}
    assert header == _expected_header(name, model, fmt, strategy)

    # One dense weight, bytes and scale: the cast's _data, and the fp32 reciprocal of its _scale.
    granularity = GRANULARITY[strategy or fmt]
    w = model.model.layers[0].self_attn.o_proj.weight.detach()
    t = Float8Tensor.from_hp(w, granularity=granularity)
    key = "model.layers.0.self_attn.o_proj.weight"
    index = _json(os.path.join(out, "model.safetensors.index.json"))["weight_map"]
    with safe_open(os.path.join(out, index[key]), "pt") as f:
        data = f.get_tensor(key)
    with safe_open(os.path.join(out, index[key + ("_scale" if strategy else "_scale_inv")]), "pt") as f:
        stored = f.get_tensor(key + ("_scale" if strategy else "_scale_inv"))
    assert torch.equal(data.view(torch.uint8), t._data.view(torch.uint8))
    if fmt == "mxfp8":
        # the code of the inverse multiplier: 2**(code - 127) == 1 / scale, exactly
        assert torch.equal(torch.exp2(stored.float() - 127), torch.reciprocal(t._scale.float()))
    else:
        assert torch.equal(stored.view(torch.int32), torch.reciprocal(t._scale).reshape(stored.shape).view(torch.int32))


def test_expert_bytes_are_per_expert_casts_of_the_stored_weight(trained, tmp_path):
    name, model = trained
    if name == "llama":
        pytest.skip("no experts")
    out = str(tmp_path / "export")
    save_fp8_pretrained(model, out, format="compressed_tensors", strategy="channel")
    from safetensors.torch import load_file

    state = load_file(os.path.join(out, "model.safetensors"))
    experts = model.model.layers[0].mlp.experts
    w = _plain_weight(experts.gate_up_proj)
    assert w.dtype == torch.float32  # the fp32 master is what is cast
    half = w.shape[1] // 2
    first, second = ("w1", "w3") if name == "mixtral" else ("gate_proj", "up_proj")
    moe = "block_sparse_moe" if name == "mixtral" else "mlp"
    for e in range(w.shape[0]):
        t = Float8Tensor.from_hp(w[e], granularity="rowwise")
        for part, rows in ((first, slice(0, half)), (second, slice(half, None))):
            key = f"model.layers.0.{moe}.experts.{e}.{part}.weight"
            assert torch.equal(state[key].view(torch.uint8), t._data[rows].view(torch.uint8))
            assert torch.equal(state[key + "_scale"], torch.reciprocal(t._scale[rows]))


def test_compressed_tensors_config_is_what_compressed_tensors_reads(trained, tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization")
    name, model = trained
    out = str(tmp_path / "export")
    save_fp8_pretrained(model, out, format="compressed_tensors")  # default: the recipe's strategy
    qc = _json(os.path.join(out, "config.json"))["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(qc)
    weights = parsed.config_groups["group_0"].weights
    want = {"llama": "block", "qwen3_moe": "channel", "mixtral": "tensor"}[name]
    assert (
        str(getattr(weights.strategy, "value", weights.strategy)),
        str(getattr(weights.type, "value", weights.type)),
        weights.num_bits,
    ) == (want, "float", 8)
    assert parsed.config_groups["group_0"].input_activations.dynamic is True
    assert (
        parsed.format == "float-quantized"
        and str(getattr(parsed.quantization_status, "value", parsed.quantization_status)) == "compressed"
    )
    assert set(qc) == {"quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme"}


def test_fp8_block_config_has_exactly_its_keys(trained, tmp_path):
    _, model = trained
    for fmt, keys in (
        ("fp8_block", {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}),
        (
            "mxfp8",
            {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "modules_to_not_convert"},
        ),
    ):
        save_fp8_pretrained(model, tmp_path / fmt, format=fmt)
        qc = _json(tmp_path / fmt / "config.json")["quantization_config"]
        assert set(qc) == keys
        assert qc["quant_method"] == ("fp8" if fmt == "fp8_block" else "mxfp8")
        assert qc["weight_block_size"] == ([128, 128] if fmt == "fp8_block" else [1, 32])


def test_fine_tune_a_released_fp8_checkpoint(tmp_path):
    """The other direction: from_pretrained dequantizes an FP8 checkpoint, then
    convert_to_float8_training trains it in FP8."""
    torch.manual_seed(0)
    model = _qwen3_moe()
    save_fp8_pretrained(model, tmp_path / "released", format="fp8_block")  # an unconverted model exports too
    loaded, info = _load(str(tmp_path / "released"), "fp8_block")
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # dequantized
    loaded.config.quantization_config = None
    convert_to_float8_training(
        loaded, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, Float8Linear)
    assert isinstance(loaded.model.layers[0].mlp.experts.gate_up_proj, Float8ExpertWeight)
    before = copy.deepcopy(loaded.model.layers[0].self_attn.q_proj.weight.detach())
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = loaded(_TOKENS, labels=_TOKENS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, loaded.model.layers[0].self_attn.q_proj.weight.detach())


# ----------------------------------------------------------------------------- errors


def _listing(path) -> list[str]:
    return sorted(os.listdir(path))


def test_unknown_format_lists_the_formats(tmp_path):
    with pytest.raises(ValueError, match="format must be one of .*fp8_block.*mxfp8.*compressed_tensors.*'fp8'"):
        save_fp8_pretrained(_llama(), tmp_path / "x", format="fp8")
    assert _listing(tmp_path) == []
    assert FORMATS == ("fp8_block", "mxfp8", "compressed_tensors")


def test_bad_strategy(tmp_path):
    with pytest.raises(ValueError, match="strategy must be one of .*'group'"):
        save_fp8_pretrained(_llama(), tmp_path / "x", format="compressed_tensors", strategy="group")
    with pytest.raises(ValueError, match="strategy= applies to format='compressed_tensors' only"):
        save_fp8_pretrained(_llama(), tmp_path / "x", format="fp8_block", strategy="tensor")
    assert _listing(tmp_path) == []


def test_not_a_pretrained_model(tmp_path):
    with pytest.raises(TypeError, match=r"PreTrainedModel .*; got Linear"):
        save_fp8_pretrained(torch.nn.Linear(128, 128), tmp_path / "x")
    assert _listing(tmp_path) == []


def test_unblockable_weight_names_the_layer_and_leaves_nothing(tmp_path):
    # 128x128 blocks take any shape (partial last blocks: tests/export/test_load_fp8_partial_blocks.py).
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
    )
    model = LlamaForCausalLM(cfg)
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep.txt").write_text("mine")
    for target in (tmp_path / "new", tmp_path / "existing"):
        with pytest.raises(ValueError, match=r"o_proj.weight has N=128, K=48: MXFP8 blocks of 32"):
            save_fp8_pretrained(model, target, format="mxfp8")
    assert _listing(tmp_path) == ["existing"]
    assert _listing(tmp_path / "existing") == ["keep.txt"]
    # tensorwise / per-channel scales take any shape
    save_fp8_pretrained(model, tmp_path / "ok", format="compressed_tensors", strategy="channel")


def test_non_finite_weight_is_refused(tmp_path):
    model = _llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="up_proj.weight holds non-finite values"):
        save_fp8_pretrained(model, tmp_path / "x")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize(
    ("recipe", "fmt", "strategy"),
    [
        ("blockwise", "fp8_block", None),
        ("blockwise", "compressed_tensors", "block"),
        ("rowwise", "compressed_tensors", "channel"),
        ("mxfp8", "mxfp8", None),
    ],
)
def test_matching_recipe_exports_the_bytes_the_training_forward_multiplies(
    recipe, fmt, strategy, monkeypatch, tmp_path
):
    # The output GEMM's weight operand (W^T, (K, N)) as the forward built it, recorded at the
    # product, against the file: the same FP8 bytes, and scales the exact inverses.
    from safetensors.torch import load_file

    import f8tensor.nn.linear_autograd

    torch.manual_seed(0)
    model = _llama().float()
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    layer = model.model.layers[0].mlp.down_proj
    seen = []
    real = f8tensor.nn.linear_autograd.matmul

    def recording(a, b, *args, **kwargs):
        seen.append(b)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(f8tensor.nn.linear_autograd, "matmul", recording)
    x = torch.randn(2, 128, layer.in_features)
    with torch.no_grad():
        layer(x)
    monkeypatch.undo()
    (w_t,) = [
        b for b in seen if isinstance(b, Float8Tensor) and tuple(b.shape) == (layer.in_features, layer.out_features)
    ]
    save_fp8_pretrained(model, tmp_path / "out", format=fmt, strategy=strategy)
    files = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    tensors = {k: v for f in files for k, v in load_file(str(tmp_path / "out" / f)).items()}
    key = "model.layers.0.mlp.down_proj.weight"
    data = tensors[key]
    assert torch.equal(data.view(torch.uint8), w_t._data.t().contiguous().view(torch.uint8)), recipe
    scale = tensors[key + ("_scale" if fmt == "compressed_tensors" else "_scale_inv")]
    trained_scale = w_t._scale.t()  # the forward's multiplier hp -> data, per (N, K) block
    if scale.dtype == torch.uint8:  # e8m0 codes of the inverse: 2**(c - 127) * trained = 1
        assert torch.equal(
            torch.ldexp(torch.ones(()), scale.to(torch.int32) - 127) * trained_scale.float(),
            torch.ones_like(trained_scale, dtype=torch.float32),
        )
    else:
        assert torch.equal(scale.reshape(trained_scale.shape), torch.reciprocal(trained_scale.float()))


def test_mixed_recipes_need_a_strategy(tmp_path):
    model = _llama().float()
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("rowwise"), module_filter_fn=lambda m, fqn: "mlp" in fqn
    )
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("blockwise"), module_filter_fn=lambda m, fqn: "self_attn" in fqn
    )
    with pytest.raises(ValueError, match=r"different weight granularities \(\['block', 'channel'\]\); pass strategy="):
        save_fp8_pretrained(model, tmp_path / "x", format="compressed_tensors")
    assert _listing(tmp_path) == []
    save_fp8_pretrained(model, tmp_path / "x", format="compressed_tensors", strategy="channel")  # an explicit one


def test_a_second_export_into_the_same_directory_leaves_no_stale_shard(tmp_path):
    model = _llama()
    save_fp8_pretrained(model, tmp_path / "out", format="fp8_block", max_shard_size="100KB")
    sharded = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    assert len(sharded) > 1
    (tmp_path / "out" / "notes.txt").write_text("mine")
    save_fp8_pretrained(model, tmp_path / "out", format="fp8_block")
    files = sorted(os.listdir(tmp_path / "out"))
    assert [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"], files
    assert "model.safetensors.index.json" not in files and "notes.txt" in files
    assert _load(str(tmp_path / "out"), "fp8_block") is not None


# The user's files beside a checkpoint, named like its weights; no save of save_fp8_pretrained writes them.
_USERS = {
    "model_ema.safetensors": b"ema weights",
    "model-lora.safetensors": b"adapter weights",
    "model-lora.safetensors.index.json": b'{"weight_map": {"a": "model-lora.safetensors"}}',
    "model.index.json": b"{}",
}


@pytest.mark.parametrize(
    ("first", "second"),
    [("100KB", "150KB"), ("150KB", "100KB"), ("50GB", "100KB")],
    ids=["3-to-2-shards", "2-to-3-shards", "single-to-3-shards"],
)
def test_a_second_export_keeps_the_users_files_and_drops_only_its_own_stale_shards(first, second, tmp_path):
    out = tmp_path / "out"
    torch.manual_seed(0)
    save_fp8_pretrained(_llama(), out, format="fp8_block", max_shard_size=first)
    before = {f for f in os.listdir(out) if f.endswith(".safetensors")}
    for name, data in _USERS.items():
        (out / name).write_bytes(data)
    torch.manual_seed(1)
    model = _llama()
    save_fp8_pretrained(model, out, format="fp8_block", max_shard_size=second)

    index = _json(out / "model.safetensors.index.json")
    shards = set(index["weight_map"].values())
    assert len(shards) != len(before - {"model.safetensors"})  # the two saves differ in their shard count
    assert {n: (out / n).read_bytes() for n in _USERS} == _USERS  # the user's files, byte for byte
    weights = {f for f in os.listdir(out) if f.endswith(".safetensors")}
    assert weights == shards | {"model_ema.safetensors", "model-lora.safetensors"}, sorted(weights)
    loaded, info = _load(str(out), "fp8_block")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # the second save's weights: high precision as saved, FP8 as its dequantized cast
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, _dequantized(w, BLOCK_128x128))


def test_an_earlier_index_removes_nothing_outside_the_directory_nor_a_non_weight_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"not the checkpoint's")
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00001.safetensors").write_bytes(b"stale shard")
    weight_map = {"a": "../outside.safetensors", "b": "notes.txt", "c": "model-00001-of-00001.safetensors"}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_fp8_pretrained(_llama(), out, format="fp8_block")
    assert (tmp_path / "outside.safetensors").read_bytes() == b"not the checkpoint's"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "notes.txt"]


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_expert_scales_are_what_compressed_tensors_initializes_and_decompresses(strategy, tmp_path):
    """Each FP8 weight of the Qwen3-MoE export, experts included: its tensors are the
    compressor's parameter names, its scale has the shape compressed-tensors registers on a
    Linear of that weight's shape, and the compressor's own decompression gives the cast's
    dequantized weight bit for bit."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        initialize_module_for_quantization,
        preset_name_to_scheme,
    )
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _qwen3_moe()
    out = str(tmp_path / "export")
    save_fp8_pretrained(model, out, format="compressed_tensors", strategy=strategy)
    scheme = QuantizationConfig.model_validate(_json(os.path.join(out, "config.json"))["quantization_config"])
    scheme = scheme.config_groups["group_0"]
    if strategy != "tensor":  # compressed-tensors' own scheme of that strategy (it has no dynamic-token tensor preset)
        preset = preset_name_to_scheme({"channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}[strategy], ["Linear"])
        assert scheme.model_dump() == preset.model_dump()
    state = load_file(os.path.join(out, "model.safetensors"))
    fp8 = {k.rsplit(".", 1)[0] for k, v in state.items() if v.dtype == torch.float8_e4m3fn}
    experts = model.model.layers[0].mlp.experts
    half = experts.gate_up_proj.shape[1] // 2
    rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None)}
    checked = 0
    for module in sorted(fp8):
        names = {k.rsplit(".", 1)[1] for k in state if k.rsplit(".", 1)[0] == module}
        assert names == set(FloatQuantizationCompressor.compression_param_names(scheme)), module
        n, k = state[f"{module}.weight"].shape
        with torch.device("meta"):
            linear = torch.nn.Linear(k, n, bias=False)
        initialize_module_for_quantization(linear, scheme)
        assert state[f"{module}.weight_scale"].shape == linear.weight_scale.shape, module
        if ".experts." not in module:
            continue
        e, part = int(module.split(".")[-2]), module.split(".")[-1]
        # one cast per expert tensor, as training casts it: gate and up are rows of one cast
        fused = experts.down_proj if part == "down_proj" else experts.gate_up_proj
        want = _dequantized(fused[e].detach(), GRANULARITY[strategy])[rows.get(part, slice(None))]
        got = FloatQuantizationCompressor.decompress(
            {"weight": state[f"{module}.weight"], "weight_scale": state[f"{module}.weight_scale"]}, scheme
        )["weight"]
        assert torch.equal(got, want), module
        checked += 1
    assert checked == 3 * experts.gate_up_proj.shape[0]
