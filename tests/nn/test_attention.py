"""PyTorch's own attention in FP8 (round 4): after ``convert_to_float8_training``,
``nn.MultiheadAttention`` runs its in-projection (packed ``in_proj_weight``, or
``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ) and its ``out_proj`` in FP8, forward
and both backward products, in training and in eval / ``no_grad`` / ``inference_mode``; it
stays an ``nn.MultiheadAttention`` with the same state dict. The ``nn.Transformer*`` family
runs every linear, attention included, in FP8.

FP8 products are counted by the ops they run: on a CPU a per-tensor product is the custom
op ``f8tensor::cpu_scaled_mm``, a rowwise one ``aten._scaled_mm``.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training, convert_with_policy
from f8tensor.nn.attention import Float8AttentionWeight
from tests.helpers import RanFP8, assert_sqnr

pytestmark = pytest.mark.usefixtures("one_thread")

_FP8_PRODUCTS = {torch.ops.f8tensor.cpu_scaled_mm.default, torch.ops.aten._scaled_mm.default}
_HP_PRODUCTS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._native_multi_head_attention.default,
}


class _Products(TorchDispatchMode):
    """Counts the FP8 matrix products, and the high-precision products whose right operand is
    a 2D parameter-shaped matrix of ``shapes`` (a projection that escaped FP8)."""

    def __init__(self, hp_shapes=()):
        super().__init__()
        self.fp8 = 0
        self.hp: list[str] = []
        self.hp_shapes = {tuple(s) for s in hp_shapes}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _FP8_PRODUCTS:
            self.fp8 += 1
        elif func in _HP_PRODUCTS:
            if func is torch.ops.aten._native_multi_head_attention.default:
                self.hp.append(str(func))
            else:
                w = args[-1] if func is not torch.ops.aten.linear.default else args[1]
                if {tuple(w.shape), tuple(w.shape[::-1])} & self.hp_shapes:
                    self.hp.append(f"{func} {tuple(w.shape)}")
        return func(*args, **(kwargs or {}))


def _weights_shapes(model):
    return [p.shape for p in model.parameters() if p.dim() == 2]


def _encoder_layer(seed=0, **kw):
    torch.manual_seed(seed)
    return nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, **kw)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["train", "eval_no_grad", "inference_mode"])
def test_encoder_layer_runs_four_fp8_products(recipe, mode):
    layer = convert_to_float8_training(_encoder_layer(), config=Float8LinearConfig.from_recipe(recipe))
    assert isinstance(layer.self_attn, nn.MultiheadAttention)
    x = torch.randn(2, 8, 32, requires_grad=mode == "train")
    counter = _Products(_weights_shapes(layer))
    if mode == "train":
        with counter:
            out = layer(x)
        assert counter.fp8 == 4  # in-projection (packed q/k/v), out-projection, linear1, linear2
        with counter:
            out.sum().backward()
        assert counter.fp8 == 4 + 8  # grad_input and grad_weight of each
    else:
        layer.eval()
        ctx = torch.no_grad() if mode == "eval_no_grad" else torch.inference_mode()
        with ctx, counter:
            layer(x)
        # PyTorch's fused fast path (which reads the weights directly) is not taken.
        assert counter.fp8 == 4
    assert counter.hp == []


_LAYOUTS = {
    "self": {"kdim": None, "vdim": None, "cross": False, "products": 2},  # packed in-projection, out_proj
    "cross": {"kdim": None, "vdim": None, "cross": True, "products": 3},  # q slice, kv slice, out_proj
    "kdim_vdim": {"kdim": 48, "vdim": 64, "cross": True, "products": 4},  # q, k, v weights, out_proj
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_output_and_gradients_match_high_precision(layout, batch_first, bias, need_weights):
    spec = _LAYOUTS[layout]
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(32, 2, bias=bias, kdim=spec["kdim"], vdim=spec["vdim"], batch_first=batch_first)
    mha = convert_to_float8_training(copy.deepcopy(ref))
    assert type(mha) is nn.MultiheadAttention
    names = ("q_proj_weight", "k_proj_weight", "v_proj_weight") if spec["kdim"] else ("in_proj_weight",)
    assert set(mha.float8_converted_fqns) == {*names, "out_proj.weight"}
    assert all(isinstance(mha.get_parameter(n), Float8AttentionWeight) for n in mha.float8_converted_fqns)

    def inputs():
        torch.manual_seed(1)
        shape = (2, 8) if batch_first else (8, 2)
        q = torch.randn(*shape, 32, requires_grad=True)
        if not spec["cross"]:
            return q, q, q
        kv_shape = (2, 6) if batch_first else (6, 2)
        k = torch.randn(*kv_shape, spec["kdim"] or 32, requires_grad=True)
        v = k if spec["kdim"] is None else torch.randn(*kv_shape, spec["vdim"], requires_grad=True)
        return q, k, v

    rq, rk, rv = inputs()
    ref_out, ref_w = ref(rq, rk, rv, need_weights=need_weights)
    q, k, v = inputs()
    counter = _Products(_weights_shapes(mha))
    with counter:
        out, w = mha(q, k, v, need_weights=need_weights)
    assert counter.fp8 == spec["products"] and counter.hp == []
    assert (w is None) == (ref_w is None) == (not need_weights)
    grad = torch.randn_like(ref_out)
    ref_out.backward(grad)
    with counter:
        out.backward(grad)
    assert counter.fp8 == 3 * spec["products"] and counter.hp == []
    # Measured over the 24 cases (tensorwise: e4m3 forward, e5m2 gradients; seed 0): output
    # 23.8-25.3 dB, attention weights 29.8-36.5 dB, query grad 18.8-21.0 dB (two FP8
    # backward products in a row), projection weight grads 18.4-24.0 dB, in_proj_bias grad
    # 22.0-29.2 dB (out_proj.bias's grad is the plain sum of the output grad: exact).
    assert_sqnr(ref_out, out, 22.0, "output")
    if need_weights:
        assert_sqnr(ref_w, w, 27.0, "attention weights")
    assert_sqnr(rq.grad, q.grad, 16.0, "query grad")
    for (name, rp), p in zip(ref.named_parameters(), mha.parameters()):
        assert_sqnr(rp.grad, p.grad, 16.0 if name.endswith("weight") else 19.0, f"{name} grad")


def test_mha_inference_mode_takes_fp8_not_the_fused_fast_path():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(32, 2, batch_first=True).eval()
    mha = convert_to_float8_training(copy.deepcopy(ref)).eval()
    x = torch.randn(2, 8, 32)
    counter = _Products(_weights_shapes(mha))
    with torch.inference_mode():
        ref_out, _ = ref(x, x, x, need_weights=False)  # the fused fast path, high precision
        with counter:
            out, _ = mha(x, x, x, need_weights=False)
    assert counter.fp8 == 2 and counter.hp == []
    assert out.is_inference()
    assert_sqnr(ref_out, out, 22.0, "inference output")  # measured 24.6 dB


def test_state_dict_round_trips_both_ways(tmp_path):
    torch.manual_seed(0)
    hp = nn.Sequential(nn.MultiheadAttention(32, 2, batch_first=True), nn.MultiheadAttention(32, 2, kdim=48, vdim=16))
    fp8 = convert_to_float8_training(copy.deepcopy(hp), config=Float8LinearConfig(pad_inner_dim=True))
    hp_sd, fp8_sd = hp.state_dict(), fp8.state_dict()
    assert list(hp_sd) == list(fp8_sd)
    assert all(type(v) is torch.Tensor and v.shape == hp_sd[k].shape for k, v in fp8_sd.items())
    # an nn.MultiheadAttention checkpoint loads into the converted model, through a file
    torch.manual_seed(1)
    other = nn.Sequential(
        nn.MultiheadAttention(32, 2, batch_first=True), nn.MultiheadAttention(32, 2, kdim=48, vdim=16)
    )
    buf = io.BytesIO()
    torch.save(other.state_dict(), buf)
    buf.seek(0)
    fp8.load_state_dict(torch.load(buf, weights_only=True))
    for k, v in other.state_dict().items():
        assert torch.equal(fp8.state_dict()[k], v), k
    assert isinstance(fp8[0].in_proj_weight, Float8AttentionWeight)
    # ... and back: the converted model's checkpoint loads into a plain one
    buf = io.BytesIO()
    torch.save(fp8.state_dict(), buf)
    buf.seek(0)
    hp.load_state_dict(torch.load(buf, weights_only=True))
    for k, v in other.state_dict().items():
        assert torch.equal(hp.state_dict()[k], v), k
    # assign=True puts plain tensors in; they are wrapped again (the projections stay FP8)
    fp8.load_state_dict(other.state_dict(), assign=True)
    assert isinstance(fp8[0].in_proj_weight, Float8AttentionWeight)
    assert isinstance(fp8[1].out_proj.weight, Float8AttentionWeight)
    assert isinstance(fp8[1].q_proj_weight, Float8AttentionWeight)
    # a whole-model copy keeps its projections in FP8
    clone = copy.deepcopy(fp8)
    assert (
        isinstance(clone[0].in_proj_weight, Float8AttentionWeight)
        and clone[0].in_proj_weight._config == fp8[0].in_proj_weight._config
    )


def test_high_precision_product_with_an_fp8_attention_weight_is_refused():
    mha = convert_to_float8_training(nn.MultiheadAttention(32, 2))
    with pytest.raises(NotImplementedError, match="would run in high precision"):
        torch.randn(4, 32) @ mha.in_proj_weight.t()


def test_out_proj_called_on_its_own_runs_in_fp8():
    mha = convert_to_float8_training(nn.MultiheadAttention(32, 2))
    counter = _Products(_weights_shapes(mha))
    with counter:
        mha.out_proj(torch.randn(4, 32))
    assert counter.fp8 == 1 and counter.hp == []


def test_converting_again_counts_and_another_recipe_is_refused(caplog):
    model = nn.Sequential(nn.MultiheadAttention(32, 2))
    convert_to_float8_training(model)
    with caplog.at_level("INFO", logger="f8tensor"):
        again = convert_to_float8_training(model)
    assert "2 layers or expert weights were already FP8" in caplog.text
    assert set(again.float8_converted_fqns) == {"0.in_proj_weight", "0.out_proj.weight"}
    with pytest.raises(ValueError, match="already FP8 with another recipe"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"))


def test_attention_left_in_high_precision_is_reported(caplog):
    model = nn.Sequential(nn.MultiheadAttention(24, 2), nn.MultiheadAttention(32, 2), nn.Linear(32, 32))
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "1")
    assert "1 dims not multiples of 16 [0]" in caplog.text
    assert "1 rejected by module_filter_fn [1]" in caplog.text
    assert model.float8_converted_fqns == ("2",)
    assert not any(isinstance(p, Float8AttentionWeight) for p in model.parameters())
    delayed = Float8LinearConfig.from_recipe("tensorwise")
    delayed = Float8LinearConfig(input=delayed.input.__class__(scaling="delayed"))
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(nn.Sequential(nn.MultiheadAttention(32, 2), nn.Linear(32, 32)), config=delayed)
    assert "delayed scaling is not supported for attention projections" in caplog.text


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_transformer_runs_every_linear_in_fp8(mode, monkeypatch):
    torch.manual_seed(0)
    model = nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True)
    convert_to_float8_training(model)
    # encoder: self-attention 2 + MLP 2; decoder: self-attention 2, cross-attention 2 + MLP 2
    assert sum(f.endswith(("in_proj_weight", "out_proj.weight")) for f in model.float8_converted_fqns) == 6
    assert sum(f.endswith(("linear1", "linear2")) for f in model.float8_converted_fqns) == 4
    src, tgt = torch.randn(2, 8, 32), torch.randn(2, 6, 32)
    ran = RanFP8(monkeypatch)
    counter = _Products(_weights_shapes(model))
    model.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"), counter:
        model(src, tgt)
    assert ran.missing(model) == []
    # encoder 4; decoder: self-attention 2, cross-attention 3 (q and kv slices, out), MLP 2
    assert counter.fp8 == 4 + 7 and counter.hp == []


def test_small_encoder_trains_like_fp32():
    def run(convert):
        torch.manual_seed(0)
        encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
        )
        model = nn.Sequential(encoder, nn.Linear(32, 16))
        if convert:
            convert_to_float8_training(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        x, target = torch.randn(4, 8, 32, generator=gen), torch.randn(4, 8, 16, generator=gen)
        losses = []
        for _ in range(10):
            loss = nn.functional.mse_loss(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref, fp8 = run(False), run(True)
    # Measured: loss 1.474 -> 1.059 (fp32) and 1.472 -> 1.063 (FP8), 0.3% apart at the end.
    assert abs(fp8[-1] - ref[-1]) / ref[-1] < 0.02, (ref, fp8)
    assert fp8[-1] < fp8[0]


def test_encoder_stack_with_padding_mask_stays_fp8_under_inference_mode():
    # nn.TransformerEncoder's own fast path (nested tensors for a padding mask) is declined
    # too: 2 layers x 4 FP8 products, no high-precision projection.
    torch.manual_seed(0)
    encoder = convert_to_float8_training(
        nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 2)
    )
    encoder.eval()
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, 6:] = True
    counter = _Products(_weights_shapes(encoder))
    with torch.inference_mode(), counter:
        encoder(torch.randn(2, 8, 32), src_key_padding_mask=mask)
    assert counter.fp8 == 8 and counter.hp == []


class _Tied(nn.Module):
    """Attentions with tied weights: ``b`` shares every weight of ``a`` (ALBERT-style), and
    ``head``, a linear, shares ``a``'s out-projection weight."""

    def __init__(self, share: bool, head: bool) -> None:
        super().__init__()
        self.a = nn.MultiheadAttention(32, 2, batch_first=True)
        self.b = nn.MultiheadAttention(32, 2, batch_first=True) if share else None
        if self.b is not None:
            self.b.in_proj_weight, self.b.in_proj_bias = self.a.in_proj_weight, self.a.in_proj_bias
            self.b.out_proj.weight, self.b.out_proj.bias = self.a.out_proj.weight, self.a.out_proj.bias
        self.head = nn.Linear(32, 32) if head else None
        if self.head is not None:
            self.head.weight = self.a.out_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x, x, x, need_weights=False)[0]
        if self.b is not None:
            x = self.b(x, x, x, need_weights=False)[0]
        return x if self.head is None else self.head(x)


