"""FP4 training: recipes nvfp4/mxfp4, their tricks (Hadamard transform, 2D weight blocks,
stochastic rounding, four-over-six), per-GEMM formats, layer policies, the mid-training
switch of forward GEMMs to high precision, and FP4 telemetry. CPU, reference path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import f8tensor
import f8tensor.quant.quantizers
from f8tensor import (
    FP4_CAST_DTYPE,
    CastConfig,
    Float4Tensor,
    Float8Linear,
    Float8LinearConfig,
    MX_1x32,
    MXFP4_1x32,
    NVFP4_1x16,
    block_policy,
    convert_to_float8_training,
    convert_with_policy,
    keep_last_blocks_in_hp,
    set_forward_in_high_precision,
)
from f8tensor.kernels.fp4 import FP4Spec, cast_fp4
from f8tensor.quant.hadamard import apply_rht
from f8tensor.quant.quantizers import cast_gemm_operand


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(10 * torch.log10(ref.square().sum() / (ref - approx).square().sum()))


def _pair(seed=0, m=64, k=128, n=96):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n)
    return ref, torch.randn(4, m // 4, k)


def _run(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    return y, x.grad, layer.weight.grad


# ----------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe,thresholds", [("nvfp4", (15.0, 13.5, 12.5)), ("mxfp4", (14.5, 12.5, 11.5))])
def test_recipe_three_gemms_sqnr(recipe, thresholds):
    # Measured (seed 0): nvfp4 16.8 / 15.5 / 14.7 dB, mxfp4 16.3 / 14.5 / 13.6 dB (y, grad_x, grad_W).
    ref, x = _pair()
    layer = Float8Linear.from_float(nn.Linear(128, 96), Float8LinearConfig.from_recipe(recipe))
    layer.load_state_dict(ref.state_dict())
    y, gx, gw = _run(layer, x)
    y_ref, gx_ref, gw_ref = _run(ref, x)
    for got, want, threshold in zip((y, gx, gw), (y_ref, gx_ref, gw_ref), thresholds):
        assert sqnr(want, got) >= threshold


def test_recipes_and_their_options():
    nv = Float8LinearConfig.from_recipe("nvfp4")
    assert nv.hadamard_wgrad and nv.weight.granularity.block == (16, 16)
    assert nv.grad_output.rounding == "stochastic" and nv.input.rounding == "nearest"
    assert nv.input.fp4_kind == "nvfp4" and Float8LinearConfig.from_recipe("mxfp4").weight.fp4_kind == "mxfp4"
    # Each trick is a switch.
    off = dataclasses.replace(
        nv,
        hadamard_wgrad=False,
        weight=CastConfig(FP4_CAST_DTYPE, NVFP4_1x16),
        grad_output=CastConfig(FP4_CAST_DTYPE, NVFP4_1x16),
    )
    assert off.uses_gemm_formats
    with pytest.raises(ValueError, match="FP4 granularity"):
        CastConfig(FP4_CAST_DTYPE, "rowwise")
    with pytest.raises(ValueError, match="NVFP4's"):
        CastConfig(torch.float8_e4m3fn, NVFP4_1x16)
    with pytest.raises(ValueError, match="dynamic"):
        CastConfig(FP4_CAST_DTYPE, NVFP4_1x16, scaling="delayed")
    with pytest.raises(ValueError, match="NVFP4"):
        f8tensor.Float8Tensor.from_hp(torch.randn(4, 32), granularity=NVFP4_1x16)


def test_converter_takes_fp4_recipes_and_skips_unaligned_layers():
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("nvfp4"))
    assert isinstance(model[0], Float8Linear) and not isinstance(model[2], Float8Linear)  # 40 % 32 != 0
    model(torch.randn(8, 64)).sum().backward()
    assert model[0].weight.grad is not None


# ----------------------------------------------------------------- tricks


def test_rht_leaves_the_product_unchanged_in_fp64():
    g = torch.randn(256, 48, dtype=torch.float64)
    x = torch.randn(256, 80, dtype=torch.float64)
    exact = g.t() @ x
    for seed in (0, 1, 12345):
        out = apply_rht(g, seed).t() @ apply_rht(x, seed)
        assert sqnr(exact, out) >= 280.0  # fp64 round-off only (measured ~300 dB)


def test_layer_transforms_both_wgrad_operands_with_one_rotation(monkeypatch):
    """The layer's weight-gradient GEMM casts ``Q g`` and ``Q x`` (one 16x16 block rotation
    along the tokens, the contraction dim, for both): their product is ``g.t() @ x`` up to
    fp32 rounding, and without ``hadamard_wgrad`` the operands are ``g`` and ``x`` as they are."""
    seen = []
    real = f8tensor.quant.quantizers.cast_gemm_operand

    def recording(hp, cast, contracted_dim, *args, **kwargs):
        seen.append((hp.detach().clone(), contracted_dim))
        return real(hp, cast, contracted_dim, *args, **kwargs)

    monkeypatch.setattr(f8tensor.quant.quantizers, "cast_gemm_operand", recording)
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    x[torch.arange(5, 64, 16)] *= 20  # token outliers: a transform that skipped one operand would show
    for rht in (True, False):
        layer = Float8Linear.from_float(nn.Linear(128, 96), Float8LinearConfig.from_recipe("nvfp4", hadamard_wgrad=rht))
        seen.clear()
        xr = x.clone().requires_grad_()
        y = layer(xr)
        g = torch.randn_like(y)
        y.backward(g)
        (gq, gdim), (xq, xdim) = seen[-2:]  # grad_weight's operands, cast last
        assert gdim == xdim == 0 and gq.shape == (64, 96) and xq.shape == (64, 128)
        assert sqnr(g.double().t() @ x.double(), gq.double().t() @ xq.double()) >= 120.0  # fp32 round-off
        assert torch.equal(xq, x) is (not rht) and torch.equal(gq, g) is (not rht)


def _wgrad_sqnr(g, x, rht: bool, g_rounding: str = "nearest") -> float:
    exact = g.double().t() @ x.double()
    if rht:
        g, x = apply_rht(g, 0), apply_rht(x, 0)
    gq = Float4Tensor.from_hp(g, "nvfp4", block=(16, 1), pack_dim=0, rounding=g_rounding)
    xq = Float4Tensor.from_hp(x, "nvfp4", block=(16, 1), pack_dim=0)
    return sqnr(exact, gq.to_hp().double().t() @ xq.to_hp().double())


def _token_outliers(k, every, where, seed=0):
    """1024 tokens x 64, N(0, 1); 1 token in ``every`` made ``k`` times larger: in x only, in g
    and x at independent tokens, or in g and x at the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    g, x = torch.randn(1024, 64, generator=gen), torch.randn(1024, 64, generator=gen)
    idx = torch.randperm(1024, generator=gen)[: 1024 // every]
    x[idx] *= k
    if where == "independent":
        g[torch.randperm(1024, generator=gen)[: 1024 // every]] *= k
    elif where == "same":
        g[idx] *= k
    return g, x


def _crossed(k):
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(1024, 64, generator=gen), torch.randn(1024, 64, generator=gen)
    x[torch.arange(3, 1024, 16)] *= k
    g[torch.arange(7, 1024, 16)] *= k
    return g, x


def _student_t(dof):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 1024, 64, generator=gen)
    t = z / (torch.randn(2, 1024, 64, dof, generator=gen).square().sum(-1) / dof).sqrt()
    return t[0], t[1]


# (input class, measured gain in dB of RHT over no RHT in the NVFP4 wgrad product's SQNR,
# both operands rounded to nearest, seed 0; benchmarks/bench_rht.py has means over seeds,
# more classes and the demo GPT's layers).
RHT_CLASSES = {
    "gaussian": (lambda: _token_outliers(1, 16, "x"), -0.04),
    "x token outliers 10x, 1 in 16": (lambda: _token_outliers(10, 16, "x"), -0.59),
    "x token outliers 20x, 1 in 64": (lambda: _token_outliers(20, 64, "x"), -1.24),
    "g and x token outliers 20x, 1 in 64, independent": (lambda: _token_outliers(20, 64, "independent"), -2.54),
    "g and x token outliers 10x, 1 in 16, same tokens": (lambda: _token_outliers(10, 16, "same"), 1.94),
    "crossed 20x in every block": (lambda: _crossed(20), -2.59),
    "student-t 3 dof": (lambda: _student_t(3), -0.66),
}


@pytest.mark.parametrize("name", list(RHT_CLASSES))
def test_rht_wgrad_gain_measured_round_to_nearest(name):
    """With both operands rounded to nearest, RHT never reaches the issue's +3 dB: at best
    +1.9 dB (outlier tokens shared by g and x), and it loses up to 2.6 dB where one value
    dominates a block in one operand only. Why: without the transform that value sets its
    block's scale and is encoded exactly; the transform spreads it into 16 values of about
    its size / 4, which land in E2M1's coarsest step (4 to 6) with the other tokens' signal
    as small differences on top. Measured gains (seed 0) held to +-0.5 dB."""
    make, measured = RHT_CLASSES[name]
    g, x = make()
    gain = _wgrad_sqnr(g, x, True) - _wgrad_sqnr(g, x, False)
    assert gain == pytest.approx(measured, abs=0.5), f"{name}: {gain:+.2f} dB"
    assert gain < 3.0


def test_rht_wgrad_gain_with_stochastic_gradients_on_shared_outlier_tokens():
    """The issue's target, as the nvfp4 recipe casts (grad_output stochastically rounded, the
    input to nearest): on a few tokens 10x larger than the rest in both operands (1 in 16,
    the same tokens), RHT improves the wgrad product's SQNR by 3.33 dB on average over 4
    inputs x 4 rounding draws (measured; single draws 2.4 to 4.3 dB). Met narrowly, for this
    class only: on the demo GPT's layers the same setting measures -0.9 to +0.7 dB, on
    independent or crossed outliers -1.1 to -3.4 dB (benchmarks/bench_rht.py)."""
    gains = []
    for seed in range(4):
        g, x = _token_outliers(10, 16, "same", seed)
        for draw in range(4):
            torch.manual_seed(draw)
            plain = _wgrad_sqnr(g, x, False, "stochastic")
            torch.manual_seed(draw)
            gains.append(_wgrad_sqnr(g, x, True, "stochastic") - plain)
    mean = sum(gains) / len(gains)
    assert mean == pytest.approx(3.33, abs=0.05) and mean >= 3.0
    assert min(gains) > 2.0


def test_2d_weight_blocks_same_codes_in_forward_and_grad_input():
    cfg = Float8LinearConfig.from_recipe("nvfp4")
    w = torch.randn(96, 128)
    fwd = cast_gemm_operand(w, cfg.weight, 1, f8tensor.GemmConfig(), cfg)  # contracted over in_features
    bwd = cast_gemm_operand(w, cfg.weight, 0, f8tensor.GemmConfig(), cfg)  # contracted over out_features
    assert fwd._pack_dim == 1 and bwd._pack_dim == 0
    assert torch.equal(fwd.codes(), bwd.codes()) and torch.equal(fwd.to_hp(), bwd.to_hp())
    one_d = dataclasses.replace(cfg, weight=CastConfig(FP4_CAST_DTYPE, NVFP4_1x16))
    f1 = cast_gemm_operand(w, one_d.weight, 1, f8tensor.GemmConfig(), one_d)
    b1 = cast_gemm_operand(w, one_d.weight, 0, f8tensor.GemmConfig(), one_d)
    assert not torch.equal(f1.to_hp(), b1.to_hp())  # 1x16 blocks: two different quantizations


def test_stochastic_gradients_vary_and_average_out():
    ref, x = _pair()
    layer = Float8Linear.from_float(nn.Linear(128, 96), Float8LinearConfig.from_recipe("nvfp4", hadamard_wgrad=False))
    layer.load_state_dict(ref.state_dict())
    grads = []
    for _ in range(16):
        layer.weight.grad = None
        _run(layer, x)
        grads.append(layer.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])
    _, _, gw_ref = _run(ref, x)
    # Averaging 16 draws beats one draw (grad_output's rounding is unbiased; the input's
    # round-to-nearest error stays): measured 14.6 -> 16.2 dB.
    assert sqnr(gw_ref, torch.stack(grads).mean(0)) >= sqnr(gw_ref, grads[0]) + 1.0


def test_four_over_six_sqnr_gain():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    plain = sqnr(x, Float4Tensor.from_hp(x, "nvfp4").to_hp())
    fos = sqnr(x, Float4Tensor.from_hp(x, "nvfp4", four_over_six=True).to_hp())
    # Measured on N(0, 1): 20.41 -> 21.16 dB (+0.75 dB).
    assert fos - plain >= 0.5
    with pytest.raises(ValueError, match="NVFP4 option"):
        Float4Tensor.from_hp(x, "mxfp4", four_over_six=True)


# ----------------------------------------------------------------- per-GEMM formats


def test_per_gemm_formats_mxfp8_forward_nvfp4_grad_input_hp_weight_grad():
    nv = CastConfig(FP4_CAST_DTYPE, NVFP4_1x16)
    mx8 = CastConfig(torch.float8_e4m3fn, MX_1x32)
    cfg = Float8LinearConfig(
        input=mx8,
        weight=mx8,
        grad_output=nv,
        gemm_overrides={("grad_input", "weight"): nv, ("grad_weight", "grad_output"): None},
    )
    assert cfg.cast_for("forward", "weight") == mx8 and cfg.cast_for("grad_input", "weight") == nv
    assert cfg.cast_for("grad_weight", "grad_output") is None
    ref, x = _pair()
    layer = Float8Linear.from_float(nn.Linear(128, 96), cfg)
    layer.load_state_dict(ref.state_dict())
    y, gx, gw = _run(layer, x)
    x2 = x.reshape(-1, 128)
    y_mx = (
        f8tensor.Float8Tensor.from_hp(x2, granularity=MX_1x32)
        @ f8tensor.Float8Tensor.from_hp(ref.weight, granularity=MX_1x32).t()
    )
    assert torch.equal(y.reshape(-1, 96), y_mx + ref.bias)
    # grad_weight in high precision: exactly grad_y.t() @ x.
    gy = 2 * y.detach().reshape(-1, 96)
    assert torch.allclose(gw, gy.t() @ x2, rtol=1e-5, atol=1e-4)
    _, gx_ref, _ = _run(ref, x)
    assert sqnr(gx_ref, gx) >= 14.0
    with pytest.raises(ValueError, match="unknown GEMM"):
        Float8LinearConfig(gemm_overrides={("backward", "input"): None})
    with pytest.raises(ValueError, match="multiplies grad_output and weight"):
        Float8LinearConfig(gemm_overrides={("grad_input", "input"): None})


def test_switch_forward_to_high_precision_mid_training_keeps_parameters_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("nvfp4"))
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert set_forward_in_high_precision(model) == 2
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert opt.param_groups[0]["params"][0] is params[0]
    # The forward is now exactly high precision; the backward GEMMs keep NVFP4.
    assert torch.equal(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))
    assert model[0].config.cast_for("grad_input", "grad_output").fp4
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    assert all(p.grad is not None for p in params)


