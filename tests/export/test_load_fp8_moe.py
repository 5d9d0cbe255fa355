"""load_fp8_pretrained on MoE models: per-expert checkpoint weights into transformers' fused expert tensors.

Checkpoints come from two writers: ``save_fp8_pretrained`` and :func:`_write_by_hand` here,
which names each expert's linears itself (Qwen3-MoE ``experts.{e}.gate_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1``), quantizes each from the definition (multiplier = amax /
448 per block, row or tensor; bytes = w / multiplier in e4m3) and writes safetensors and
config.json. Tiny Qwen3-MoE and Mixtral models (dims multiples of 128).
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
from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training, sqnr
from f8tensor.export import load_fp8_pretrained, save_fp8_pretrained
from f8tensor.export.frozen_experts import CHECKPOINT_SCALE, FrozenFloat8ExpertWeight
from f8tensor.moe import Float8ExpertWeight, per_expert_loop
from f8tensor.nn import linear_autograd

VOCAB, HIDDEN, MOE_FFN, EXPERTS = 256, 128, 256, 4
E4M3_MAX = 448.0
PROJ = ("gate_up_proj", "down_proj")

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


def _config(arch: str = "qwen3_moe", implementation: str | None = None):
    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": True,
    }
    if arch == "mixtral":
        cfg = MixtralConfig(**common, intermediate_size=MOE_FFN, num_local_experts=EXPERTS, num_experts_per_tok=2)
    elif arch == "deepseek_v3":  # MLA attention; its kv_a_proj_with_mqa (192 rows) stays bf16
        cfg = DeepseekV3Config(
            **common,
            intermediate_size=256,
            moe_intermediate_size=MOE_FFN,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=0,
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_group=1,
            topk_group=1,
        )
    else:
        cfg = Qwen3MoeConfig(
            **common, intermediate_size=256, moe_intermediate_size=MOE_FFN, num_experts=EXPERTS, num_experts_per_tok=2
        )
    if implementation is not None:
        cfg._experts_implementation = implementation
    return cfg


def _model(arch: str = "qwen3_moe", meta: bool = False, implementation: str | None = None) -> torch.nn.Module:
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(_config(arch, implementation), dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_config(_config(arch, implementation), dtype=torch.bfloat16)


def _recipe(name: str) -> Float8LinearConfig:
    if name == "blockwise_pow2":
        c = Float8LinearConfig.from_recipe("blockwise")
        pow2 = {
            r: dataclasses.replace(getattr(c, r), power_of_2_scale=True) for r in ("input", "weight", "grad_output")
        }
        return dataclasses.replace(c, **pow2)
    return Float8LinearConfig.from_recipe(name)


def _exported(tmp_path, fmt, strategy, scale_fmt, recipe, arch="qwen3_moe", keep=False):
    torch.manual_seed(0)
    model = _model(arch)
    convert_to_float8_training(
        model,
        config=_recipe(recipe),
        module_filter_fn=lambda m, fqn: fqn != "lm_head" and not fqn.endswith("kv_a_proj_with_mqa"),
    )
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, Float8ExpertWeight)
    out = str(tmp_path / "ckpt")
    save_fp8_pretrained(model, out, format=fmt, strategy=strategy, scale_fmt=scale_fmt)
    return (out, model) if keep else out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _names(arch: str, e: int) -> dict[str, str]:
    """The checkpoint's names of expert ``e``'s linears (written out, not derived from transformers)."""
    if arch == "mixtral":
        p = f"model.layers.0.block_sparse_moe.experts.{e}"
        return {"gate": f"{p}.w1.weight", "up": f"{p}.w3.weight", "down": f"{p}.w2.weight"}
    p = f"model.layers.0.mlp.experts.{e}"
    return {"gate": f"{p}.gate_proj.weight", "up": f"{p}.up_proj.weight", "down": f"{p}.down_proj.weight"}


def _file_experts(file: dict, arch: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s (gate_up, down) FP8 bytes as the file stores them, fused by hand."""
    n = _names(arch, e)
    return torch.cat([_bits(file[n["gate"]]), _bits(file[n["up"]])]), _bits(file[n["down"]])


