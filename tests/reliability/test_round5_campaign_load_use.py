"""Round 5 campaign: a model ``load_fp8_pretrained`` loaded, used as a user would use it.

Optimizers, ``state_dict``, ``deepcopy``, pickling, ``.to``, PEFT LoRA, compile, saving
again and odd shapes, with torch's behaviour on the plain model (and transformers' own FP8
loader) as the reference. Checkpoints from :mod:`round5_checkpoints`.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from round5_checkpoints import (
    DTYPES,
    LINEARS,
    LOGITS_MIN_DB,
    UP,
    build_model,
    deepseek_checkpoint,
    dequantized_model,
    frozen_bytes,
    frozen_layers,
    is_linear,
    logits_of,
    quiet,
    token_ids,
    write_checkpoint,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from f8tensor import Float8LinearConfig, sqnr
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen import FrozenFloat8Linear, FrozenFloat8Weight


@pytest.fixture(autouse=True)
def _quiet():
    with quiet():
        yield


@pytest.fixture
def deepseek(tmp_path):
    return deepseek_checkpoint(tmp_path)


# ---------------------------------------------------------- a loaded model in use


@pytest.mark.parametrize("make", ["adamw", "sgd_momentum", "f8tensor_adamw"])
def test_optimizer_steps_leave_the_frozen_bytes(deepseek, make):
    import f8tensor.optim

    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    before, norm = frozen_bytes(model), model.model.norm.weight.detach().clone()
    params = list(model.parameters())
    opt = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1),
        "f8tensor_adamw": lambda: f8tensor.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    }[make]()
    for _ in range(2):
        model(token_ids(), labels=token_ids()).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(frozen_bytes(model)[k], v) for k, v in before.items())
    assert all(m.weight.grad is None for m in frozen_layers(model).values())
    assert not torch.equal(model.model.norm.weight, norm)  # the rest trains, as in torch


def test_requires_grad_on_the_whole_model_is_refused_by_name(deepseek):
    # torch would set every parameter; a frozen FP8 weight cannot train (deliberate, named).
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    with pytest.raises(RuntimeError, match="frozen=False"):
        model.requires_grad_(True)


def test_state_dict_round_trips_through_torch_save(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other = load_fp8_pretrained(build_model(meta=True, seed=1), path)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert all(isinstance(m.weight, FrozenFloat8Weight) for m in frozen_layers(other).values())
    assert torch.equal(logits_of(other), logits_of(model))


def test_state_dict_loads_into_the_plain_model_as_the_dequantized_weights(deepseek):
    path, _, dequantized = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    plain = build_model(seed=1)
    plain.load_state_dict(model.state_dict())
    for key, w in dequantized.items():
        assert torch.equal(plain.get_parameter(key), w.bfloat16()), key


def test_deepcopy_keeps_the_frozen_weights(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    copied = copy.deepcopy(model)
    assert all(isinstance(m.weight, FrozenFloat8Weight) for m in frozen_layers(copied).values())
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert torch.equal(logits_of(copied), logits_of(model))
    with pytest.raises(RuntimeError, match="frozen=False"):
        copied.get_submodule(UP).weight.requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_to_dtype_keeps_the_bytes_and_computes_in_it(deepseek, dtype):
    path, source, dequantized = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    before = frozen_bytes(model)
    model.to(dtype)
    assert all(torch.equal(frozen_bytes(model)[k], v) for k, v in before.items())
    assert all(
        isinstance(m.weight, FrozenFloat8Weight) and m.weight.dtype == dtype for m in frozen_layers(model).values()
    )
    logits = logits_of(model)
    assert logits.dtype == dtype
    assert sqnr(logits_of(dequantized_model(source, dequantized, dtype)).float(), logits.float()) >= LOGITS_MIN_DB


def test_frozen_layer_takes_another_recipe_as_loading_with_it(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    for layer in frozen_layers(model).values():
        layer.config = Float8LinearConfig.from_recipe("rowwise")
    loaded = load_fp8_pretrained(build_model(meta=True), path, config=Float8LinearConfig.from_recipe("rowwise"))
    assert torch.equal(logits_of(model), logits_of(loaded))


@pytest.mark.parametrize("recipe", ["delayed", "nvfp4"])
def test_frozen_layer_refuses_a_recipe_it_cannot_hold(deepseek, recipe):
    path, _, _ = deepseek
    layer = frozen_layers(load_fp8_pretrained(build_model(meta=True), path))[UP]
    config = layer.config
    with pytest.raises(ValueError, match="a frozen FP8 weight is cast dynamically"):
        layer.config = Float8LinearConfig.from_recipe(recipe)
    assert layer.config is config


def test_peft_lora_trains_only_the_adapters(deepseek):
    peft = pytest.importorskip("peft")
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    before = frozen_bytes(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(named) == 4 and all("lora_" in n for n, _ in named)  # A and B of q_proj and v_proj
    trainable = [p for _, p in named]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(token_ids(), labels=token_ids()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = {k.removesuffix(".base_layer"): v for k, v in frozen_bytes(model.get_base_model()).items()}
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("kind", ["deepseek", "ct_channel", "ct_tensor"])
def test_compiled_frozen_layer_equals_eager(fresh_dynamo, tmp_path, kind):
    # Found: dynamo rebuilt the frozen weight as a plain Float8Tensor and refused the graph.
    write_checkpoint(str(tmp_path / kind), build_model(), kind)
    layer = frozen_layers(load_fp8_pretrained(build_model(meta=True), str(tmp_path / kind)))[UP]
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
    write_checkpoint(path, build_model(), kind)
    model = load_fp8_pretrained(build_model(meta=True), path)
    if to_fp16:
        model.to(torch.float16)
    save_fp8_pretrained(model, tmp_path / "again", format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    written, again = _fp8_entries(path), _fp8_entries(str(tmp_path / "again"))
    assert written.keys() == again.keys()
    assert all(torch.equal(again[k], v) for k, v in written.items())


def test_ue8m0_save_of_a_frozen_non_power_of_two_checkpoint_is_refused(deepseek, tmp_path):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    with pytest.raises(ValueError, match="scale_fmt='ue8m0' needs power-of-two scales; a frozen weight's are not"):
        save_fp8_pretrained(model, tmp_path / "ue8m0", scale_fmt="ue8m0")
    assert not (tmp_path / "ue8m0").exists()


def test_ue8m0_save_of_a_trainable_recipe_without_power_of_two_is_refused(deepseek, tmp_path):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path, frozen=False)
    with pytest.raises(ValueError, match="is not cast with power_of_2_scale=True"):
        save_fp8_pretrained(model, tmp_path / "ue8m0", scale_fmt="ue8m0")


def test_ue8m0_checkpoint_trains_and_saves_powers_of_two(tmp_path):
    path = str(tmp_path / "ue8m0")
    write_checkpoint(path, build_model(), "deepseek_ue8m0")
    model = load_fp8_pretrained(build_model(meta=True), path, frozen=False)  # default: power-of-two recipe
    model(token_ids(), labels=token_ids()).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    save_fp8_pretrained(model, tmp_path / "again", scale_fmt="ue8m0")
    scales = [v for k, v in _fp8_entries(str(tmp_path / "again")).items() if k.endswith("_scale_inv")]
    assert scales and all(bool((torch.frexp(s).mantissa == 0.5).all()) for s in scales)
    reloaded = load_fp8_pretrained(build_model(meta=True), str(tmp_path / "again"))
    assert torch.isfinite(logits_of(reloaded)).all()


def test_trainable_model_saved_and_reloaded_frozen_computes_the_same(deepseek, tmp_path):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path, frozen=False)
    save_fp8_pretrained(model, tmp_path / "again")
    # The masters are the file's dequantized weights: cast again, the same FP8 bytes. A
    # multiplier is the fp32 reciprocal of the cast's scale, 1 / fl(448 / amax), which may sit
    # one ulp from the file's fl(amax / 448) (IEEE rounding; which blocks do depends on the
    # weights): no further.
    again, file = _fp8_entries(str(tmp_path / "again")), _fp8_entries(path)
    assert again.keys() == file.keys()
    for key, want in file.items():
        if key.endswith("_scale_inv"):
            ulp = torch.nextafter(want, torch.full_like(want, torch.inf)) - want
            assert ((again[key] - want).abs() <= ulp).all(), key
        else:
            assert torch.equal(again[key], want), key
    reloaded = load_fp8_pretrained(build_model(meta=True), str(tmp_path / "again"))
    want = logits_of(load_fp8_pretrained(build_model(meta=True), path))
    assert sqnr(want.float(), logits_of(reloaded).float()) >= 90.0  # measured 111 dB


def test_refused_double_names_the_dtype_and_to_restores(deepseek):
    # Deliberate: FP8 weights stand for bf16/fp16/fp32 only. torch's _apply converts module by
    # module, so the modules before the first frozen layer are already fp64 when it refuses:
    # .to(the model's dtype) restores them.
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    before = frozen_bytes(model)
    with pytest.raises(TypeError, match="high-precision floating dtype"):
        model.double()
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.equal(frozen_bytes(model)[k], v) for k, v in before.items())


# ------------------------------------------------------- shapes and whole-model use


def _ct_channel_odd(tmp_path) -> tuple[str, torch.nn.Module]:
    """A per-channel checkpoint of a model whose MLP is 200 wide (not a multiple of 16)."""
    source = build_model(ffn=200)
    path = str(tmp_path / "odd")
    write_checkpoint(path, source, "ct_channel")
    return path, source


def test_frozen_dims_the_recipe_cannot_take_are_refused_before_any_change(tmp_path):
    # Found: the embeddings were overwritten, then Float8Linear refused the 200-wide layer.
    path, _ = _ct_channel_odd(tmp_path)
    model = build_model(ffn=200, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"down_proj \(200 -> 128\) has dims .* pad_inner_dim=True"):
        load_fp8_pretrained(model, path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_frozen_odd_dims_load_with_padding(tmp_path):
    path, source = _ct_channel_odd(tmp_path)
    config = Float8LinearConfig.from_recipe("rowwise", pad_inner_dim=True)
    model = load_fp8_pretrained(build_model(ffn=200, meta=True), path, config=config)
    assert len(frozen_layers(model)) == len(LINEARS)
    assert sqnr(logits_of(source).float(), logits_of(model).float()) >= LOGITS_MIN_DB  # measured 28.7 dB


def test_trainable_odd_dims_stay_high_precision_holding_the_file(tmp_path):
    # As convert_to_float8_training: layers FP8 GEMMs cannot take are left in high precision (logged).
    path, source = _ct_channel_odd(tmp_path)
    model = load_fp8_pretrained(build_model(ffn=200, meta=True), path, frozen=False)
    up = model.get_submodule(UP)
    assert type(up) is torch.nn.Linear and UP not in model.float8_converted_fqns
    assert sqnr(source.get_submodule(UP).weight.float(), up.weight.float()) >= 30.0


def test_linear_biases_load_as_the_file(tmp_path):
    source = build_model(bias=True)
    write_checkpoint(str(tmp_path / "b"), source)
    model = load_fp8_pretrained(build_model(bias=True, meta=True), str(tmp_path / "b"))
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, FrozenFloat8Linear) and q.bias.requires_grad
    assert torch.equal(q.bias, source.get_submodule("model.layers.0.self_attn.q_proj").bias)


def test_torch_save_of_the_whole_model_keeps_the_weights_frozen(deepseek):
    # Found: unpickled, the weights came back as plain Float8Tensors that accepted requires_grad.
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert all(isinstance(m.weight, FrozenFloat8Weight) for m in frozen_layers(loaded).values())
    assert torch.equal(logits_of(loaded), logits_of(model))
    with pytest.raises(RuntimeError, match="frozen=False"):
        loaded.get_submodule(UP).weight.requires_grad_(True)


def test_eval_mode_is_kept(deepseek):
    path, _, _ = deepseek
    model = build_model()
    model.eval()
    load_fp8_pretrained(model, path)
    assert not any(m.training for m in frozen_layers(model).values())


def test_gradient_checkpointing_trains_the_rest(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    model.gradient_checkpointing_enable()
    model.train()
    model(token_ids(), labels=token_ids(), use_cache=False).loss.backward()
    assert model.model.norm.weight.grad is not None
    assert all(m.weight.grad is None for m in frozen_layers(model).values())


def test_generate_keeps_the_prompt_and_adds_tokens(deepseek):
    path, _, _ = deepseek
    model = load_fp8_pretrained(build_model(meta=True), path)
    ids = token_ids()[:1, :4]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["deepseek", "deepseek_ue8m0"])
def test_trainable_masters_are_transformers_dequantized_weights(tmp_path, kind, dtype):
    # The reference: transformers' own FP8 loader, dequantizing on the CPU.
    from transformers import FineGrainedFP8Config

    path = str(tmp_path / kind)
    write_checkpoint(path, build_model(dtype), kind)
    transformers.logging.set_verbosity_error()
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    model = load_fp8_pretrained(build_model(dtype, meta=True), path, frozen=False)
    for key in (k for k in reference.state_dict() if is_linear(k)):
        assert torch.equal(model.get_parameter(key).detach(), reference.get_parameter(key).detach()), key


# DeepSeek-V3's shapes: kv_a_proj_with_mqa has 576 rows, 4.5 blocks of 128. Here an MLP 192 wide.


@pytest.mark.parametrize("kind", ["deepseek", "ct_block"])
def test_partial_blocks_load_as_transformers_dequantizes_them(tmp_path, kind):
    # Found: refused ("blocks must divide"), where transformers reads the ceil-divided scale grid.
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    source = build_model(ffn=192)
    path = str(tmp_path / kind)
    write_checkpoint(path, source, kind)
    file = load_file(os.path.join(path, "model.safetensors"))
    model = load_fp8_pretrained(build_model(ffn=192, meta=True), path, frozen=False)
    suffix = "_scale_inv" if kind == "deepseek" else "_scale"
    for key in (k for k in file if is_linear(k)):
        want = _dequantize_fp8_weight(file[key], file[key + suffix], [128, 128], torch.float32)
        assert torch.equal(model.get_parameter(key).detach(), want.bfloat16()), key


def test_partial_blocks_frozen_compute_as_the_dequantized_model(tmp_path):
    source = build_model(ffn=192)
    dequantized = write_checkpoint(str(tmp_path / "p"), source)
    model = load_fp8_pretrained(build_model(ffn=192, meta=True), str(tmp_path / "p"))
    assert frozen_layers(model)[UP].weight._scale.shape == (2, 1)
    want = logits_of(dequantized_model(source, dequantized, torch.bfloat16))
    assert sqnr(want.float(), logits_of(model).float()) >= LOGITS_MIN_DB  # measured 28.0 dB


def test_partial_blocks_with_a_floor_divided_scale_grid_are_refused(tmp_path):
    def floor_grid(t):
        t[UP + ".weight_scale_inv"] = t[UP + ".weight_scale_inv"][:1]

    write_checkpoint(str(tmp_path / "p"), build_model(ffn=192), edit=floor_grid)
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv has shape \(1, 1\); the weight needs \(2, 1\)"):
        load_fp8_pretrained(build_model(ffn=192), str(tmp_path / "p"))


def test_partial_blocks_frozen_save_writes_the_file_back(tmp_path):
    write_checkpoint(str(tmp_path / "p"), build_model(ffn=192))
    model = load_fp8_pretrained(build_model(ffn=192, meta=True), str(tmp_path / "p"))
    save_fp8_pretrained(model, tmp_path / "again")
    written, again = _fp8_entries(str(tmp_path / "p")), _fp8_entries(str(tmp_path / "again"))
    assert written.keys() == again.keys()
    assert all(torch.equal(again[k], v) for k, v in written.items())
