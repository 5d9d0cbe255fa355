"""FP4 (NVFP4, MXFP4) at the edges: values near the dtype's max, empty batches, the Hadamard
seed's range and effect, and the arguments of ``Float4Tensor.from_hp``. CPU, reference path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from f8tensor import (
    FP4_CAST_DTYPE,
    CastConfig,
    DelayedScalingConfig,
    Float4Tensor,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    MX_1x32,
    NVFP4_1x16,
    convert_to_float8_training,
)
from f8tensor.compat import scaled_mm
from f8tensor.quant.hadamard import apply_rht, rht_signs


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(10 * torch.log10(ref.square().sum() / (ref - approx).square().sum()))


# ----------------------------------------------------------------- near the dtype's max

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _near_max(dtype: torch.dtype) -> torch.Tensor:
    """2 x 64 in ``dtype``: row 0 has in every 16- and 32-block one value within a quarter
    binade of the dtype's max (fp16 60000; bf16/fp32 max and 0.9 max, both signs), which
    E2M1's one mantissa bit rounds up to the next power of two; row 1 is ordinary."""
    top = torch.finfo(dtype).max
    big = (
        torch.tensor([60000.0, -65504.0, 61000.0, -59000.0])
        if dtype == torch.float16
        else (torch.tensor([1.0, -1.0, 0.9, -0.95], dtype=torch.float64) * top)
    )
    x = torch.linspace(-1.0, 1.0, 128, dtype=torch.float64).reshape(2, 64) * 1000.0
    x[0, ::16] = big.to(torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_to_hp_near_max_stays_finite(kind, dtype):
    x = _near_max(dtype)
    back = Float4Tensor.from_hp(x, kind).to_hp()
    assert back.dtype == dtype
    assert torch.isfinite(back).all(), back[~torch.isfinite(back)]
    # The block tops come back rounded or saturated to max (never past it), sign kept.
    top = back[0, ::16].double()
    assert torch.equal(top.sign(), x[0, ::16].double().sign())
    assert (top.abs() <= torch.finfo(dtype).max).all()
    if kind == "mxfp4":
        # E.g. fp16 60000 = 3.66 * 2**14 rounds to 4 * 2**14 = 65536: saturated to 65504.
        assert top.abs().max() == torch.finfo(dtype).max
    # Measured: mxfp4 21.3 (fp16) / 24.8 (bf16) / 24.7 (fp32) dB; nvfp4 28.0 / 35.1 / 34.6 dB.
    assert sqnr(x, back) >= (20.0 if kind == "mxfp4" else 26.0)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_to_hp_keeps_inf_and_nan_non_finite_beside_near_max_blocks(kind, dtype):
    x = _near_max(dtype)
    x[1, 0], x[1, 40] = float("inf"), float("nan")
    back = Float4Tensor.from_hp(x, kind).to_hp()
    block = 16 if kind == "nvfp4" else 32
    bad = torch.zeros_like(x, dtype=torch.bool)
    bad[1, :block] = True  # the inf's block
    bad[1, (40 // block) * block : (40 // block + 1) * block] = True  # the NaN's block
    assert torch.isnan(back[bad]).all()  # the blocks that held inf / NaN: NaN, never finite
    assert torch.isfinite(back[~bad]).all()  # the near-max blocks beside them stay finite


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", MX_1x32], ids=["tensorwise", "rowwise", "mx"])
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_fp8_to_hp_near_max_stays_finite(granularity, dtype):
    """The same class in FP8 (e4m3: 3 mantissa bits, a value within 1/16 binade of max
    rounds up): to_hp saturates there too."""
    x = _near_max(dtype)
    back = Float8Tensor.from_hp(x, granularity=granularity).to_hp()
    assert torch.isfinite(back).all()
    assert sqnr(x, back) >= 33.0  # measured 34.6-37.8 dB


# ----------------------------------------------------------------- empty batches

_FP4_CONFIGS = {
    "nvfp4": Float8LinearConfig.from_recipe("nvfp4"),
    "nvfp4_four_over_six": Float8LinearConfig.from_recipe("nvfp4", four_over_six=True),
    "mxfp4": Float8LinearConfig.from_recipe("mxfp4"),
    # FP4 in the weight-gradient GEMM only, with the Hadamard transform, MXFP8 elsewhere.
    "mxfp8_nvfp4_wgrad": Float8LinearConfig.from_recipe("mxfp8").with_gemm_formats(
        {
            ("grad_weight", "grad_output"): CastConfig(FP4_CAST_DTYPE, NVFP4_1x16),
            ("grad_weight", "input"): CastConfig(FP4_CAST_DTYPE, NVFP4_1x16),
        },
        hadamard_wgrad=True,
    ),
}


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64)], ids=["0xK", "Bx0xK"])
@pytest.mark.parametrize("name", sorted(_FP4_CONFIGS))
def test_empty_batch_forward_and_backward(name, shape):
    torch.manual_seed(0)
    model = convert_to_float8_training(nn.Sequential(nn.Linear(64, 32)), config=_FP4_CONFIGS[name])
    # Dirty the allocator so that an uninitialized gradient would show as non-zero.
    junk = torch.full((64, 64), float("nan"))
    del junk
    x = torch.randn(shape, requires_grad=True)
    y = model(x)
    assert y.shape == (*shape[:-1], 32)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    layer = model[0]
    assert torch.equal(layer.weight.grad, torch.zeros(32, 64))  # no tokens: exactly zero
    assert torch.equal(layer.bias.grad, torch.zeros(32))