def _experts(model):
    return model.model.layers[0].mlp.experts


def _check_frozen_holds_file(model, file: dict, arch: str) -> None:
    experts = _experts(model)
    for e in range(EXPERTS):
        gate_up, down = _file_experts(file, arch, e)
        for name, want in zip(PROJ, (gate_up, down)):
            w = getattr(experts, name)
            assert isinstance(w, FrozenFloat8ExpertWeight) and not w.requires_grad, name
            assert torch.equal(_bits(w._data[e]), want), (name, e)


def _record_weight_operands(monkeypatch) -> list[torch.Tensor]:
    """The FP8 bytes of every forward product's weight operand (the mm's second operand, transposed)."""
    seen: list[torch.Tensor] = []
    real = linear_autograd.matmul

    def recording(a, b, **kwargs):
        seen.append(_bits(b._data.t()))
        return real(a, b, **kwargs)

    monkeypatch.setattr(linear_autograd, "matmul", recording)
    return seen


def _check_multiplies_file(seen: list[torch.Tensor], file: dict, arch: str) -> None:
    """Every expert of the file is multiplied as stored, and no other bytes of the experts' shapes are."""
    wanted = [m for e in range(EXPERTS) for m in _file_experts(file, arch, e)]
    hit = [any(s.shape == w.shape and torch.equal(s, w) for s in seen) for w in wanted]
    assert all(hit), hit


@pytest.mark.parametrize(
    ("arch", "fmt", "strategy", "scale_fmt", "recipe"),
    [(arch, *w) for arch in ("qwen3_moe", "mixtral") for w in WRITES]
    + [("deepseek_v3", *w) for w in WRITES if w[0] == "fp8_block"],
)
def test_round_trip_holds_the_file_bytes_and_writes_them_back(
    tmp_path, monkeypatch, arch, fmt, strategy, scale_fmt, recipe
):
    path, exporter = _exported(tmp_path, fmt, strategy, scale_fmt, recipe, arch, keep=True)
    file = load_file(os.path.join(path, "model.safetensors"))
    model = load_fp8_pretrained(_model(arch, meta=True), path)
    _check_frozen_holds_file(model, file, arch)
    assert {f"model.layers.0.mlp.experts.{p}" for p in PROJ} <= set(model.float8_converted_fqns)
    got, want = _experts_output(model), _experts_output(exporter)
    if per_expert_loop(_recipe(recipe)):  # the exporter's products are the same per-expert loop: bit for bit
        assert torch.equal(got, want)
    else:  # the exporter's grouped product casts the input once for all experts (measured: 26.9 dB tensorwise,
        assert sqnr(want, got) > 24  # 75.5 dB rowwise)
    assert all(p.device.type == "cpu" for p in model.parameters())

    # The forward multiplies the file's bytes (recipe granularity = the checkpoint's), every expert hit.
    seen = _record_weight_operands(monkeypatch)
    ids = torch.arange(64).reshape(2, 32) % VOCAB
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    _check_multiplies_file(seen, file, arch)

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
    model = load_fp8_pretrained(_model(meta=True), path, frozen=False)
    experts = _experts(model)
    scale = "_scale" if fmt == "compressed_tensors" else "_scale_inv"
    for e in range(EXPERTS):
        n = _names("qwen3_moe", e)
        want = {
            part: (file[key].float() * _dense_multiplier(file[key + scale], file[key].shape)).to(torch.bfloat16)
            for part, key in n.items()
        }
        assert torch.equal(experts.gate_up_proj._hp[e], torch.cat([want["gate"], want["up"]])), e
        assert torch.equal(experts.down_proj._hp[e], want["down"]), e
    assert isinstance(experts.gate_up_proj, Float8ExpertWeight) and experts.gate_up_proj.requires_grad
    ids = torch.arange(64).reshape(2, 32) % VOCAB
    model(ids, labels=ids).loss.backward()
    assert experts.gate_up_proj.grad is not None and experts.down_proj.grad is not None


