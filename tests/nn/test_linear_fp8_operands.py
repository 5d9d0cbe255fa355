"""The linear's autograd Function with operands that arrive in FP8, in one process.

Tensor parallelism gathers a layer's input in FP8 (an FP8 input); FSDP2's float8 all-gather
hands the layer an FP8 weight. The distributed tests run those paths across processes; these
call ``QuantizedLinearFn`` (and ``Float8Linear``) with such operands directly, so every path
of the Function also runs where a mutation of it is visible. Expected values: the same
Function given the operand's dequantized values (the cast it would make itself writes the
same bytes), or the product written out from its definition.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import assert_consistent, assert_sqnr, dequantized
from torch import nn

from f8tensor import BlockGranularity, CastConfig, Float8Linear, Float8LinearConfig, GemmConfig
from f8tensor.nn import linear_autograd
from f8tensor.nn.linear_autograd import LinearArgs, QuantizedLinearFn
from f8tensor.quant.specs import CastSpec
from f8tensor.tensor import Float8Tensor, to_float8

E4M3 = torch.float8_e4m3fn
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")


def _structured(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values times a power of two per index of every dim (each scale its own)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    for d, n in enumerate(shape):
        x = x * (2.0 ** (torch.arange(n) % 5 - 2)).reshape([n if i == d else 1 for i in range(len(shape))])
    return x


# ----------------------------------------------------------------------------- FP8 inputs


# A dynamic tensorwise input with a delayed weight: the input may arrive in FP8 (a
# delayed-scaled input may not), and the layer records its calls by the input's amax.
_DELAYED_WEIGHT = Float8LinearConfig(weight=CastConfig(E4M3, scaling="delayed"))


@pytest.fixture
def products(monkeypatch):
    """The (a, b) operand pairs of every product the linear's Function multiplies, in call
    order (forward, grad_input, grad_weight), recorded on the way to the real one."""
    seen = []
    real = linear_autograd.matmul

    def spy(a, b, **kwargs):
        seen.append((a, b))
        return real(a, b, **kwargs)

    monkeypatch.setattr(linear_autograd, "matmul", spy)
    return seen


@pytest.mark.parametrize("shape", [(256, 128), (2, 96, 128)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe", (*RECIPES, "delayed_weight"))
def test_an_fp8_input_gives_what_its_values_give(recipe, shape):
    """An input that arrives as the layer's own input cast (what the FP8 sequence gather
    hands over) is multiplied as it is: output, input, weight and bias gradients bit for
    bit those of its dequantized values given in high precision (and the delayed weight's
    history and recorded calls the same)."""
    config = _DELAYED_WEIGHT if recipe == "delayed_weight" else Float8LinearConfig.from_recipe(recipe)
    linear = nn.Linear(128, 256, dtype=torch.bfloat16)
    layer, ref = (Float8Linear.from_float(copy.deepcopy(linear), config) for _ in range(2))
    x8 = to_float8(_structured(shape, 1).bfloat16(), config.input.operand_spec(len(shape) - 1, ndim=len(shape)))
    x8.requires_grad_()
    x_ref = x8.to_hp().detach().requires_grad_()
    grad = _structured((*shape[:-1], 256), 2).bfloat16()
    y, y_ref = layer(x8), ref(x_ref)
    y.backward(grad)
    y_ref.backward(grad)
    assert y.shape == y_ref.shape == (*shape[:-1], 256) and y.dtype == torch.bfloat16
    assert torch.equal(y, y_ref)
    assert torch.equal(x8.grad, x_ref.grad)
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)
    for name, buffer in layer.named_buffers():
        assert torch.equal(buffer, ref.get_buffer(name)), name


@pytest.mark.parametrize(
    "shape, block", [((4, 8, 128), (2, 1, 128)), ((4, 8, 128), (1, 2, 128)), ((32, 128), (2, 128))]
)
def test_an_fp8_input_scaled_other_than_per_token_is_refused(shape, block):
    config = Float8LinearConfig.from_recipe("blockwise")
    x8 = to_float8(_structured(shape, 1), CastSpec(E4M3, block))
    w = torch.randn(32, 128)
    message = r"^an FP8 input must be scaled per tensor or per token; got blocks " + re.escape(str(block)) + "$"
    with pytest.raises(ValueError, match=message):
        QuantizedLinearFn.apply(x8, w, None, LinearArgs(config))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_an_fp8_input_becomes_a_consistent_token_matrix_with_the_forward_config(recipe, products):
    """The (tokens, K) operand made of a 3D FP8 input keeps the container's invariants and
    carries the forward GEMM's config, as the weight does."""
    config = Float8LinearConfig.from_recipe(recipe)
    x8 = to_float8(_structured((2, 96, 128), 1), config.input.operand_spec(2, ndim=3))
    QuantizedLinearFn.apply(x8, torch.randn(64, 128), None, LinearArgs(config))
    ((a, b),) = products
    assert_consistent(a)
    assert a.shape == (192, 128) and a._gemm == b._gemm == GemmConfig(use_fast_accum=True)