# ----------------------------------------------------------------- layer policy


class _Blocks(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(n))
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_keep_last_blocks_in_hp_filter():
    model = _Blocks()
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("nvfp4"), module_filter_fn=keep_last_blocks_in_hp(model, 2)
    )
    kinds = [isinstance(model.layers[i][0], Float8Linear) for i in range(6)]
    assert kinds == [True, True, True, True, False, False]
    assert isinstance(model.embed, Float8Linear) and isinstance(model.head, Float8Linear)


def test_block_policy_fp8_edges_fp4_body_hp_tail():
    model = _Blocks()
    nv, fp8 = Float8LinearConfig.from_recipe("nvfp4"), Float8LinearConfig.from_recipe("mxfp8")
    convert_with_policy(model, block_policy(model, nv, hp_last_blocks=1, edge_config=fp8))
    assert model.embed.config == fp8 and model.head.config == fp8
    assert all(model.layers[i][0].config == nv for i in range(5))
    assert not isinstance(model.layers[5][0], Float8Linear)
    model(torch.randn(8, 32)).sum().backward()


# ----------------------------------------------------------------- telemetry


def test_fp4_telemetry_counts_saturation_and_flush():
    layer = Float8Linear.from_float(nn.Linear(64, 32), Float8LinearConfig.from_recipe("nvfp4", collect_stats=True))
    x = torch.randn(16, 64)
    x[0, :16] = torch.tensor([1000.0] + [1e-3] * 15)  # one block: 15 values flushed next to an outlier
    layer(x).sum().backward()
    stats = f8tensor.float8_stats(layer)
    assert stats["input/underflow_count"] >= 15 and stats["input/saturated_count"] == 0
    assert stats["input/amax"] == 1000.0
    assert stats["grad_output/underflow_count"] >= 0 and "weight/saturated_frac" in stats
    # Saturation: an MXFP4 cast with the OCP floor rule clips the top of a block.
    *_, st = cast_fp4(torch.full((2, 32), 7.5), FP4Spec("mxfp4", (1, 32), scale_mode="floor"), stats=True)
    assert st[0].item() == 64


def test_mxfp4_block_granularity_public_constant():
    assert MXFP4_1x32.block == (1, 32) and MXFP4_1x32.scale_dtype == torch.float8_e8m0fnu
