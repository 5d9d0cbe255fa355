"""f8tensor.optim.AdamW under torch.compile: ``torch.compile(opt.step)`` traces the whole step
(no graph break, one graph after the step that creates the states, none per parameter or
per step), and the compiled CPU step (``compiled=``) gives the torch-ops path's bits.

The step counter stays a 0-dim tensor in a traced step (the eager path reads it as a
Python float); the stochastic-rounding tables come from one custom op that reads it when
the graph runs. The compiled code spells out the fused multiply-adds of ATen's CPU lerp and
addcmul (``compat.fma``): inductor then writes the eager kernels' bits, with a correctly
rounded square root where torch's vectorized CPU ``sqrt`` is 1 ulp off for 0.6% of inputs.
Run by a backend other than inductor (``CompileCounter``, ``aot_eager``) the fused
multiply-adds round twice: close to eager, not bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from f8tensor import compat, optim
from f8tensor.optim import COMPILE_MIN_NUMEL, AdamW
from f8tensor.optim import draws as optim_draws
from f8tensor.optim import master as optim_master

FP8 = torch.float8_e4m3fn
MODES = [
    (torch.float32, None, torch.float32),
    (torch.float32, None, torch.bfloat16),
    (torch.float32, None, FP8),
    (torch.bfloat16, "remainder", FP8),
    (torch.bfloat16, "stochastic", FP8),
]
MODE_IDS = ["fp32", "bf16-states", "fp8", "remainder-fp8", "stochastic-fp8"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    noise = (got - want).pow(2).sum()
    return float("inf") if noise == 0 else (10 * torch.log10(want.pow(2).sum() / noise)).item()


def _params(param_dtype: torch.dtype, shapes) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter((torch.randn(s, generator=g) * 0.1).to(param_dtype)) for s in shapes]


def _set_grads(params, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)


# Several shapes: 2D weights with rows of whole 128-blocks, a 3D weight, a row of 200 (a short
# last block), 1D biases (fp32 moments under FP8 states).
SHAPES = ((64, 128), (64,), (48, 256), (48,), (3, 5, 128), (6, 200))


# ------------------------------------------------------------ torch.compile(opt.step)


# The parameters after five steps against eager, the lowest of the six tensors: measured
# 151.6 dB (fp32 states), 129.8 (bf16 states: a moment that rounds the other way in bf16
# moves its element more), 151.6 (FP8 states); bit for bit for bf16 parameters with a
# remainder or stochastic master (every difference rounds away in bf16).
TRACED_MIN_DB = {"fp32": 145.0, "bf16-states": 120.0, "fp8": 145.0, "remainder-fp8": None, "stochastic-fp8": None}


@pytest.mark.parametrize("param_dtype, master, state_dtype", MODES, ids=MODE_IDS)
def test_compiled_step_has_no_graph_break_and_one_graph(request, param_dtype, master, state_dtype):
    min_db = TRACED_MIN_DB[request.node.callspec.id]
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (False, True):
        params = _params(param_dtype, SHAPES)
        opt = AdamW(params, lr=1e-2, state_dtype=state_dtype, master_weights=master, compiled=False)
        cnt = CompileCounter()
        step = torch.compile(opt.step, backend=cnt) if compiled else opt.step
        for k in range(5):
            _set_grads(params, k)
            step()
        results.append((params, opt))
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph for the first step (it creates the states), one for every later step: none per
    # parameter (six of five shapes, two kinds of states) or per step count.
    assert cnt.frame_count == 2
    (eager, eager_opt), (traced, traced_opt) = results
    for p, q in zip(traced, eager):
        if min_db is None:
            assert torch.equal(_bits(p), _bits(q)), tuple(p.shape)
        else:
            assert _sqnr_db(p, q) >= min_db, (tuple(p.shape), _sqnr_db(p, q))
        state, want = traced_opt.state[p], eager_opt.state[q]
        assert state.keys() == want.keys()
        assert torch.equal(state["step"], want["step"]) and state["step"].device.type == "cpu"
        for key in want:
            assert state[key].dtype == want[key].dtype and state[key].shape == want[key].shape, key
        if "exp_avg_scale" in want:  # FP8 moments: the same e4m3 bytes (measured: all of them)
            for key in ("exp_avg", "exp_avg_sq"):
                same = (_bits(state[key]) == _bits(want[key])).float().mean().item()
                assert same >= 0.999, (key, same)


def test_compiled_step_follows_lr_and_new_parameters_without_graph_breaks():
    """A scheduler's lr (a float read from the param group) recompiles once, then stays a
    graph input; the step count never recompiles."""
    torch._dynamo.reset()
    counters.clear()
    params = _params(torch.float32, SHAPES)
    opt = AdamW(params, lr=1e-2, state_dtype=FP8, compiled=False)
    cnt = CompileCounter()
    step = torch.compile(opt.step, backend=cnt)
    for k in range(6):
        _set_grads(params, k)
        step()
        for group in opt.param_groups:
            group["lr"] *= 0.8
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert cnt.frame_count <= 3  # states created, lr a constant, lr dynamic


# ------------------------------------------------------------ the compiled CPU step (compiled=)


@pytest.fixture
def counted_backend(monkeypatch):
    """The compiled CPU step's backend replaced by a counter that runs the graph eagerly."""
    cnt = CompileCounter()
    monkeypatch.setattr(optim, "_COMPILE_BACKEND", cnt)
    return cnt