# ----------------------------------------------------------------------------- FP8 weights


def _fp8_weight_step(config: Float8LinearConfig, weight_amax: torch.Tensor | None = None, delayed=None):
    """One forward and backward with a weight handed over in FP8 (cast as the layer's
    forward cast would), and the same with its dequantized values as a plain weight."""
    x, w = _structured((256, 128), 1).bfloat16(), _structured((256, 128), 3).bfloat16()
    bias, grad = torch.randn(256, dtype=torch.bfloat16), _structured((256, 256), 2).bfloat16()
    w8 = to_float8(w, config.weight.operand_spec(1)).requires_grad_()
    runs = []
    for weight in (w8, w8.to_hp().detach().requires_grad_()):
        xi, bi = x.clone().requires_grad_(), bias.clone().requires_grad_()
        args = LinearArgs(config, delayed, None, weight_amax if weight is w8 else None)
        y = QuantizedLinearFn.apply(xi, weight, bi, args)
        y.backward(grad)
        runs.append((y, xi.grad, weight.grad, bi.grad))
    return w8, grad, runs


# Beside the recipes: a tensorwise weight with rowwise grad_output (no row scales to
# fold), and a rowwise weight with tensorwise grad_output (the fold needs a rowwise one).
_MIXED = {
    "weight_tensorwise_grad_rowwise": Float8LinearConfig(
        input=CastConfig(E4M3, "rowwise"), weight=CastConfig(E4M3), grad_output=CastConfig(E4M3, "rowwise")
    ),
    "weight_rowwise_grad_tensorwise": Float8LinearConfig(
        input=CastConfig(E4M3, "rowwise"), weight=CastConfig(E4M3, "rowwise"), grad_output=CastConfig(E4M3)
    ),
}


@pytest.mark.parametrize("recipe", RECIPES + tuple(_MIXED))
def test_an_fp8_weight_gives_what_its_values_give(recipe):
    """Output, weight and bias gradients bit for bit those of the dequantized weight; so is
    the input gradient, except for a rowwise weight with rowwise grad_output (below)."""
    config = _MIXED[recipe] if recipe in _MIXED else Float8LinearConfig.from_recipe(recipe)
    _, _, ((y, gx, gw, gb), (y_ref, gx_ref, gw_ref, gb_ref)) = _fp8_weight_step(config)
    assert torch.equal(y, y_ref)
    assert type(gw) is torch.Tensor and gw.dtype == torch.bfloat16 and torch.equal(gw, gw_ref)
    assert torch.equal(gb, gb_ref)
    if recipe not in ("rowwise", "rowwise_with_gw_hp", "weight_rowwise_grad_tensorwise"):
        assert torch.equal(gx, gx_ref)


