"""f8tensor.optim.AdamW: fp32 states bit-identical to torch's AdamW, bf16 and FP8 states
close to it, lean master weights for bf16 parameters, and a normal torch optimizer."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from f8tensor import convert_to_float8_training
from f8tensor.kernels import dequantize
from f8tensor.optim import FP8_BLOCK, NOISE_PERIOD, AdamW
from f8tensor.optim import draws as optim_draws
from f8tensor.optim.master import join_master, split_master

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _data(seed: int = 0, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(n, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    return x, torch.tanh(x @ teacher) + 0.1 * torch.randn(n, 4, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> float:
    x, y = _data(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return ((model(x) - y) ** 2).mean().item()


# ------------------------------------------------------------------ fp32: torch's bits


def test_fp32_states_bit_identical_to_torch_adamw_step_by_step():
    ours, ref = _mlp(), _mlp()
    kw = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    opt = AdamW(ours.parameters(), **kw)
    opt_ref = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    x, y = _data()
    for _ in range(5):  # bias correction differs every step; weight decay on every tensor
        for model, o in ((ours, opt), (ref, opt_ref)):
            o.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            o.step()
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert torch.equal(_bits(p), _bits(q))
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][key], opt_ref.state[q][key]), key


# ------------------------------------------------------------------ bf16 / FP8 states: closeness


@pytest.mark.parametrize(
    "state_dtype, max_rel",
    # Final loss after 150 steps (lr 1e-3) relative to fp32 states, seeds 0-2: measured
    # 0.9991 / 1.0005 / 0.9996 (bf16) and 0.9935 / 0.9870 / 1.0005 (FP8, stochastic rounding;
    # the 64x16, 64x64 and 4x64 weights have FP8 moments, the 1-D biases fp32). FP8 moments
    # rounded to nearest measure 0.9282 / 0.9023 / 0.9205: v cannot decay by beta2 within an
    # e4m3 spacing, and that fails the 0.02 below.
    [(torch.bfloat16, 0.005), (FP8, 0.02)],
)
def test_low_precision_states_close_to_fp32_states(state_dtype, max_rel):
    worst = 0.0
    for seed in range(3):
        ref = _train(_mlp(seed), AdamW(_mlp(seed).parameters()), 0, seed)  # loss at init, for the test's sanity
        model_ref = _mlp(seed)
        loss_ref = _train(model_ref, AdamW(model_ref.parameters(), lr=1e-3), 150, seed)
        model = _mlp(seed)
        loss = _train(model, AdamW(model.parameters(), lr=1e-3, state_dtype=state_dtype), 150, seed)
        assert loss_ref < 0.5 * ref  # it trained
        worst = max(worst, abs(loss / loss_ref - 1))
    assert worst <= max_rel, worst


def test_fp8_states_are_fp8_with_row_block_scales_and_small_or_1d_tensors_keep_fp32():
    big = nn.Parameter(torch.randn(4, 2, FP8_BLOCK // 2 + 3))  # rows of 134: blocks of 128 and 6
    small = nn.Parameter(torch.randn(2, FP8_BLOCK // 2 - 1))
    vector = nn.Parameter(torch.randn(4 * FP8_BLOCK))
    opt = AdamW([big, small, vector], state_dtype=FP8)
    (big.sum() + small.sum() + vector.sum()).backward()
    opt.step()
    s = opt.state[big]
    assert s["exp_avg"].dtype == FP8 and s["exp_avg_sq"].dtype == FP8
    assert s["exp_avg"].shape == big.shape
    assert s["exp_avg_scale"].shape == (4, 2) and s["exp_avg_sq_scale"].shape == (4, 2)
    for p in (small, vector):
        assert opt.state[p]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in opt.state[p]
    # A gradient of ones: m = 1 - 0.9 in every element, so every block stores e4m3's max
    # (byte 0x7E) with the scale 448 / m: one scale per 128 elements of each dim-0 row.
    m = torch.zeros(()).lerp(torch.ones(()), 1 - 0.9)
    assert (s["exp_avg"].view(torch.uint8) == 0x7E).all()
    assert torch.equal(s["exp_avg_scale"], torch.full((4, 2), (448 / m.double()).float().item()))


def _state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for k, v in state.items() if k not in ("step",))


@pytest.mark.parametrize(
    "state_dtype, target",
    # Measured: FP8 2.0625 bytes per parameter (1 + 1 + 8 / 128), bf16 4.0.
    [(FP8, 2.2), (torch.bfloat16, 4.1), (torch.float32, 8.0)],
)
def test_state_bytes_per_parameter(state_dtype, target):
    p = nn.Parameter(torch.zeros(512, 1024))
    opt = AdamW([p], state_dtype=state_dtype)
    p.grad = torch.ones_like(p)
    opt.step()
    per_param = _state_bytes(opt.state[p]) / p.numel()
    assert per_param <= target, per_param
    if state_dtype == FP8:
        assert per_param == 2 + 8 / FP8_BLOCK


# ------------------------------------------------------------------ master weights


def _grads(steps: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(steps)]


def test_remainder_master_weights_follow_the_fp32_trajectory_exactly():
    torch.manual_seed(0)
    start = torch.randn(64, 64).to(torch.bfloat16)  # a bf16 model: its fp32 master starts equal
    ref = nn.Parameter(start.float())
    p = nn.Parameter(start.clone())
    kw = {"lr": 1e-3, "weight_decay": 0.1}
    opt_ref = torch.optim.AdamW([ref], foreach=False, **kw)
    opt = AdamW([p], master_weights="remainder", **kw)
    for g in _grads(20, (64, 64)):
        ref.grad, p.grad = g.float(), g
        opt_ref.step()
        opt.step()
        master = join_master(p.detach(), opt.state[p]["master_remainder"])
        assert torch.equal(_bits(master), _bits(ref))
        assert torch.equal(_bits(p), _bits(split_master(ref.detach())[0]))
        # The bf16 parameter is the master rounded to nearest (ties away from zero: at most half an ulp).
        assert ((p.detach().float() - ref.detach()).abs() <= ref.detach().abs() * 2.0**-8).all()
    # 20 steps of 1e-3 are below a bf16 ulp for most entries: plain rounding loses them.
    plain = nn.Parameter(start.clone())
    opt_plain = AdamW([plain], **kw)
    for g in _grads(20, (64, 64)):
        plain.grad = g
        opt_plain.step()
    err_plain = (plain.detach().float() - ref.detach()).abs().mean()
    err_rem = (p.detach().float() - ref.detach()).abs().mean()
    assert err_rem < err_plain, (err_rem, err_plain)


def test_stochastic_master_weights_are_unbiased_where_nearest_stalls():
    torch.manual_seed(0)
    start = torch.ones(4096, dtype=torch.bfloat16)
    results = {}
    for mode in (None, "stochastic"):
        p = nn.Parameter(start.clone())
        opt = AdamW([p], lr=1e-4, weight_decay=0.0, master_weights=mode)
        for _ in range(30):
            p.grad = torch.ones_like(p)
            opt.step()
        results[mode] = p.detach().float().mean().item()
    exact = 1 - 30 * 1e-4  # each step moves by lr (m / sqrt(v) = 1)
    assert results[None] == 1.0  # 1e-4 is below half a bf16 ulp at 1.0: round to nearest stalls
    # Measured 0.99700 (exact 0.99700); bf16 ulp below 1.0 is 0.0039.
    assert abs(results["stochastic"] - exact) < 3e-4, results


# ------------------------------------------------------------------ a normal torch optimizer


@pytest.mark.parametrize(
    "state_dtype, master",
    [(torch.float32, None), (torch.bfloat16, None), (FP8, None), (FP8, "remainder"), (FP8, "stochastic")],
)
def test_state_dict_resume_is_bit_exact_and_loads_weights_only(state_dtype, master):
    dtype = torch.bfloat16 if master else torch.float32

    def make():
        torch.manual_seed(0)
        model = nn.Linear(64, 64).to(dtype)
        return model, AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype, master_weights=master)

    x = torch.randn(32, 64, dtype=dtype)

    def steps(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    a, opt_a = make()
    steps(a, opt_a, 3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b, opt_b = make()
    b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["optim"])
    for p, q in zip(a.parameters(), b.parameters()):
        for key, value in opt_a.state[p].items():
            assert opt_b.state[q][key].dtype == value.dtype, key
    steps(a, opt_a, 3)
    steps(b, opt_b, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(p), _bits(q))
        for key, value in opt_a.state[p].items():
            assert torch.equal(
                opt_b.state[q][key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
            ), key


def test_param_groups_scheduler_closure_zero_grad():
    model = _mlp()
    opt = AdamW([{"params": model[0].parameters(), "lr": 1e-2}], lr=1e-3, state_dtype=FP8)
    opt.add_param_group({"params": model[2].parameters(), "state_dtype": torch.bfloat16})
    opt.add_param_group({"params": model[4].parameters()})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3, 1e-3]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data()

    def closure():
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    first = opt.step(closure)
    for _ in range(5):
        loss = opt.step(closure)
        sched.step()
    assert loss < first
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.5**5
    assert opt.state[model[0].weight]["exp_avg"].dtype == FP8
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.bfloat16
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_converted_float8_model_trains_with_fp8_states():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    convert_to_float8_training(model)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=FP8)
    x = torch.randn(32, 64)
    y = torch.randn(32, 64) * 0.1
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert opt.state[model[0].weight]["exp_avg"].dtype == FP8


# ------------------------------------------------------------------ bad input, non-finite gradients


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"state_dtype": torch.float16}, "state_dtype must be one of"),
        ({"state_dtype": torch.float8_e5m2}, "state_dtype must be one of"),
        ({"master_weights": "fp32"}, "master_weights must be one of"),
        ({"lr": -1e-3}, "lr must be"),
        ({"eps": -1e-8}, "eps must be"),
        ({"betas": (1.0, 0.999)}, r"betas must be two floats in \[0, 1\)"),
        ({"betas": (0.9, -0.1)}, r"betas must be two floats in \[0, 1\)"),
        ({"master_weights": "remainder"}, "applies to bf16 parameters only"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW([nn.Parameter(torch.zeros(4))], **kwargs)


def test_complex_params_and_sparse_grads_raise():
    with pytest.raises(ValueError, match="real parameters"):
        AdamW([nn.Parameter(torch.zeros(4, dtype=torch.complex64))])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_propagates_never_finite_garbage(state_dtype, bad):
    p = nn.Parameter(torch.randn(2, FP8_BLOCK))
    opt = AdamW([p], state_dtype=state_dtype)
    p.grad = torch.randn_like(p)
    opt.step()
    p.grad = torch.randn_like(p)
    p.grad[0, 5] = bad
    opt.step()
    s = opt.state[p]
    if state_dtype == FP8:
        m = dequantize(s["exp_avg"], s["exp_avg_scale"], (1, FP8_BLOCK), torch.float32)
        v = dequantize(s["exp_avg_sq"], s["exp_avg_sq_scale"], (1, FP8_BLOCK), torch.float32)
    else:
        m, v = s["exp_avg"], s["exp_avg_sq"]
    # The bad element's moments only, as torch's (e4m3 keeps an inf as NaN: it has no inf).
    bad_element = torch.zeros_like(p, dtype=torch.bool)
    bad_element[0, 5] = True
    assert torch.equal(m.isfinite(), ~bad_element) and torch.equal(v.isfinite(), ~bad_element)
    assert p[0, 5].isnan()  # as torch: the parameter becomes NaN (inf / inf for an inf gradient)
    assert torch.equal(p.isfinite(), ~bad_element)


def test_stochastic_draws_are_a_function_of_the_global_element_and_the_seed():
    table = optim_draws.noise_table(1234, torch.device("cpu"))
    full = optim_draws.uniform(table, 0, (300, 700))
    # A shard of rows [120, 213) draws what the full tensor draws there.
    shard = optim_draws.uniform(table, 120 * 700, (93, 700))
    assert torch.equal(shard, full[120:213])
    assert not torch.equal(optim_draws.uniform(optim_draws.noise_table(1235, torch.device("cpu")), 0, (300, 700)), full)
    assert full.min() >= 0 and full.max() < 1
    # Elements a period apart share a draw; neighbours do not.
    flat = full.reshape(-1)
    assert torch.equal(flat[:1000], flat[NOISE_PERIOD : NOISE_PERIOD + 1000])
    assert (flat[:1000] != flat[1:1001]).float().mean() > 0.99
    # Different (parameter, step, moment) give different seeds.
    seeds = {optim_draws.seed(i, s, m) for i in range(10) for s in range(1, 20) for m in range(3)}
    assert len(seeds) == 10 * 19 * 3
