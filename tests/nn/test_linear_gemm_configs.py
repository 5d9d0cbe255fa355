"""Each GEMM of a Float8Linear gets what the config says for it: its flags (fast
accumulation in forward only, padding of K, N everywhere the config asks and of the tokens
in the weight-gradient GEMM always, emulation everywhere), its formats (per-GEMM overrides,
high precision where an override says None) and its telemetry (the first cast of each
role). The products are observed by a spy on the Function's ``matmul`` that calls through.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import assert_sqnr
from torch import nn

from f8tensor import CastConfig, Float8Linear, Float8LinearConfig, GemmConfig
from f8tensor.kernels import reference
from f8tensor.nn import linear_autograd
from f8tensor.quant.config import GEMMS
from f8tensor.tensor import to_float8

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def products(monkeypatch):
    """The (a, b, kwargs) of every product the linear's Function makes, in order."""
    seen = []
    real = linear_autograd.matmul

    def spy(a, b, **kwargs):
        seen.append((a, b, kwargs))
        return real(a, b, **kwargs)

    monkeypatch.setattr(linear_autograd, "matmul", spy)
    return seen


def _step(config: Float8LinearConfig, tokens: int = 64, dtype=torch.float32, weight_dtype=None):
    layer = Float8Linear.from_float(nn.Linear(64, 32), config)
    if weight_dtype is not None:
        layer = layer.to(weight_dtype)
    x = torch.randn(tokens, 64, dtype=dtype, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    return layer, x, y


_FLAGS = [
    {"use_fast_accum": True, "pad_inner_dim": True, "emulate": True},
    {"use_fast_accum": False, "pad_inner_dim": False, "emulate": False},
]


@pytest.mark.parametrize("flags", _FLAGS, ids=["on", "off"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed", "blockwise", "mxfp8", "nvfp4", "mxfp4"])
def test_each_gemm_gets_its_flags(recipe, flags, products):
    config = Float8LinearConfig.from_recipe(recipe, **flags)
    _step(config)
    forward = GemmConfig(
        use_fast_accum=flags["use_fast_accum"], pad_inner_dim=flags["pad_inner_dim"], emulate=flags["emulate"]
    )
    grad_input = GemmConfig(pad_inner_dim=flags["pad_inner_dim"], emulate=flags["emulate"])
    grad_weight = GemmConfig(pad_inner_dim=True, emulate=flags["emulate"])
    assert len(products) == 3
    for (a, b, _), expected, what in zip(products, (forward, grad_input, grad_weight), GEMMS):
        assert (a._gemm, b._gemm) == (expected, expected), what


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_an_fp8_weight_gets_each_gemms_flags(recipe, products):
    """A weight handed over in FP8 (FSDP2's float8 all-gather) takes the forward GEMM's
    config in forward and grad_input's in backward, like a weight cast here (as it is, with
    its row scales folded into grad_output, or cast again along N)."""
    flags = {"use_fast_accum": True, "pad_inner_dim": True, "emulate": True}
    config = Float8LinearConfig.from_recipe(recipe, **flags)
    w8 = to_float8(torch.randn(32, 64), config.weight.operand_spec(1)).requires_grad_()
    x = torch.randn(64, 64, requires_grad=True)
    linear_autograd.QuantizedLinearFn.apply(x, w8, None, linear_autograd.LinearArgs(config)).backward(
        torch.randn(64, 32)
    )
    forward, grad_input = products[0], products[1]
    assert forward[1]._gemm == GemmConfig(use_fast_accum=True, pad_inner_dim=True, emulate=True) == forward[0]._gemm
    assert grad_input[1]._gemm == GemmConfig(pad_inner_dim=True, emulate=True) == grad_input[0]._gemm


def test_tensorwise_casts_serve_both_gemms_that_read_them(products):
    """Per tensor, one cast of grad_output serves grad_input and (column-major) the weight
    gradient, and the input's forward cast serves the weight gradient: the same scale."""
    _step(Float8LinearConfig.from_recipe("tensorwise"))
    (x8, _, _), (g8, _, _), (g8t, x8_cm, _) = products
    assert g8t._scale is g8._scale and x8_cm._scale is x8._scale
    assert torch.equal(g8t._data.t().view(torch.uint8), g8._data.view(torch.uint8))
    assert torch.equal(x8_cm._data.view(torch.uint8), x8._data.view(torch.uint8))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_tensorwise_weight_is_cast_again_with_its_forward_scale(recipe, products):
    """A tensorwise weight is not kept in FP8 for backward: grad_input casts it again with
    the scale forward used (dynamic or, here after a first step, delayed), so the very same
    bytes; a delayed scale is not the weight's current dynamic one."""
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(64, 32), Float8LinearConfig.from_recipe(recipe))
    for _ in range(2):  # a second step: the delayed history holds the first step's amax
        products.clear()
        with torch.no_grad():
            layer.weight.mul_(1.5)
        x = torch.randn(64, 64, requires_grad=True)
        layer(x).backward(torch.randn(64, 32))
    (_, w8t, _), (_, w8, _) = products[0], products[1]
    assert torch.equal(w8._scale, w8t._scale)
    assert torch.equal(w8._data.view(torch.uint8), w8t._data.t().view(torch.uint8))
    dynamic = 448.0 / layer.weight.detach().abs().max().item()
    assert (abs(w8._scale.item() - dynamic) > 1e-3 * dynamic) is (recipe == "delayed")


def test_per_role_telemetry_without_an_input_gradient_records_the_weight_gradient_cast():
    """No input gradient: grad_output's only cast is the weight-gradient GEMM's (along the
    tokens), and that is the one its telemetry records."""
    config = Float8LinearConfig.from_recipe("rowwise", collect_stats=True)
    layer = Float8Linear.from_float(nn.Linear(64, 32), config)
    x = _spiky((64, 64), [(0, 0)])
    g = _spiky((64, 32), [(0, 0), (1, 0), (2, 0)])
    layer(x).backward(g)
    assert torch.equal(layer.float8_stats_grad_output, _stats_of(g, config.grad_output, 0))
    assert not torch.equal(_stats_of(g, config.grad_output, 0), _stats_of(g, config.grad_output, 1))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8", "nvfp4"])
def test_the_weight_gradient_is_written_in_the_weight_dtype(recipe, products):
    """fp32 master weights with a bf16 input: the weight-gradient product writes fp32
    (no bf16 rounding of the gradient), the other two the input's bf16."""
    layer, x, y = _step(Float8LinearConfig.from_recipe(recipe), dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32
    assert products[2][2].get("out_dtype") == torch.float32


_NVFP4_FP8_WGRAD = Float8LinearConfig.from_recipe("nvfp4").with_gemm_formats(
    {("grad_weight", "input"): CastConfig(E4M3, "rowwise")}
)
_PADDED = {"rowwise": 26.0, "mxfp8": 26.0, "nvfp4": 13.5, "mxfp4": 12.0, "nvfp4_with_fp8_input": 15.0}


@pytest.mark.parametrize("recipe", list(_PADDED))
def test_token_counts_off_the_alignment_are_padded_in_the_weight_gradient(recipe):
    """The weight-gradient product contracts over the tokens: 40 tokens (not a multiple of
    16, nor of FP4's 32-token blocks) work without pad_inner_dim, also when only one operand
    of that GEMM is FP4 (its blocks and the Hadamard transform need the padding). The weight
    gradient against the float64 product: measured 28.9 (rowwise), 28.6 (mxfp8), 15.5
    (nvfp4), 13.8 (mxfp4) and 17.2 (nvfp4 with an FP8 input there) dB."""
    torch.manual_seed(0)
    config = _NVFP4_FP8_WGRAD if recipe == "nvfp4_with_fp8_input" else Float8LinearConfig.from_recipe(recipe)
    layer = Float8Linear.from_float(nn.Linear(64, 32), config)
    x, g = torch.randn(40, 64, requires_grad=True), torch.randn(40, 32)
    layer(x).backward(g)
    assert_sqnr(g.double().t() @ x.detach().double(), layer.weight.grad.double(), _PADDED[recipe], "grad_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_input_fp32_weight"])
@pytest.mark.parametrize("gemm, operand", [(g, r) for g, roles in GEMMS.items() for r in roles])
def test_an_override_to_high_precision_runs_that_gemm_unquantized(gemm, operand, dtype):
    """With one operand of one GEMM overridden to None, that GEMM runs in the input's dtype
    (fp32 master weights are read in bf16 for a bf16 input): bit for bit the plain product;
    the other two stay quantized. The weight gradient comes out in the weight's dtype."""
    config = Float8LinearConfig.from_recipe("rowwise").with_gemm_formats({(gemm, operand): None})
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = Float8Linear.from_float(copy.deepcopy(linear), config)
    x = torch.randn(64, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(64, 32, dtype=dtype)
    y = layer(x)
    y.backward(g)
    w, b = linear.weight.detach(), linear.bias.detach()
    plain = {
        "forward": (y, torch.nn.functional.linear(x.detach(), w.to(dtype), b.to(dtype))),
        "grad_input": (x.grad, g @ w.to(dtype)),
        "grad_weight": (layer.weight.grad, (g.t() @ x.detach()).float()),
    }
    assert layer.weight.grad.dtype == torch.float32
    for name, (got, hp) in plain.items():
        assert torch.equal(got, hp) is (name == gemm), name


def test_cast_for_refuses_an_unknown_gemm_or_operand():
    config = Float8LinearConfig.from_recipe("rowwise")
    allowed = "forward: input and weight; grad_input: grad_output and weight; grad_weight: grad_output and input"
    for gemm, operand in (("backward", "input"), ("forward", "grad_output")):
        with pytest.raises(
            ValueError,
            match="^"
            + re.escape(
                f"cast_for: no operand {operand!r} of GEMM {gemm!r}; the GEMMs and their operands are {allowed}"
            )
            + "$",
        ):
            config.cast_for(gemm, operand)


def _spiky(shape: tuple[int, int], at: list[tuple[int, int]]) -> torch.Tensor:
    t = torch.randn(shape) * 2.0**-8
    for i, j in at:
        t[i, j] = 2.0**12
    return t


def _stats_of(hp: torch.Tensor, cast: CastConfig, contracted: int) -> torch.Tensor:
    return reference.cast_with_stats(hp, cast.operand_spec(contracted))[2]


@pytest.mark.parametrize("input_grad", [True, False], ids=["with_grad_input", "weight_grad_only"])
def test_per_gemm_formats_record_the_first_cast_of_each_role(input_grad):
    """Telemetry with per-GEMM formats records each role's first cast: input and weight as
    the forward GEMM casts them, grad_output as the grad_input GEMM casts it, or as the
    grad_weight GEMM does when no input gradient is asked for. Here every GEMM casts its
    operands in another granularity, so each recorded vector says which cast made it."""
    rows, tiles = CastConfig(E4M3, "rowwise"), CastConfig(E4M3, (1, 32))
    config = Float8LinearConfig(
        input=tiles,
        weight=tiles,
        grad_output=tiles,
        collect_stats=True,
        emulate=True,
        gemm_overrides={
            ("grad_weight", "grad_output"): rows,
            ("grad_weight", "input"): rows,
            ("grad_input", "weight"): rows,
        },
    )
    # Small values and a few large ones: the values that flush to zero (underflow_count)
    # depend on which elements share a scale with a large one.
    x, g = _spiky((64, 64), [(0, 0), (1, 0)]), _spiky((64, 32), [(0, 0), (1, 0), (2, 0)])
    layer = Float8Linear.from_float(nn.Linear(64, 32), config)
    with torch.no_grad():
        layer.weight.copy_(_spiky((32, 64), [(0, 0), (1, 0)]))
    x.requires_grad_(input_grad)
    layer(x).backward(g)
    w = layer.weight.detach()
    assert torch.equal(layer.float8_stats_input, _stats_of(x.detach(), tiles, 1))
    assert torch.equal(layer.float8_stats_weight, _stats_of(w, tiles, 1))
    expected_go = _stats_of(g, tiles, 1) if input_grad else _stats_of(g, rows, 0)
    assert torch.equal(layer.float8_stats_grad_output, expected_go)
    # The other casts of each role record different vectors: the check above can tell.
    assert not torch.equal(_stats_of(g, tiles, 1), _stats_of(g, rows, 0))
    assert not torch.equal(_stats_of(x.detach(), tiles, 1), _stats_of(x.detach(), rows, 0))
    assert not torch.equal(_stats_of(w, tiles, 1), _stats_of(w, rows, 0))