def _dense_multiplier(m: torch.Tensor, shape) -> torch.Tensor:
    """A stored multiplier broadcast over the weight, from the format's definition."""
    n, k = shape
    if m.dtype == torch.uint8:
        m = torch.exp2(m.float() - 127)
    m = m.float()
    if m.numel() == 1:
        return m.reshape(1, 1).expand(n, k)
    return m.repeat_interleave(n // m.shape[0], 0).repeat_interleave(k // m.shape[1], 1)


# ------------------------------------------------------------------ an independent writer


def _quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes, multiplier) of a 2D weight from the definition."""
    w = w.float()
    n, k = w.shape
    if kind in ("deepseek", "ct_block"):
        amax = w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3))
    elif kind == "ct_channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().amax().reshape(1)
    m = amax / E4M3_MAX
    return (w / _dense_multiplier(m, w.shape)).to(torch.float8_e4m3fn), m.contiguous()


def _structured(model) -> None:
    """Expert weights whose 128x128 blocks differ in magnitude (2**(e + i + 2j)): a misplaced block or
    expert costs tens of dB."""
    experts = _experts(model)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            e, n, k = p.shape
            grid = torch.arange(e).reshape(e, 1, 1) + torch.arange(n // 128).reshape(1, -1, 1) * 1
            grid = grid + 2 * torch.arange(k // 128).reshape(1, 1, -1)
            factor = torch.exp2(grid.float() - 3).repeat_interleave(128, 1).repeat_interleave(128, 2)
            p.mul_(factor.to(p.dtype))


def _write_by_hand(path: str, model, arch: str, kind: str) -> dict[str, torch.Tensor]:
    """The checkpoint of ``model`` with every linear (and expert linear) quantized; returns the tensors."""
    os.makedirs(path, exist_ok=True)
    suffix = ".weight_scale_inv" if kind == "deepseek" else ".weight_scale"
    tensors: dict[str, torch.Tensor] = {}

    def put(key: str, w: torch.Tensor) -> None:
        tensors[key], m = _quantize(w, kind)
        tensors[key.removesuffix(".weight") + suffix] = m

    experts = _experts(model)
    half = experts.gate_up_proj.shape[1] // 2
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied: the file leaves it out
        if key.endswith("mlp.experts.gate_up_proj"):
            for e in range(value.shape[0]):
                put(_names(arch, e)["gate"], value[e, :half])
                put(_names(arch, e)["up"], value[e, half:])
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                put(_names(arch, e)["down"], value[e])
        elif key.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(key, value)
        elif arch == "mixtral" and ".mlp.gate." in key:
            tensors[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value.contiguous()
        else:
            tensors[key] = value.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    if kind == "deepseek":
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        strategy = kind.removeprefix("ct_")
        weights = {"num_bits": 8, "type": "float", "strategy": strategy}
        weights["block_structure"] = [128, 128] if strategy == "block" else None
        q = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        }
    config = model.config.to_dict()
    config["quantization_config"] = q
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


@pytest.mark.parametrize(
    ("arch", "kind", "implementation"),
    [
        ("qwen3_moe", "deepseek", "grouped_mm"),
        ("qwen3_moe", "deepseek", "eager"),
        ("qwen3_moe", "deepseek", "batched_mm"),
        ("mixtral", "deepseek", "eager"),
        ("qwen3_moe", "ct_block", "grouped_mm"),
        ("qwen3_moe", "ct_channel", "grouped_mm"),
        ("mixtral", "ct_channel", "batched_mm"),
    ],
)
def test_reads_checkpoints_written_by_hand(tmp_path, monkeypatch, arch, kind, implementation):
    torch.manual_seed(0)
    source = _model(arch, implementation=implementation)
    _structured(source)
    path = str(tmp_path / kind)
    file = _write_by_hand(path, source, arch, kind)
    model = load_fp8_pretrained(_model(arch, meta=True, implementation=implementation), path)
    _check_frozen_holds_file(model, file, arch)
    router = model.model.layers[0].mlp.gate.weight
    assert torch.equal(router.detach(), source.model.layers[0].mlp.gate.weight.detach())
    seen = _record_weight_operands(monkeypatch)
    ids = torch.arange(64).reshape(2, 32) % VOCAB
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    _check_multiplies_file(seen, file, arch)
    # The experts against the bf16 ones the file was quantized from, routing fixed (measured: 23.3 to 23.8 dB,
    # as f8tensor's own conversion of the bf16 model gives).
    got, want = _experts_output(model), _experts_output(source)
    assert sqnr(want, got) > 21


def _experts_output(model) -> torch.Tensor:
    """The experts' output for fixed tokens, each sent to two experts (every expert gets tokens)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.arange(64).reshape(32, 2) % EXPERTS
    weights = torch.full((32, 2), 0.5, dtype=torch.bfloat16)
    with torch.no_grad():
        return _experts(model)(x, idx, weights).float()