@pytest.mark.parametrize("param_dtype, master, state_dtype", MODES, ids=MODE_IDS)
def test_compiled_cpu_step_one_graph_per_kind_of_tensor(counted_backend, param_dtype, master, state_dtype):
    """One graph per kind of tensor (rows of 128-element blocks, or flat), whatever the
    shape, the step count, the lr (a scheduler) or a shard's offset."""
    torch._dynamo.reset()
    shapes = ((64, 128), (48, 256), (3, 5, 128), (256,), (7,))
    params = _params(param_dtype, shapes)
    opt = AdamW(params, lr=1e-2, state_dtype=state_dtype, master_weights=master, compiled=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    for k in range(4):
        _set_grads(params, k)
        opt.step()
        scheduler.step()
    # Rows of blocks: the three weights (and the 256-element bias, unless its moments are FP8
    # which a 1-D tensor never has); flat: the 7-element bias.
    assert counted_backend.frame_count == (3 if state_dtype == FP8 else 2)


def test_compiled_cpu_step_is_taken_where_the_policy_says(monkeypatch):
    """``compiled=None``: CPU tensors of at least COMPILE_MIN_NUMEL elements whose torch-ops
    step is slow (FP8 moments, a bf16 master); False: never; True: every CPU tensor (FP8
    moments: rows of whole blocks). Without a C++ compiler None keeps the torch-ops path and
    True is refused."""
    calls = []
    monkeypatch.setattr(optim, "_run_compiled", lambda local, *a: calls.append(tuple(local.shape)))
    monkeypatch.setattr(optim, "cpu_compiler", lambda: "c++")  # whatever this machine has
    big = (COMPILE_MIN_NUMEL // 128, 128)
    cases = [
        (None, torch.float32, FP8, None, big, 1),
        (None, torch.float32, FP8, None, (64, 128), 0),  # small
        (None, torch.float32, torch.float32, None, big, 0),  # fp32 states: torch's bits
        (None, torch.bfloat16, torch.bfloat16, "remainder", big, 1),
        (None, torch.bfloat16, torch.bfloat16, None, big, 0),
        (False, torch.float32, FP8, None, big, 0),
        (True, torch.float32, torch.float32, None, (64, 128), 1),
        (True, torch.float32, FP8, None, (6, 200), 0),  # a short last block: torch ops
        (True, torch.float32, FP8, None, (6, 256), 1),
    ]
    for compiled, param_dtype, state_dtype, master, shape, expected in cases:
        calls.clear()
        p = nn.Parameter(torch.zeros(shape, dtype=param_dtype))
        p.grad = torch.zeros_like(p)
        AdamW([p], state_dtype=state_dtype, master_weights=master, compiled=compiled).step()
        assert len(calls) == expected, (compiled, param_dtype, state_dtype, master, shape)
    monkeypatch.setattr(optim, "cpu_compiler", lambda: None)
    calls.clear()
    p = nn.Parameter(torch.zeros(big))
    p.grad = torch.zeros_like(p)
    AdamW([p], state_dtype=FP8).step()
    assert not calls
    with pytest.raises(ValueError, match="compiled=True needs a C\\+\\+ compiler"):
        AdamW([p], compiled=True)
    with pytest.raises(ValueError, match="compiled must be None"):
        AdamW([p], compiled="yes")


@pytest.mark.skipif(compat.cpu_compiler() is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize(
    "param_dtype, master, state_dtype",
    [(torch.bfloat16, "remainder", FP8), (torch.bfloat16, "stochastic", torch.bfloat16)],
    ids=["remainder-fp8", "stochastic-bf16"],
)
def test_inductor_compiled_cpu_step_is_the_torch_ops_step(monkeypatch, param_dtype, master, state_dtype):
    """Inductor's compiled step writes the torch-ops path's bits, parameters and states, step
    after step, when both take a correctly rounded square root (the compiled code's). One
    inductor compile per case (no biases: every tensor in rows of blocks)."""
    monkeypatch.setattr(optim, "_sqrt", lambda x: x.to(torch.float64).sqrt().to(torch.float32))
    torch._dynamo.reset()
    shapes = ((64, 128), (48, 256), (3, 5, 128))
    runs = []
    for compiled in (False, True):
        params = _params(param_dtype, shapes)
        opt = AdamW(params, lr=1e-2, state_dtype=state_dtype, master_weights=master, compiled=compiled)
        for k in range(3):
            _set_grads(params, k)
            opt.step()
        runs.append((params, opt))
    (eager, eager_opt), (comp, comp_opt) = runs
    for p, q in zip(comp, eager):
        assert torch.equal(_bits(p), _bits(q)), tuple(p.shape)
        for key, want in eager_opt.state[q].items():
            assert torch.equal(_bits(comp_opt.state[p][key]), _bits(want)), (tuple(p.shape), key)


# ------------------------------------------------------------ the pieces, traced


def test_traced_draws_are_the_eager_draws():
    """Under compile ``uniform`` indexes the table per row (one remainder per row, one wrap
    at most) or per element (flat): the eager path's draws, at any offset."""
    table = optim_draws.noise_table(99, torch.device("cpu"))
    traced = torch.compile(optim_draws.uniform, backend="aot_eager", fullgraph=True, dynamic=True)
    for start, shape in ((0, (600, 128)), (65_000, (40, 128)), (3 * 65_537 - 5, (7, 300)), (123, (1000,))):
        want = optim_draws.uniform(table, start, shape)
        assert torch.equal(traced(table, torch.tensor(start), shape), want), (start, shape)


def test_traced_master_encodings_are_the_eager_ones():
    """split_master / join_master in int32 arithmetic under compile (the remainder's int32
    value): the int16 halves' bits (eager), on 2**20 random patterns and the edges (zeros, infinities, NaNs, ties, carries),
    except a bf16 NaN: the canonical one under compile (the remainder is kept)."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    # Zeros, infinities, NaNs, the largest finite, low halves at the tie and past it, carries.
    edges = [0, -(2**31), 0x7F800000, -8388608, 0x7FC00000, -4194304, 0x7F7FFFFF, 0x00008000, 0x3F808000]
    edges += [0x7F7F8000, -1, 0x7FFFFFFF, 0x0000FFFF, 0x3F807FFF]
    edges = torch.tensor(edges, dtype=torch.int64).to(torch.int32)
    master = torch.cat((bits, edges)).view(torch.float32)
    split = torch.compile(optim_master.split_master, backend="aot_eager", fullgraph=True)
    join = torch.compile(optim_master.join_master, backend="aot_eager", fullgraph=True)
    high, low = split(master)
    want_high, want_low = optim_master.split_master(master)
    nan = want_high.isnan()
    assert 0 < nan.sum() < 10_000  # random patterns hit NaNs: both branches are exercised
    assert low.dtype == torch.int32 and torch.equal(low.to(torch.int16).to(torch.int32), low)  # an int16 value
    assert torch.equal(low.to(torch.int16), want_low)
    assert torch.equal(_bits(high)[~nan], _bits(want_high)[~nan]) and high[nan].isnan().all()
    assert torch.equal(_bits(join(want_high, want_low)), _bits(master))  # every pattern, NaNs too
