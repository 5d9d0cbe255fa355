"""Stochastic rounding, the block recipes' extras (checkpoints, telemetry, compile frames)
and training parity of a small transformer against bf16.

The recipe-parametrized tests in modules/test_linear.py, modules/test_linear_compile.py, modules/test_saved_for_backward.py,
recipes/test_training_vs_bf16.py and clients/test_client_hf_llama.py run ``blockwise`` and ``mxfp8`` as well (autocast,
activation checkpointing, torch.compile fullgraph forward+backward, state_dict round trips).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
import torch.nn.functional as F

from f8tensor import (
    BLOCK_1x128,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    MX_1x32,
    compat,
    convert_to_float8_training,
    float8_stats,
    sqnr,
)
from tests.helpers import assert_bitwise_equal_f8

from linear_utils import RECIPE_NAMES, fp8_copy

E4M3 = torch.float8_e4m3fn

# ----------------------------------------------------------------------------- stochastic rounding


def _e4m3_spacing(x: torch.Tensor) -> torch.Tensor:
    """The e4m3fn grid spacing at |x| (subnormal spacing 2**-9 below 2**-6)."""
    e = torch.floor(torch.log2(x.abs())).clamp(min=-6)
    return 2.0 ** (e - 3)


def test_stochastic_rounding_is_unbiased():
    # 500 values across e4m3's range (subnormals to 400), 4000 independent roundings each.
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(500).uniform_(-11, 8.6, generator=g)) * torch.where(
        torch.rand(500, generator=g) < 0.5, -1, 1
    )
    n = 4000
    reps = x.expand(n, -1).contiguous()
    f8 = Float8Tensor.from_hp(reps, scale=1.0, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    mean = f8.to_hp().double().mean(0)
    # Each rounding errs by at most one spacing with std <= spacing / 2: the mean of n has
    # std <= spacing / (2 sqrt(n)). Tolerance: 6 such standard deviations per value.
    tol = 6 * _e4m3_spacing(x).double() / (2 * math.sqrt(n))
    assert ((mean - x.double()).abs() <= tol).all(), float(((mean - x.double()).abs() / tol).max())
    # Round-to-nearest is biased on the same values (it always returns the same neighbour).
    nearest = Float8Tensor.from_hp(x, scale=1.0).to_hp().double()
    assert ((nearest - x.double()).abs() > tol).float().mean() > 0.5


def test_stochastic_rounding_reproducible_under_a_seed():
    x = torch.randn(64, 256)

    def cast(seed, gran):
        return Float8Tensor.from_hp(
            x, granularity=gran, rounding="stochastic", generator=torch.Generator().manual_seed(seed)
        )

    for gran in ("tensorwise", "rowwise", BLOCK_1x128, MX_1x32):
        assert_bitwise_equal_f8(cast(3, gran), cast(3, gran))
        assert not torch.equal(cast(3, gran)._data.view(torch.uint8), cast(4, gran)._data.view(torch.uint8))


def test_stochastic_rounding_bad_mode_raises():
    with pytest.raises(ValueError, match=r"rounding must be one of \('nearest', 'stochastic'\); got 'up'"):
        Float8Tensor.from_hp(torch.randn(4, 4), rounding="up")
    with pytest.raises(ValueError, match=r"CastConfig.rounding must be one of"):
        dataclasses.replace(Float8LinearConfig().grad_output, rounding="down")


def _sr_grad_output(recipe: str) -> Float8LinearConfig:
    cfg = Float8LinearConfig.from_recipe(recipe)
    return dataclasses.replace(cfg, grad_output=dataclasses.replace(cfg.grad_output, rounding="stochastic"))


@pytest.mark.device_param
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_stochastic_grad_output_in_every_recipe(recipe):
    ref = torch.nn.Linear(128, 64)
    fresh = Float8Linear.from_float(copy.deepcopy(ref), _sr_grad_output(recipe))
    x = torch.randn(4, 32, 128)
    grad_out = torch.randn(4, 32, 64)

    def grads(seed):
        # A fresh copy per run: a delayed layer's histories (and so its scales) move with
        # every backward, and reproducibility is about the random draws, not that state.
        layer = copy.deepcopy(fresh)
        torch.manual_seed(seed)
        xi = x.clone().requires_grad_()
        layer(xi).backward(grad_out)
        return xi.grad, layer.weight.grad.clone()

    gx, gw = grads(0)
    gx2, gw2 = grads(0)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2)  # reproducible under torch.manual_seed
    xr = x.clone().requires_grad_()
    ref(xr).backward(grad_out)
    assert sqnr(xr.grad, gx) >= 20.0 and sqnr(ref.weight.grad, gw) >= 20.0


# ----------------------------------------------------------------------------- checkpoints, telemetry


@pytest.mark.device_param
@pytest.mark.parametrize("gran", [BLOCK_1x128, MX_1x32], ids=["1x128", "mx"])
def test_block_float8tensor_save_load_weights_only(gran):
    x8 = Float8Tensor.from_hp(torch.randn(8, 300, dtype=torch.bfloat16), granularity=gran)
    buf = io.BytesIO()
    torch.save({"w": x8}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["w"]
    assert_bitwise_equal_f8(back, x8)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipe_telemetry_counts_per_cast(recipe):
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe, collect_stats=True))
    x = torch.randn(16, 128)
    x[0, :32] = 1e-12  # flushed to zero in their 1x32 / 1x128 blocks: a large value shares them
    x[0, 0] = 100.0
    model(x).sum().backward()
    stats = float8_stats(model)
    for role in ("input", "weight", "grad_output"):
        assert stats[f"0/{role}/saturated_count"] == 0, (role, stats)
        assert math.isfinite(stats[f"0/{role}/amax"]) and stats[f"0/{role}/amax"] > 0, (role, stats)
    # The 31 tiny values of row 0's first block: 1e-12 * (448 / 100) is far below e4m3's
    # smallest subnormal. Every other block of row 0 and every other row keeps its own scale.
    assert stats["0/input/underflow_count"] == 31


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipe_compiles_to_one_frame(recipe):
    import torch._dynamo.testing

    model = fp8_copy(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 128)), recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, 16, 128, requires_grad=True)
    compiled(x).sum().backward()
    compiled(torch.randn(2, 16, 128, requires_grad=True)).sum().backward()
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------- training parity

# The issue's bar: final held-out loss within 2% of bf16's. Measured (CPU, one thread):
# bf16 2.4844, blockwise 2.5161 (+1.3%), mxfp8 2.4564 (-1.1%); tensorwise, for comparison,
# is 3.6% above bf16 on the same setup at d_model 64.
PARITY_REL_TOL = 0.02


@pytest.fixture(scope="module")
def tiny_gpt_and_twin():
    from f8tensor.demo import GPT, Size, batch_starts, get_batch, load_corpus

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = Size(d_model=128, n_layers=1, n_heads=4, seq_len=32, batch_size=8, lr=3e-3)
    torch.manual_seed(0)
    data = load_corpus(torch.device("cpu"))
    steps = 150
    held_out = 4  # batches no run trains on: the final loss is their mean
    starts = batch_starts(len(data), steps + held_out, size.batch_size, size.seq_len, seed=0)
    model = GPT(size)

    def train(m: torch.nn.Module) -> float:
        opt = torch.optim.AdamW(m.parameters(), lr=size.lr)
        for i in range(steps):
            x, y = get_batch(data, starts[i], size.seq_len)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(x)
            F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses = []
        for i in range(steps, steps + held_out):
            x, y = get_batch(data, starts[i], size.seq_len)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(F.cross_entropy(m(x).float().flatten(0, 1), y.flatten()).item())
        return sum(losses) / held_out

    twin = train(copy.deepcopy(model))
    yield model, train, twin
    torch.set_num_threads(threads)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_tiny_transformer_trains_within_2_percent_of_bf16(recipe, tiny_gpt_and_twin):
    model, train, twin = tiny_gpt_and_twin
    fp8 = convert_to_float8_training(
        copy.deepcopy(model),
        config=Float8LinearConfig.from_recipe(recipe),
        module_filter_fn=lambda m, fqn: fqn != "lm_head",
    )
    assert sum(isinstance(m, Float8Linear) for m in fp8.modules()) == 4
    loss = train(fp8)
    assert twin < math.log(256) - 1.0, f"the bf16 twin did not learn ({twin:.3f})"
    assert abs(loss - twin) <= PARITY_REL_TOL * twin, f"{recipe}: {loss:.4f} vs bf16 {twin:.4f}"


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_stochastic_grad_output_compiles_with_dynamic_shapes(recipe):
    if compat.TORCH_VERSION < (2, 12) and recipe in ("mxfp8", "mxfp4"):
        # Measured: 2.11's dynamo asserts in overwrite_tensor_vt_proxy (autograd.Function)
        # for these block recipes with stochastic gradients; 2.12 and later trace them.
        pytest.skip("torch 2.11's dynamo asserts tracing this recipe's autograd.Function with dynamic shapes")
    # The uniform draw of a symbolic shape traces (a `rand` given generator=None did not).
    layer = Float8Linear.from_float(torch.nn.Linear(128, 64), _sr_grad_output(recipe))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (32, 48):
        x = torch.randn(tokens, 128, requires_grad=True)
        y = compiled(x)
        assert torch.equal(y, layer(x))  # forward has no random draw
        y.sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_stochastic_grad_output_compiles_fullgraph(recipe):
    import torch._dynamo.testing

    layer = Float8Linear.from_float(torch.nn.Linear(128, 64), _sr_grad_output(recipe))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x = torch.randn(32, 128, requires_grad=True)
    compiled(x).sum().backward()
    assert counter.frame_count == 1
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