def test_tensor_scales_per_projection_are_held_per_row(tmp_path):
    """compressed-tensors ``tensor`` written per linear: gate and up of an expert have their own scales,
    which one fused tensor holds per row (bytes the file's; the tensorwise recipe re-casts per call)."""
    torch.manual_seed(0)
    source = _model()
    _structured(source)
    file = _write_by_hand(str(tmp_path / "t"), source, "qwen3_moe", "ct_tensor")
    model = load_fp8_pretrained(_model(meta=True), str(tmp_path / "t"))
    _check_frozen_holds_file(model, file, "qwen3_moe")
    gate_up = _experts(model).gate_up_proj
    assert gate_up._block == (1, 1, 0) and _experts(model).down_proj._block == (1, 0, 0)
    n = _names("qwen3_moe", 1)
    held = torch.reciprocal(gate_up._scale[1, :, 0])
    half = MOE_FFN
    assert torch.allclose(held[:half], file[n["gate"] + "_scale"].float().expand(half), rtol=2**-23)
    got, want = _experts_output(model), _experts_output(source)
    assert sqnr(want, got) > 21  # measured: 23.1 dB


# ------------------------------------------------------------------ frozen experts


def test_frozen_experts_are_fp8_refuse_gradients_and_pass_input_gradients(tmp_path):
    path = _exported(tmp_path, "fp8_block", None, None, "blockwise")
    model = load_fp8_pretrained(_model(meta=True), path)
    experts = _experts(model)
    with pytest.raises(RuntimeError, match="frozen=False"):
        experts.gate_up_proj.requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen=False"):
        model.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="matmul with frozen FP8 expert weights is not supported"):
        torch.matmul(torch.randn(4, HIDDEN, dtype=torch.bfloat16), experts.gate_up_proj[0].t())
    # The experts' input gradient, against the dequantized weights in fp32 (measured: 27.1 dB).
    x = torch.randn(32, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.arange(64).reshape(32, 2) % EXPERTS
    weights = torch.full((32, 2), 0.5, dtype=torch.bfloat16)
    experts(x, idx, weights).float().pow(2).sum().backward()
    ref_experts = _model().model.layers[0].mlp.experts.float()
    with torch.no_grad():
        for name in PROJ:
            w = getattr(experts, name)
            scale = w._scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
            getattr(ref_experts, name).copy_(w._data.float() / scale)
    xr = x.detach().float().requires_grad_(True)
    ref_experts(xr, idx, weights.float()).pow(2).sum().backward()
    assert sqnr(xr.grad, x.grad.float()) > 25


@pytest.mark.parametrize(
    ("fmt", "strategy", "recipe", "batched_db"),
    [
        ("fp8_block", None, "blockwise", 80),  # measured 88.1 dB
        ("compressed_tensors", "channel", "rowwise", 70),  # measured 75.5 dB
        ("mxfp8", None, "mxfp8", None),  # measured: bit for bit
    ],
)
def test_every_experts_implementation_multiplies_the_same(tmp_path, fmt, strategy, recipe, batched_db):
    """transformers' eager loop (F.linear per expert) and grouped_mm run the same per-expert products; batched_mm
    (one product per token, inputs cast per token as these recipes do) only sums in another order."""
    path = _exported(tmp_path, fmt, strategy, None, recipe)
    out = {}
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        model = load_fp8_pretrained(_model(meta=True, implementation=implementation), path)
        out[implementation] = _experts_output(model)
        empty = torch.zeros(0, HIDDEN, dtype=torch.bfloat16)
        with torch.no_grad():
            none = _experts(model)(empty, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.bfloat16))
        assert none.shape == (0, HIDDEN), implementation
    assert torch.equal(out["eager"], out["grouped_mm"])
    if batched_db is None:
        assert torch.equal(out["batched_mm"], out["grouped_mm"])
    else:
        assert sqnr(out["grouped_mm"], out["batched_mm"]) > batched_db


