"""convert_to_float8_training finds every module that computes a linear map: nn.Linear,
its subclasses that keep nn.Linear.forward, Hugging Face's Conv1D (GPT-2); it says what
it converted and what it skipped, and warns when it converted nothing."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import assert_sqnr
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8tensor.nn.linear import Float8Conv1D

# One FP8 linear against fp32: output and gradients (cf. tests/nn/test_linear.py).
OUTPUT_MIN_DB = 25.0
GRAD_MIN_DB = 24.0  # a weight or bias gradient of one FP8 layer: measured 27.2-27.4 dB
# A weight gradient at the bottom of a 2-block GPT-2 whose 8 projections are all FP8: the
# FP8 errors of the layers above add up in it (measured 21.0 dB at seed 0).
MODEL_GRAD_MIN_DB = 17.0


class _TitanStyleLinear(nn.Linear):
    """Like torchtitan's Linear: an nn.Linear subclass with its own constructor and
    methods, and nn.Linear's forward."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.init_std = 0.02

    def init_weights(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)


class _Overriding(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_subclass_keeping_linear_forward_converts_and_keeps_its_type():
    model = nn.Sequential(_TitanStyleLinear(64, 32), nn.ReLU(), _Overriding(32, 32))
    ref = copy.deepcopy(model)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("tensorwise"))
    layer = model[0]
    assert isinstance(layer, Float8Linear) and isinstance(layer, _TitanStyleLinear)
    assert layer.init_std == 0.02
    layer.init_weights()  # the subclass's methods still work on the converted layer
    layer.weight.data.copy_(ref[0].weight)
    assert type(model[2]) is _Overriding
    assert model.float8_converted_fqns == ("0",)
    x = torch.randn(8, 64, requires_grad=True)
    y_ref, y = ref[0](x), layer(x)
    assert_sqnr(y_ref, y, OUTPUT_MIN_DB, "subclass output")
    g_ref = torch.autograd.grad(y_ref.sum(), ref[0].weight)[0]
    g = torch.autograd.grad(y.sum(), layer.weight)[0]
    # The gradient of y.sum() is ones, exact in e5m2: only x's cast rounds (measured 32.5 dB).
    assert_sqnr(g_ref, g, 29.0, "subclass grad_weight")


def test_summary_line_counts_and_reasons(caplog):
    model = nn.ModuleDict(
        {
            "a": nn.Linear(64, 64),
            "b": _TitanStyleLinear(64, 64),
            "c": _Overriding(64, 64),
            "d": nn.Linear(64, 30),
            "head": nn.Linear(64, 64),
        }
    )
    with caplog.at_level(logging.INFO, logger="f8tensor"):
        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "head")
    summary = [r.getMessage() for r in caplog.records if "linear layers to FP8" in r.getMessage()]
    expected = (
        "f8tensor: converted 2 of 5 linear layers to FP8; skipped 1 nn.Linear subclass overriding forward [c]; "
        "1 dims not multiples of 16 [d]; 1 rejected by module_filter_fn [head]"
    )
    assert summary == [expected]
    assert model.float8_converted_fqns == ("a", "b")


def test_warns_when_nothing_is_converted():
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.warns(
        UserWarning, match=r"converted 0 of 1 linear layers to FP8; skipped 1 rejected by module_filter_fn"
    ):
        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: False)
    assert model.float8_converted_fqns == ()
    with pytest.warns(UserWarning, match="the model has no nn.Linear"):
        convert_to_float8_training(nn.Sequential(nn.ReLU()))


def test_a_bare_layer_reports_its_own_name():
    layer = convert_to_float8_training(nn.Linear(32, 32))
    assert isinstance(layer, Float8Linear) and layer.float8_converted_fqns == ("",)


transformers = pytest.importorskip("transformers")


def test_hf_conv1d_converts_and_keeps_its_layout():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(96, 64)  # nf = out, nx = in: weight (64, 96)
    ref = copy.deepcopy(conv)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    model = nn.Sequential(conv)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"))
    layer = model[0]
    assert isinstance(layer, Float8Conv1D) and layer.weight is conv.weight
    assert {k: v.shape for k, v in model.state_dict().items()} == {"0.weight": (64, 96), "0.bias": (96,)}
    x = torch.randn(3, 7, 64)
    y_ref, y = ref(x), layer(x)
    assert y.shape == y_ref.shape == (3, 7, 96)
    assert_sqnr(y_ref, y, OUTPUT_MIN_DB, "Conv1D output")
    y_ref.square().sum().backward()
    y.square().sum().backward()
    assert layer.weight.grad.shape == (64, 96)
    assert_sqnr(ref.weight.grad, layer.weight.grad, GRAD_MIN_DB, "Conv1D grad_weight")
    assert_sqnr(ref.bias.grad, layer.bias.grad, GRAD_MIN_DB, "Conv1D grad_bias")
    opt.step()  # the optimizer built before the swap still owns the parameter
    assert not torch.equal(layer.weight, ref.weight)


def test_gpt2_converts_every_conv1d_and_trains_like_its_twin():
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    ref = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(ref)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("tensorwise"), module_filter_fn=lambda m, fqn: fqn != "lm_head"
    )
    # c_attn, c_proj (attention), c_fc, c_proj (MLP) in each of 2 blocks.
    assert len(model.float8_converted_fqns) == 8
    assert all(isinstance(model.get_submodule(n), Float8Conv1D) for n in model.float8_converted_fqns)
    assert model.state_dict().keys() == ref.state_dict().keys()
    tokens = torch.randint(0, 256, (2, 32))
    loss_ref = ref(input_ids=tokens, labels=tokens).loss
    loss = model(input_ids=tokens, labels=tokens).loss
    assert abs(loss.item() - loss_ref.item()) < 0.01 * loss_ref.item()
    loss_ref.backward()
    loss.backward()
    name = "transformer.h.0.mlp.c_fc.weight"
    assert_sqnr(
        ref.get_parameter(name).grad, model.get_parameter(name).grad, MODEL_GRAD_MIN_DB, "GPT-2 c_fc grad_weight"
    )


def test_the_core_imports_no_integration():
    # f8tensor depends on torch alone: importing it (and the integrations package) pulls in
    # no framework. Run in a fresh interpreter, as other tests import them.
    import subprocess
    import sys

    code = (
        "import sys, f8tensor, f8tensor.integrations; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'transformers', 'lightning', 'pytorch_lightning', 'torchtitan', 'timm', 'accelerate', 'safetensors'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
