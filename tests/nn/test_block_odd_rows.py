"""Block-scaled products whose 1x128-scaled operand has a row count that is no multiple of 16.

cuBLASLt refused the 1x128 x 128x128 kernel for M=15 (H100, torch 2.11+cu130: a 15-token
``blockwise`` Linear, CUBLAS_STATUS_NOT_SUPPORTED). The rule rows ask for the outer dim of
every 1x128-scaled operand to be a multiple of 16 (``align_m``; N of a 1x128 b: ``align_n``),
the rules check records a call that breaks it, and the block-scaled product pads those rows
with zeros (scale 1) for every GEMM of a layer (output, grad_input: M = tokens; grad_weight:
M = out_features), on CPU as on CUDA, with the bits of the unpadded product.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from f8tensor import (
    BLOCK_1x128,
    BlockGranularity,
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    GemmConfig,
    gemm,
    sqnr,
)
from f8tensor.gemm import blocks
from f8tensor.gemm.check import record_block_reference
from f8tensor.gemm.rules import BLOCK_SCALED_MM_RULES
from f8tensor.gemm.violations import block_scaled_mm_violations
from f8tensor.tensor import dequantize

E4M3 = torch.float8_e4m3fn
DEEPSEEK = [r for r in BLOCK_SCALED_MM_RULES if r.recipe_a in ("BlockWise1x128", "BlockWise128x128")]
ROWS_1x128_A = [r for r in DEEPSEEK if r.block_a == (1, 128)]
TILE = CastConfig(E4M3, BLOCK_1x128)
# The layer configs whose GEMMs take a 1x128 a: the named recipe (1x128 x 128x128 for output
# and grad_input, 1x128 x 1x128 for grad_weight) and 1x128 tiles for every role (1x128 x
# 1x128 in all three GEMMs).
CONFIGS = {
    "blockwise": lambda **kw: Float8LinearConfig.from_recipe("blockwise", **kw),
    "1x128 tiles": lambda **kw: Float8LinearConfig(input=TILE, weight=TILE, grad_output=TILE, **kw),
}


def _operands(rule, m: int, k: int, n: int, seed: int = 0) -> tuple[Float8Tensor, Float8Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)  # a range per K-block
    b = torch.randn(k, n, generator=gen)
    a8 = Float8Tensor.from_hp(a, granularity=BlockGranularity(rule.block_a))
    b8 = Float8Tensor.from_hp(b, granularity=BlockGranularity(rule.block_b))
    return a8, b8


# ----------------------------------------------------------------------------- the rule


def test_rows_state_the_outer_dim_rule_as_measured():
    # The outer dim of each 1x128 operand: M of a 1x128 a (align_m), N of a 1x128 b (align_n).
    for rule in DEEPSEEK:
        if rule.block_a == (1, 128):
            assert rule.align_m == 16, rule.name
        if rule.block_b == (128, 1):
            assert rule.align_n == 16, rule.name
        assert any("M=15 with a 1x128 a refused" in s for s in rule.sources), rule.name
    assert [r.align_m for r in DEEPSEEK] == [16, 16, 1]  # 128x128 a: M free in eager calls


@pytest.mark.parametrize("rule", ROWS_1x128_A, ids=lambda r: r.name)
@pytest.mark.parametrize("m", [15, 17])
def test_rules_check_records_an_unpadded_odd_row_count(rule, m):
    a8, b8 = _operands(rule, m, 256, 32)
    unpadded = blocks._kernel_args(rule, a8, b8)
    assert block_scaled_mm_violations(*unpadded, rule) == [
        f"block-scaled {rule.name}: M={m} is not a multiple of 16 (mat_a (M, K), mat_b (K, N))"
    ]
    with gemm.rules_check(raise_on_violation=False) as check:
        check.take()
        record_block_reference(rule.name, *unpadded)
        assert [f"M={m} is not a multiple of 16" in v for v in check.take()] == [True]
        # The product itself sends (and, on CPU, checks) the padded call: nothing recorded.
        calls = check.calls
        blocks.product(a8, b8, None, torch.bfloat16, GemmConfig())
        assert check.calls == calls + 1
        assert check.take() == []


@pytest.mark.parametrize("rule", DEEPSEEK, ids=lambda r: r.name)
def test_the_row_count_is_padded_whatever_the_config_says(rule):
    a8, b8 = _operands(rule, 15, 256, 32)
    expected = (1, 0, 0) if rule.block_a == (1, 128) else (0, 0, 0)
    for config in (GemmConfig(), GemmConfig(pad_inner_dim=True)):
        assert blocks._padding(rule, a8, b8, config, traced=False) == expected


@pytest.mark.parametrize("rule", ROWS_1x128_A, ids=lambda r: r.name)
def test_padded_operand_is_the_operand_and_zero_rows(rule):
    a8, b8 = _operands(rule, 15, 256, 32)
    padded, rest = blocks._outer_rows_padded(rule, a8, (1, 0, 0))
    assert rest == (0, 0, 0) and padded.shape == (16, 256)
    values = dequantize(padded, torch.float32)
    assert torch.equal(values[:15], dequantize(a8, torch.float32))
    assert torch.equal(values[15:], torch.zeros(1, 256))
    assert torch.equal(padded._scale[15:], torch.ones(1, 2))
    args = blocks._kernel_args(rule, padded, b8, rest)
    assert block_scaled_mm_violations(*args, rule) == []
    sa = args[2]
    assert (tuple(sa.shape), sa.stride()) == ((16, 2), (1, 16))  # a 64-byte leading dim
    assert torch.equal(sa[:15], blocks._block_kernel_scales(rule, a8, b8)[0])
    assert torch.equal(sa[15:], torch.ones(1, 2))


@pytest.mark.parametrize("rule", ROWS_1x128_A, ids=lambda r: r.name)
@pytest.mark.parametrize("m", [1, 15, 17, 33])
def test_padded_product_has_the_bits_of_the_unpadded_one(rule, m):
    a8, b8 = _operands(rule, m, 256, 32, seed=m)
    bias = torch.randn(32, dtype=torch.bfloat16)
    out = blocks.product(a8, b8, bias, torch.bfloat16, GemmConfig())
    emulated = blocks.product(a8, b8, bias, torch.bfloat16, GemmConfig(emulate=True))  # no kernel, no padding
    assert out.shape == (m, 32)
    assert torch.equal(out, emulated)


# ----------------------------------------------------------------------------- a layer


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad_out)
    return y, x.grad, layer.weight.grad, layer.bias.grad


# Measured (seed 0, this file's shapes), per config / tokens / out_features: output,
# grad_input, grad_weight SQNR in dB vs the bf16 Linear (thresholds: the lowest, rounded down):
#   blockwise    15/32: 31.1 28.9 29.8   15/40: 31.1 27.8 30.4   17/32: 30.9 28.8 29.8   17/40: 31.1 28.8 29.8
#   1x128 tiles  15/32: 31.4 29.6 29.8   15/40: 31.8 28.9 30.4   17/32: 31.4 29.5 29.8   17/40: 31.9 29.5 29.8
OUTPUT_MIN_DB, GRAD_INPUT_MIN_DB, GRAD_WEIGHT_MIN_DB = 30.0, 27.0, 29.0


@pytest.mark.parametrize("out_features", [32, 40], ids=["out32", "out40-padded"])
@pytest.mark.parametrize("tokens", [15, 17])
@pytest.mark.parametrize("config", list(CONFIGS), ids=lambda c: c.replace(" ", "-"))
def test_linear_with_odd_token_counts(config, tokens, out_features, monkeypatch):
    # out_features=40 (pad_inner_dim): grad_weight's M, 40, is padded to 48 as well.
    pad_inner = out_features % 16 != 0
    gen = torch.Generator().manual_seed(0)
    ref = nn.Linear(64, out_features, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_features, 64, generator=gen) / 8)
        ref.bias.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(1, tokens, 64, generator=gen).to(torch.bfloat16)
    grad_out = torch.randn(1, tokens, out_features, generator=gen).to(torch.bfloat16)

    sent: list[tuple[str, int]] = []

    def spy(rule_name, mat_a, *args):
        sent.append((rule_name, mat_a.shape[0]))
        return record_block_reference(rule_name, mat_a, *args)

    monkeypatch.setattr(blocks, "record_block_reference", spy)
    layer = Float8Linear.from_float(copy.deepcopy(ref), CONFIGS[config](pad_inner_dim=pad_inner))
    with gemm.rules_check(raise_on_violation=False) as check:
        check.take()
        got = _fwd_bwd(layer, x, grad_out)
        assert check.take() == []
    # Three GEMMs, each sent with a row count padded to 16: tokens (output, grad_input) and
    # out_features (grad_weight).
    padded_tokens, padded_out = -(-tokens // 16) * 16, -(-out_features // 16) * 16
    assert sorted(m for _, m in sent) == sorted([padded_tokens, padded_tokens, padded_out]), sent

    want = _fwd_bwd(copy.deepcopy(ref), x, grad_out)
    what = f"{config}, {tokens} tokens, out {out_features}"
    for name, i, min_db in (
        ("output", 0, OUTPUT_MIN_DB),
        ("grad_input", 1, GRAD_INPUT_MIN_DB),
        ("grad_weight", 2, GRAD_WEIGHT_MIN_DB),
    ):
        db = sqnr(want[i].detach(), got[i].detach())
        assert db >= min_db, f"{what} {name}: SQNR {db:.2f} dB is below {min_db} dB"
    assert torch.equal(got[3], want[3])  # grad_bias: a sum of grad_output in high precision

    # The emulated product (no kernel, no padding) gives the same bits.
    emulated = _fwd_bwd(
        Float8Linear.from_float(copy.deepcopy(ref), CONFIGS[config](pad_inner_dim=pad_inner, emulate=True)), x, grad_out
    )
    for name, a, b in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, emulated):
        assert torch.equal(a, b), f"{what} {name}"