@pytest.mark.parametrize(
    ("fmt", "strategy", "recipe", "limit"),
    [
        ("fp8_block", None, "blockwise", 1.001),  # measured 1.0005 (128x128 fp32 scales, twice)
        ("compressed_tensors", "tensor", "tensorwise", 1.001),  # measured 1.0000 (one fp32 per expert, twice)
        ("compressed_tensors", "channel", "rowwise", 1.07),  # measured 1.052 (K=128 or 256, fp32 twice per row)
        ("mxfp8", None, "mxfp8", 1.07),  # measured 1.0625 (e8m0 per 32, twice)
    ],
)
def test_frozen_bytes_per_expert_element(tmp_path, fmt, strategy, recipe, limit):
    model = load_fp8_pretrained(_model(meta=True), _exported(tmp_path, fmt, strategy, None, recipe))
    experts = _experts(model)
    held = elements = 0
    for name in PROJ:
        w = getattr(experts, name)
        m = getattr(experts, CHECKPOINT_SCALE.format(name))
        held += sum(t.numel() * t.element_size() for t in (w._data, w._scale, m))
        elements += w.numel()
    assert held / elements <= limit


def test_another_recipe_recasts_the_file_experts_per_call(tmp_path):
    path = _exported(tmp_path, "fp8_block", None, None, "blockwise")
    model = load_fp8_pretrained(_model(meta=True), path, config=Float8LinearConfig.from_recipe("rowwise"))
    ref = load_fp8_pretrained(_model(meta=True), path)
    got, want = _experts_output(model), _experts_output(ref)
    assert sqnr(want, got) > 22  # measured: 24.6 dB (rowwise casts of the same weights)


# ------------------------------------------------------------------ refusals


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert not any(isinstance(p, FrozenFloat8ExpertWeight) for p in model.parameters())


_UP1 = "model.layers.0.mlp.experts.1.up_proj.weight"


def _pop_piece(t):
    t.pop(_UP1)
    t.pop(_UP1 + "_scale_inv")


def _hp_piece(t):
    t[_UP1] = t[_UP1].float().to(torch.bfloat16)
    t.pop(_UP1 + "_scale_inv")


def _fused_on_disk(t):
    gate = [t.pop(f"model.layers.0.mlp.experts.{e}.gate_proj.weight") for e in range(EXPERTS)]
    for e in range(EXPERTS):
        t.pop(f"model.layers.0.mlp.experts.{e}.gate_proj.weight_scale_inv")
    t["model.layers.0.mlp.experts.gate_proj"] = torch.stack(gate)


def _extra_expert(t):
    for name in ("weight", "weight_scale_inv"):
        t[f"model.layers.0.mlp.experts.{EXPERTS}.up_proj.{name}"] = t[f"{_UP1.removesuffix('.weight')}.{name}"].clone()