def test_a_rowwise_fp8_weight_with_tensorwise_grad_output_is_cast_again_along_n():
    """No row scales to fold into a tensorwise grad_output: grad_x = g @ W contracts over
    the weight's rows, so the product re-derives W8 per column (448 / amax over N) from its
    fp32 dequantized values (the plain weight would be cast from its bf16 values). Against
    that definition, written out here: measured 55.3 dB (the bf16 output's rounding)."""
    w8, grad, ((_, gx, _, _), _) = _fp8_weight_step(_MIXED["weight_rowwise_grad_tensorwise"])
    g_scale = (448.0 / grad.float().abs().amax().double()).float()
    g8 = (grad.float() * g_scale).clamp(-448, 448).to(E4M3)
    w32 = dequantized(w8)
    col_scale = (448.0 / w32.abs().amax(0, keepdim=True).double()).float()
    w8_cols = (w32 * col_scale).clamp(-448, 448).to(E4M3)
    expected = (g8.double() / g_scale.double()) @ (w8_cols.double() / col_scale.double())
    assert_sqnr(expected, gx.double(), 50.0, "grad_x")


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64], ids=["fp32_default", "fp64_default"])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_a_rowwise_fp8_weight_folds_its_row_scales_into_grad_output(recipe, default_dtype, products):
    """grad_x = g @ W with W = W8 / s (one scale per row n, the dim grad_x contracts):
    computed as (g / s) @ W8, with g / s cast per token (e4m3, 448 / its amax), so the
    gathered bytes serve as they are. Against that definition, written out here: 55.5 dB
    measured (the bf16 output's rounding); casting the weight again along N instead
    measured 27.1 dB against it (and 28.9 against g @ W in float64, where the fold
    measured 32.3). The same with torch's default dtype set to float64. The operands of
    that product are consistent Float8Tensors (W8 with a unit 0-dim scale)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        w8, grad, ((_, gx, _, _), _) = _fp8_weight_step(Float8LinearConfig.from_recipe(recipe))
    finally:
        torch.set_default_dtype(previous)
    g8, w8_unit = products[1]
    assert_consistent(g8)
    assert_consistent(w8_unit)
    assert w8_unit._scale.dtype == torch.float32 and w8_unit._scale.item() == 1.0
    folded = grad.float() / w8._scale.reshape(1, -1)
    token_scale = (448.0 / folded.abs().amax(1, keepdim=True).double()).float()
    g8 = (folded * token_scale).clamp(-448, 448).to(E4M3)
    expected = (g8.double() / token_scale.double()) @ w8._data.double()
    assert gx.dtype == torch.bfloat16
    assert_sqnr(expected, gx.double(), 50.0, "grad_x")
    assert_sqnr(grad.double() @ dequantized(w8).double(), gx.double(), 31.0, "grad_x against g @ W")  # 32.3 measured


def _block_cast(x32: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A 2D fp32 tensor cast to e4m3 per ``block`` (448 / the block's amax, float64 quotient
    rounded to fp32), dequantized in float64: the definition of a block cast."""
    rows, cols = x32.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            piece = x32[i : i + block[0], j : j + block[1]]
            scale = (448.0 / piece.abs().max().double()).float()
            out[i : i + block[0], j : j + block[1]] = (piece * scale).clamp(-448, 448).to(
                E4M3
            ).double() / scale.double()
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "tensorwise"])
def test_an_fp8_weight_on_another_device(recipe, products):
    """The FP8-weight paths make nothing on the CPU behind the caller's back: on ``meta``
    (standing for any device) every gradient comes out there, and so does every operand
    of the three products and its scale (a rowwise weight's unit scale in grad_x's fold
    included: a CPU scale beside a GPU operand is what the GPU kernels refuse)."""
    config = Float8LinearConfig.from_recipe(recipe)
    w8 = to_float8(torch.randn(256, 128, device="meta"), config.weight.operand_spec(1)).requires_grad_()
    x = torch.randn(64, 128, device="meta", requires_grad=True)
    y = QuantizedLinearFn.apply(x, w8, None, LinearArgs(config))
    y.backward(torch.randn(64, 256, device="meta"))
    assert y.device.type == x.grad.device.type == w8.grad.device.type == "meta"
    operands = [t for pair in products for t in pair]
    assert len(operands) == 6
    for t in operands:
        assert t.device.type == "meta" and (not isinstance(t, Float8Tensor) or t._scale.device.type == "meta")


def test_an_fp8_weight_blocked_along_k_is_cast_again_along_n_from_fp32():
    """1x64 weight blocks run along K, which grad_x's product does not contract: the
    gathered weight is cast again in 64x1 blocks along N from its fp32 dequantized values
    (the plain weight would be cast from its bf16 values), grad_output in 1x64 tiles along
    N. Against that definition, written out here: measured 55.7 dB (the bf16 output); the
    weight cast from its bf16 values instead measured 41.9 dB against it."""
    tiles = CastConfig(E4M3, BlockGranularity((1, 64)))
    config = Float8LinearConfig(input=tiles, weight=tiles, grad_output=tiles, emulate=True)
    w8, grad, ((_, gx, _, _), _) = _fp8_weight_step(config)
    expected = _block_cast(grad.float(), (1, 64)) @ _block_cast(dequantized(w8), (64, 1))
    assert gx.dtype == torch.bfloat16
    assert_sqnr(expected, gx.double(), 50.0, "grad_x")


def test_a_delayed_fp8_weight_needs_its_amax():
    config = Float8LinearConfig.from_recipe("delayed")
    layer = Float8Linear.from_float(nn.Linear(128, 256), config)
    delayed = (layer.delayed_amax_history, layer.delayed_step)
    w8 = to_float8(layer.weight.detach(), CastSpec(E4M3), scale=torch.tensor(4.0))
    message = (
        r"^a delayed-scaled weight gathered in FP8 arrived without its amax; call the layer "
        r"\(Float8Linear\), which hands it over, in LinearArgs\.weight_amax$"
    )
    with pytest.raises(RuntimeError, match=message):
        QuantizedLinearFn.apply(torch.randn(16, 128), w8, None, LinearArgs(config, delayed))