@pytest.mark.parametrize("shape,dim", [((0, 8), 0), ((16, 0), 0), ((0, 32), 1), ((2, 0, 16), -1)])
def test_rht_of_an_empty_tensor(shape, dim):
    out = apply_rht(torch.empty(shape), seed=0, dim=dim)
    assert out.shape == shape and out.dtype == torch.float32


def test_fp8_rowwise_empty_batch_weight_gradient_is_zero():
    """The same class in FP8: an empty batch's weight-gradient product contracts over K = 0,
    and torch's CPU kernel left its output uninitialized (garbage or NaN weight gradients
    in the rowwise recipe)."""
    for _ in range(5):
        model = convert_to_float8_training(
            nn.Sequential(nn.Linear(64, 32)), config=Float8LinearConfig.from_recipe("rowwise")
        )
        junk = torch.full((64, 64), float("nan"))
        del junk
        model(torch.randn(0, 64, requires_grad=True)).sum().backward()
        assert torch.equal(model[0].weight.grad, torch.zeros(32, 64))


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_scaled_mm_with_k_zero_is_zeros_plus_bias(rowwise):
    a = torch.zeros(32, 0, dtype=torch.float8_e4m3fn)
    b = torch.zeros(48, 0, dtype=torch.float8_e4m3fn).t()
    sa, sb = (torch.ones(32, 1), torch.ones(1, 48)) if rowwise else (torch.ones(()), torch.ones(()))
    bias = torch.arange(48, dtype=torch.bfloat16)
    for _ in range(5):
        junk = torch.full((32, 48), float("nan"))
        del junk
        assert torch.equal(scaled_mm(a, b, sa, sb, out_dtype=torch.float32), torch.zeros(32, 48))
        out = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
        assert torch.equal(out, bias.expand(32, 48))


# ----------------------------------------------------------------- hadamard_seed: range


@pytest.mark.parametrize("seed", [2**64, 2**70, -1, -(2**63)])
def test_hadamard_seed_out_of_range_is_refused_at_config_time(seed):
    with pytest.raises(ValueError, match=r"hadamard_seed must be in \[0, 2\*\*64 - 1\].*got"):
        Float8LinearConfig.from_recipe("nvfp4", hadamard_seed=seed)


@pytest.mark.parametrize("seed", [True, 1.0, "0", None])
def test_hadamard_seed_of_the_wrong_type_is_refused(seed):
    with pytest.raises(TypeError, match=r"Float8LinearConfig.hadamard_seed must be an int"):
        Float8LinearConfig.from_recipe("nvfp4", hadamard_seed=seed)


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_hadamard_seed_at_the_ends_of_its_range_trains(seed):
    config = Float8LinearConfig.from_recipe("nvfp4", hadamard_seed=seed)
    layer = Float8Linear.from_float(nn.Linear(64, 32), config)
    layer(torch.randn(32, 64)).sum().backward()
    assert torch.isfinite(layer.weight.grad).all()


def test_apply_rht_names_a_bad_seed():
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64 - 1\]"):
        apply_rht(torch.randn(16, 4), 2**64)


@pytest.mark.parametrize(
    "field,value",
    [
        ("history_len", True),
        ("history_len", -1),
        ("history_len", 2**64),
        ("history_len", 4.0),
        ("margin", True),
        ("margin", -1),
        ("margin", 2**64),
        ("margin", 1.0),
    ],
)
def test_neighbouring_int_fields_refuse_bool_negative_and_too_large(field, value):
    with pytest.raises(ValueError, match=rf"DelayedScalingConfig.{field} must be"):
        DelayedScalingConfig(**{field: value})


# ----------------------------------------------------------------- hadamard_seed: effect