@pytest.mark.parametrize(("share", "head"), [(True, False), (False, True), (True, True)])
def test_tied_attention_weights_stay_tied(share, head):
    torch.manual_seed(0)
    ref = _Tied(share, head)
    model = convert_to_float8_training(copy.deepcopy(ref))
    params = list(model.parameters())
    assert len(params) == len(list(ref.parameters()))  # 7, 5 and 7 (untied: 10, 6 and 10)
    assert isinstance(model.a.in_proj_weight, Float8AttentionWeight)
    if share:
        assert model.b.in_proj_weight is model.a.in_proj_weight
        assert model.b.out_proj.weight is model.a.out_proj.weight
    if head:  # the linear reads it as it is: one plain Parameter (the attention's products stay FP8)
        assert model.head.weight is model.a.out_proj.weight
        assert not isinstance(model.head.weight, Float8AttentionWeight)
        assert isinstance(model.head, Float8Linear)

    x = torch.randn(2, 8, 32)
    grad = torch.randn(2, 8, 32)
    ref(x).backward(grad)
    counter = _Products(_weights_shapes(ref))
    with counter:
        out = model(x)
    assert counter.fp8 == 2 * (1 + share) + head and counter.hp == []  # the head: a Float8Linear
    out.backward(grad)
    assert_sqnr(ref(x), out, 22.0, "output")  # measured 25.2-32.0 dB
    for (name, rp), p in zip(ref.named_parameters(), params):
        assert_sqnr(rp.grad, p.grad, 15.0, f"{name} grad")  # measured 17.2-32.2 dB (tied: their summed grads)

    before = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.1).step()
    for p, old in zip(params, before):  # each tied weight moves once, by its summed gradient
        assert torch.equal(p.detach(), old.add(p.grad, alpha=-0.1))


def test_attention_with_every_weight_tied_elsewhere_stays_high_precision(caplog):
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(32, 2), "qkv": nn.Linear(32, 96), "out": nn.Linear(32, 32)})
    model.qkv.weight, model.out.weight = model.mha.in_proj_weight, model.mha.out_proj.weight
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model)
    assert "1 nn.MultiheadAttention whose projection weights are all tied to other modules [mha]" in caplog.text
    assert len(list(model.parameters())) == 6
    assert not any(isinstance(p, Float8AttentionWeight) for p in model.parameters())


def test_a_weight_tied_between_attentions_of_two_recipes_is_refused():
    model = _Tied(share=True, head=False)
    recipes = {"a": Float8LinearConfig.from_recipe("tensorwise"), "b": Float8LinearConfig.from_recipe("rowwise")}
    with pytest.raises(ValueError, match="tied between two nn.MultiheadAttention .* would follow two configs"):
        convert_with_policy(model, lambda mod, fqn: recipes.get(fqn))
    assert not any(isinstance(p, Float8AttentionWeight) for p in model.parameters())