def test_a_delayed_fp8_weight_records_its_scale_and_amax(products):
    """The gather cast the weight with the history's scale: forward keeps that scale as the
    step's weight scale, backward pushes the whole weight's amax (handed over) into the
    weight's history, as a cast here would have."""
    config = Float8LinearConfig.from_recipe("delayed")
    layer = Float8Linear.from_float(nn.Linear(128, 256), config)
    delayed = (layer.delayed_amax_history, layer.delayed_step)
    w = layer.weight.detach()
    w8 = to_float8(w, CastSpec(E4M3), scale=torch.tensor(4.0)).requires_grad_()
    whole_amax = torch.tensor(7.5)  # the gathered weight's, over every rank's shard
    x = torch.randn(16, 128, requires_grad=True)
    y = QuantizedLinearFn.apply(x, w8, None, LinearArgs(config, delayed, None, whole_amax))
    assert layer.scale_weight.item() == 4.0
    assert layer.amax_history_weight[0].item() == 0.0  # pushed in backward, not forward
    y.backward(torch.randn(16, 256))
    # grad_x multiplies the gathered bytes as they are, with the gather's scale.
    w8_grad_input = products[1][1]
    assert w8_grad_input._scale.item() == 4.0 and torch.equal(
        w8_grad_input._data.view(torch.uint8), w8._data.view(torch.uint8)
    )
    assert layer.amax_history_weight[0].item() == 7.5
    assert layer.amax_history_input[0].item() == x.detach().abs().max().item()
    assert x.grad is not None and w8.grad is not None


# ----------------------------------------------------------------------------- every GEMM's config


def test_emulate_reaches_both_backward_gemms():
    """Blocks that no GPU kernel multiplies (1x64 tiles, 64x64 weight blocks) with
    ``emulate=True``: every GEMM of the layer, forward, grad_input and grad_weight, takes
    the reference path (the CUDA-rules check records a call a GPU would refuse, and the
    suite's fixture fails the test on one)."""
    tiles = CastConfig(E4M3, BlockGranularity((1, 64)))
    config = Float8LinearConfig(
        input=tiles, weight=CastConfig(E4M3, BlockGranularity((64, 64))), grad_output=tiles, emulate=True
    )
    linear = nn.Linear(128, 64)
    layer = Float8Linear.from_float(copy.deepcopy(linear), config)
    x, grad = _structured((64, 128), 1), _structured((64, 64), 2)
    x_ref = x.double().requires_grad_()
    y_ref = nn.functional.linear(x_ref, linear.weight.double(), linear.bias.double())
    y_ref.backward(grad.double())
    x.requires_grad_()
    y = layer(x)
    y.backward(grad)
    # Measured 28.9, 29.3 and 29.4 dB against float64.
    assert_sqnr(y_ref, y.double(), 27.0, "output")
    assert_sqnr(x_ref.grad, x.grad.double(), 27.0, "grad_input")
    assert_sqnr(grad.double().t() @ x_ref.detach(), layer.weight.grad.double(), 27.0, "grad_weight")


_DOUBLE_BACKWARD = re.escape("Float8Linear(in_features=32, out_features=16): double backward (a gradient of a gradient")


def test_a_second_derivative_is_refused_naming_the_layer():
    layer = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig.from_recipe("rowwise"))
    x = torch.randn(8, 32, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=_DOUBLE_BACKWARD):
        gx.sum().backward()


@pytest.mark.parametrize("through", ["grad_output", "weight", "input"])
def test_a_second_derivative_through_any_one_input_is_refused(through):
    """Each first-order gradient stays connected to every input of the backward: a second
    derivative with respect to grad_output alone (frozen weight), to the weight alone
    (grad_x's), or to the input alone (the high-precision weight gradient's) is refused by
    the layer's message, not by autograd's "does not require grad"."""
    config = Float8LinearConfig.from_recipe("rowwise_with_gw_hp")
    layer = Float8Linear.from_float(nn.Linear(32, 16), config)
    x = torch.randn(8, 32, requires_grad=True)
    layer.weight.requires_grad_(through != "grad_output")
    v = torch.randn(8, 16, requires_grad=through == "grad_output")
    y = layer(x)
    if through == "grad_output":
        (first,), wrt = torch.autograd.grad(y, x, v, create_graph=True), v
    elif through == "weight":
        (first,), wrt = torch.autograd.grad(y, x, v, create_graph=True), layer.weight
    else:
        (first,), wrt = torch.autograd.grad(y, layer.weight, v, create_graph=True), x
    with pytest.raises(RuntimeError, match=_DOUBLE_BACKWARD):
        torch.autograd.grad(first.sum(), wrt)