def _edit(key, fn):
    def edit(t):
        t[key] = fn(t[key])

    return edit


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (_pop_piece, ValueError, "lacks model.layers.0.mlp.experts.1.up_proj.weight .rows of the model's "),
        (_hp_piece, ValueError, "gate_up_proj is stored partly in FP8"),
        (_edit(_UP1, lambda w: w[:128]), ValueError, r"experts.1.up_proj.weight has shape \(128, 128\)"),
        (_edit(_UP1 + "_scale_inv", lambda s: s[:1, :0]), ValueError, "experts.1.up_proj.weight_scale_inv has shape"),
        (
            _edit(_UP1 + "_scale_inv", lambda s: s.index_fill(0, torch.tensor([1]), float("nan"))),
            ValueError,
            "experts.1.up_proj.weight_scale_inv must hold finite positive",
        ),
        (
            _edit(_UP1 + "_scale_inv", lambda s: -s),
            ValueError,
            "experts.1.up_proj.weight_scale_inv must hold finite positive",
        ),
        (_fused_on_disk, NotImplementedError, "experts.gate_proj is a 3D FP8 tensor"),
        (_extra_expert, ValueError, f"experts.{EXPERTS}.up_proj.weight in the checkpoint is not in the model"),
    ],
)
def test_bad_expert_checkpoint_is_refused_and_the_model_unchanged(tmp_path, edit, error, match):
    torch.manual_seed(0)
    path = str(tmp_path / "bad")
    tensors = _write_by_hand(path, _model(), "qwen3_moe", "deepseek")
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    model = _model()
    before = _state(model)
    with pytest.raises(error, match=match):
        load_fp8_pretrained(model, path)
    _unchanged(model, before)


def test_expert_dims_not_multiples_of_16_are_refused_frozen(tmp_path):
    torch.manual_seed(0)
    cfg = _config()
    cfg.moe_intermediate_size = 136  # K of down_proj not a multiple of 16 (gate_up_proj's 272 rows are)
    source = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = str(tmp_path / "odd")
    _write_by_hand(path, source, "qwen3_moe", "ct_channel")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    before = _state(model)
    with pytest.raises(ValueError, match=r"experts.down_proj has shape \(4, 128, 136\); FP8 expert GEMMs need"):
        load_fp8_pretrained(model, path)
    _unchanged(model, before)
    loaded = load_fp8_pretrained(model, path, frozen=False)  # down_proj in high precision, as the converter leaves it
    assert type(loaded.model.layers[0].mlp.experts.down_proj) is torch.nn.Parameter
    assert isinstance(loaded.model.layers[0].mlp.experts.gate_up_proj, Float8ExpertWeight)


def test_experts_stored_transposed_are_refused(tmp_path, monkeypatch):
    """A model whose checkpoint conversion transposes its experts (as for weights stored (E, K, N)): refused by name."""
    loading = pytest.importorskip("transformers.core_model_loading")
    real = loading.revert_weight_conversion

    def transposing(model, state):
        return {k: v.t() if ".experts." in k else v for k, v in real(model, state).items()}

    torch.manual_seed(0)
    path = str(tmp_path / "t")
    _write_by_hand(path, _model(), "qwen3_moe", "deepseek")
    monkeypatch.setattr(loading, "revert_weight_conversion", transposing)
    model = _model()
    before = _state(model)
    with pytest.raises(
        NotImplementedError, match=r"experts\.0\.\w+\.weight is not a rename of one of its tensors nor whole rows"
    ):
        load_fp8_pretrained(model, path)
    _unchanged(model, before)


def test_lora_trains_on_a_frozen_fp8_moe_base(tmp_path):
    peft = pytest.importorskip("peft")
    model = load_fp8_pretrained(_model(meta=True), _exported(tmp_path, "fp8_block", None, None, "blockwise"))
    before = {name: _bits(getattr(_experts(model), name)._data).clone() for name in PROJ}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = lora(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses  # measured: 5.62 -> 4.88
    for name in PROJ:
        assert torch.equal(_bits(getattr(_experts(model), name)._data), before[name]), name