def _rotation_from_definition(seed: int) -> torch.Tensor:
    """``H D`` from the definition: Sylvester H / 4, signs ``2 b - 1`` with ``b`` 16 draws of
    ``randint(0, 2)`` from ``torch.Generator().manual_seed(seed)``; float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    bits = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(seed))
    return h / 4 * (2.0 * bits.double() - 1.0)


def _reference_wgrad(g: torch.Tensor, x: torch.Tensor, seed: int) -> torch.Tensor:
    """``grad_W`` as the nvfp4 recipe defines it: both operands rotated per 16 tokens, cast
    to NVFP4 along the tokens (16x1 blocks, nearest), dequantized, multiplied in float64."""
    q = _rotation_from_definition(seed)

    def cast(t):
        rotated = (q @ t.double().reshape(-1, 16, t.shape[1])).reshape(t.shape).float()
        return Float4Tensor.from_hp(rotated, "nvfp4", block=(16, 1), pack_dim=0).dequantize(torch.float32).double()

    return cast(g).t() @ cast(x)


_SEEDS = (0, 1, 12345, 2**64 - 1)


def test_rht_signs_follow_the_seed():
    for seed in _SEEDS:
        want = tuple(_rotation_from_definition(seed)[0].sign().tolist())  # H's first row is all +1
        assert rht_signs(seed) == want
    assert len({rht_signs(s) for s in _SEEDS}) == len(_SEEDS)


def test_layer_weight_gradient_follows_hadamard_seed():
    """The layer's ``grad_W`` matches the reference rotated with its own seed (fp32 round-off
    only) and not the others' (FP4 noise): a layer that ignored the seed would match seed 0's."""
    config = Float8LinearConfig.from_recipe("nvfp4", grad_output=CastConfig(FP4_CAST_DTYPE, NVFP4_1x16))
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(64, 64, generator=gen), torch.randn(64, 32, generator=gen)
    x[3::16] *= 30  # a large token per 16-block in both: the rotation decides the block scales
    g[3::16] *= 30
    base = nn.Linear(64, 32)
    refs = {s: _reference_wgrad(g, x, s) for s in _SEEDS}
    grads = {}
    for seed in _SEEDS:
        layer = Float8Linear.from_float(nn.Linear(64, 32), dataclasses.replace(config, hadamard_seed=seed))
        layer.load_state_dict(base.state_dict())
        layer(x).backward(g)
        grads[seed] = layer.weight.grad
        for other, ref in refs.items():
            db = sqnr(ref, grads[seed])
            if other == seed:
                assert db >= 100.0, (seed, db)  # measured 129.8-133.4 dB
            else:
                assert db <= 40.0, (seed, other, db)  # measured 23.1-25.9 dB
    # The same seed reproduces bit for bit.
    again = Float8Linear.from_float(nn.Linear(64, 32), dataclasses.replace(config, hadamard_seed=12345))
    again.load_state_dict(base.state_dict())
    again(x).backward(g)
    assert torch.equal(again.weight.grad, grads[12345])


# ----------------------------------------------------------------- from_hp arguments


@pytest.mark.parametrize("pack_dim", [2, -3, 5, True, 1.0, None])
def test_from_hp_refuses_pack_dim_out_of_range(pack_dim):
    with pytest.raises(ValueError, match=r"pack_dim must be an int in \[-2, 1\]"):
        Float4Tensor.from_hp(torch.randn(4, 32), pack_dim=pack_dim)


@pytest.mark.parametrize("block", [(1, 16.0), (1, True), (16,), (1, 1, 16), 16, (1, -16), "1x16"])
def test_from_hp_refuses_malformed_block(block):
    with pytest.raises(ValueError, match=r"block must be a tuple of 2 ints >= 0"):
        Float4Tensor.from_hp(torch.randn(4, 32), block=block)


def test_from_hp_refuses_a_block_that_does_not_tile():
    with pytest.raises(ValueError, match=r"block \(1, 12\) must tile the input exactly"):
        Float4Tensor.from_hp(torch.randn(4, 32), block=(1, 12))


def test_from_hp_refuses_an_odd_packed_dim():
    with pytest.raises(ValueError, match=r"pack_dim=0: its size must be even"):
        Float4Tensor.from_hp(torch.randn(3, 32), block=(1, 16), pack_dim=0)


def test_from_hp_refuses_a_non_bool_four_over_six_and_a_non_generator():
    with pytest.raises(TypeError, match=r"four_over_six must be a bool"):
        Float4Tensor.from_hp(torch.randn(4, 32), four_over_six=1)
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator"):
        Float4Tensor.from_hp(torch.randn(4, 32), generator=0)
    with pytest.raises(ValueError, match=r"with rounding='nearest' it has no effect"):
        Float4Tensor.from_hp(torch.randn(4, 32), generator=torch.Generator())


def test_to_hp_refuses_a_non_high_precision_dtype():
    with pytest.raises(TypeError, match=r"to_hp dtype must have a high-precision floating dtype"):
        Float4Tensor.from_hp(torch.randn(4, 32)).to_hp(torch.float64)


def test_from_hp_accepts_lists_negative_pack_dim_and_whole_dim_blocks():
    x = torch.randn(4, 32)
    a = Float4Tensor.from_hp(x, block=[1, 16], pack_dim=-1)
    b = Float4Tensor.from_hp(x, block=(1, 16), pack_dim=1)
    assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8)) and a._block == (1, 16)
    whole = Float4Tensor.from_hp(x, "mxfp4", block=(1, 0))
    assert whole._scale.shape == (4, 1)
    empty = Float4Tensor.from_hp(torch.empty(0, 32), block=(0, 16))
    assert empty.to_hp().shape == (0, 32)
