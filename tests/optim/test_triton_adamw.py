"""The fused AdamW step (``f8tensor/kernels/triton_adamw.py``, ``adamw_step_kernel``) against
:class:`f8tensor.optim.AdamW`'s torch-ops path, bit for bit: parameters, bf16 remainders,
moments (FP8 bytes and block scales) after every step.

On CPU the kernel runs under the Triton interpreter (``fused=True``; the kernel file is
loaded a second time with ``TRITON_INTERPRET=1``, as for the fused casts), with the rounding
of torch's CPU kernels. One op is not the same there: torch's vectorized CPU ``sqrt`` is not
always correctly rounded (CUDA's is, and so is the kernel's), so the bit-for-bit tests swap
the torch-ops path's square root (``f8tensor.optim._sqrt``) for a correctly rounded one, and
:func:`test_cpu_sqrt_is_the_one_difference` measures what torch's own square root changes.
A NaN's payload and sign are not compared (both paths agree on which elements are NaN).
The tests marked ``gpu`` compare the compiled kernel with the torch-ops path on CUDA, with
torch's own square root.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import interpreter_problem, skip_without_interpreter, unfused_interpreter_fma
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="the fused AdamW step needs triton (it ships with CUDA builds of torch)")

from f8tensor import optim
from f8tensor.kernels import triton_adamw
from f8tensor.optim import AdamW
from f8tensor.quant.block_quantizers import moment_quantizer

FP8 = torch.float8_e4m3fn
STATE_DTYPES = (torch.float32, torch.bfloat16, FP8)
#: (parameter dtype, master_weights): every combination the optimizer accepts.
PARAMS = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "stochastic"), (torch.bfloat16, "remainder")]
#: Rows of 300 (two blocks of 128 and a ragged one of 44), a 3-D tensor (rows of 200: one
#: block and a ragged 72), a tensor of exactly one short block per row (64), a 1-D bias
#: (fp32 moments even with FP8 states).
SHAPES = ((5, 300), (3, 4, 50), (2, 64), (7,))
#: Tests that never run a kernel under the interpreter.
_NO_INTERPRETER = {"test_switch", "test_kernel_compiles_for_cuda"}


@functools.cache
def _interpreter_problem() -> str | None:
    """None when this triton's interpreter runs the step kernel on CPU tensors; else why not."""

    def probe() -> None:
        p = torch.nn.Parameter(torch.ones(2, 128))
        p.grad = torch.ones(2, 128)
        AdamW([p], state_dtype=FP8, fused=True).step()

    return interpreter_problem(probe)


@pytest.fixture(autouse=True)
def _needs_interpreter(request):
    skip_without_interpreter(request, _interpreter_problem, _NO_INTERPRETER)


@pytest.fixture
def fused_fma():
    """Skip a bit-for-bit test where the interpreter's ``tl.fma`` is not fused (triton 3.6's)."""
    why = unfused_interpreter_fma()
    if why is not None:
        pytest.skip(why)


@pytest.fixture
def rn_sqrt(monkeypatch):
    """The torch-ops path with a correctly rounded square root (float64's, rounded once to
    fp32: 53 >= 2 * 24 + 2 bits, no double rounding)."""
    monkeypatch.setattr(optim, "_sqrt", lambda x: x.to(torch.float64).sqrt().to(torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, except a NaN's payload and sign: NaN exactly where the other has NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    differ = _bits(got) != _bits(want)
    if got.is_floating_point():
        nan, want_nan = torch.isnan(got.float()), torch.isnan(want.float())
        assert torch.equal(nan, want_nan), f"{what}: NaN at different elements"
        differ &= ~nan
    bad = differ.nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}"


def _grads(shapes, dtype, step: int, *, non_finite: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    grads = [
        (torch.randn(s, generator=g) * torch.exp2(torch.randint(-6, 6, s, generator=g).float())).to(dtype)
        for s in shapes
    ]
    if non_finite:
        grads[0][1, 3] = float("nan")
        grads[0][2, 200] = float("inf")
        grads[0][4, 17] = 2e21  # finite, but (1 - beta2) * g * g overflows: v = inf
    return grads


def _lockstep(param_dtype, master, state_dtype, *, steps=3, shapes=SHAPES, bad_step=1, device="cpu"):
    """The fused and the torch-ops optimizer on copies of the same parameters (two groups:
    one with weight decay and a small lerp weight, one without and ``1 - beta1 >= 0.5``,
    lerp's other branch), the same gradients; yields after each step."""
    torch.manual_seed(0)
    init = [torch.randn(s).to(param_dtype).to(device) for s in shapes]
    models = []
    for fused in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [
            {"params": params[:2], "lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1},
            {"params": params[2:], "lr": 3e-3, "betas": (0.3, 0.95), "eps": 1e-6, "weight_decay": 0.0},
        ]
        models.append((params, AdamW(groups, state_dtype=state_dtype, master_weights=master, fused=fused)))
    for step in range(steps):
        grads = _grads(shapes, param_dtype, step, non_finite=step == bad_step)
        for params, opt in models:
            for p, g in zip(params, grads):
                p.grad = g.to(device)
            opt.step()
        yield step, models


def _compare(models, what: str) -> None:
    (fused_params, fused_opt), (params, opt) = models
    for i, (p, q) in enumerate(zip(fused_params, params)):
        assert_same(p, q, f"{what}: parameter {i}")
        assert fused_opt.state[p].keys() == opt.state[q].keys()
        for key, value in opt.state[q].items():
            assert_same(fused_opt.state[p][key], value, f"{what}: parameter {i} state {key}")


# ------------------------------------------------------------ bit for bit, every combination


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("param_dtype, master", PARAMS, ids=lambda x: str(x).replace("torch.", ""))
def test_fused_step_is_the_torch_ops_step(fused_fma, rn_sqrt, param_dtype, master, state_dtype):
    for step, models in _lockstep(param_dtype, master, state_dtype):
        _compare(models, f"step {step}")
    # The non-finite gradient of step 1, as documented: NaN parameter elements where the
    # gradient was NaN or inf, non-finite moments at those elements only (and v at the
    # element whose square overflowed; e4m3 stores it as NaN, so its parameter is NaN a
    # step later), finite block scales.
    fused_params, fused_opt = models[0]
    p = fused_params[0]
    bad = torch.zeros(p.shape, dtype=torch.bool)
    bad[1, 3] = bad[2, 200] = True
    overflow = bad.clone()
    overflow[4, 17] = True
    assert torch.equal(~torch.isfinite(p.float()), overflow if state_dtype == FP8 else bad)
    state = fused_opt.state[p]
    assert torch.equal(~torch.isfinite(state["exp_avg"].float()), bad)
    assert torch.equal(~torch.isfinite(state["exp_avg_sq"].float()), overflow)
    if state_dtype == FP8:
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.isfinite(state[key]).all(), key


def test_fp8_moments_rounded_to_nearest(fused_fma, rn_sqrt, monkeypatch):
    """With round-to-nearest FP8 moments (``FP8_ROUNDING``) the kernel's requantization is
    the block cast's nearest rounding: the same bits."""
    nearest = {name: moment_quantizer(FP8, optim.FP8_BLOCK, "nearest") for name in ("exp_avg", "exp_avg_sq")}
    monkeypatch.setattr(optim, "_FP8_MOMENTS", nearest)
    for step, models in _lockstep(torch.float32, None, FP8):
        _compare(models, f"step {step}")


def test_cpu_sqrt_is_the_one_difference():
    """With torch's own CPU square root: moments and scales bit for bit; the parameter bit
    for bit except where that square root of the new ``v`` is not correctly rounded, and
    there within the bound below (one step from the same state)."""
    shapes = ((64, 256),)
    for _, models in _lockstep(torch.float32, None, torch.float32, steps=1, shapes=shapes, bad_step=-1):
        (fused_params, fused_opt), (params, opt) = models
    p, q = fused_params[0], params[0]
    v = opt.state[q]["exp_avg_sq"]
    assert torch.equal(_bits(fused_opt.state[p]["exp_avg_sq"]), _bits(v))
    assert torch.equal(_bits(fused_opt.state[p]["exp_avg"]), _bits(opt.state[q]["exp_avg"]))
    off = torch.sqrt(v) != v.double().sqrt().float()
    assert off.any()  # the difference exists on this CPU (else the test shows nothing)
    differ = _bits(p) != _bits(q)
    assert not (differ & ~off).any()
    # The bound: a denominator off by about one ulp moves the update u by a few fp32
    # rounding units of u, and the sum with the parameter rounds once more: |difference|
    # <= ulp(parameter) + 2**-20 * |u|. (Measured: 101 square roots off, 5 parameters
    # differ, four by 1 ulp, one by 2 ulps at a parameter of small magnitude.)
    torch.manual_seed(0)
    before = torch.randn(shapes[0]).double()  # _lockstep's initial parameter
    update = q.double() - before * (1 - 1e-2 * 0.1)
    ulp = torch.nextafter(q.abs(), torch.tensor(float("inf"))).double() - q.abs().double()
    gap = (p.double() - q.double()).abs()
    assert (gap <= ulp + 2.0**-20 * update.abs()).all()
    assert differ.sum() < off.sum()


# ------------------------------------------------------------ no host sync


class _ScalarReads(TorchDispatchMode):
    """Records the tensor of every ``aten._local_scalar_dense`` (``item``, ``bool``, ``tolist``)."""

    def __init__(self):
        super().__init__()
        self.reads: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(args[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("state_dtype", [torch.float32, FP8], ids=lambda d: str(d)[6:])
def test_step_reads_no_scalar_but_the_step_counters(state_dtype):
    """The only scalar reads of a fused step are of the step counters (0-dim CPU tensors,
    as torch's: reading one is no device sync); nothing reads a moment, a scale or an amax
    back to the host."""
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in SHAPES]
    opt = AdamW(params, state_dtype=state_dtype, master_weights="stochastic", fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # states created
    with _ScalarReads() as mode:
        opt.step()
    counters = [opt.state[p]["step"] for p in params]
    assert all(c.device.type == "cpu" and c.dim() == 0 for c in counters)
    assert len(mode.reads) == len(params)
    assert all(any(r is c for c in counters) for r in mode.reads)


# ------------------------------------------------------------ the switch


def test_switch(monkeypatch):
    """``fused=None`` keeps CPU tensors on the torch-ops path, ``fused=False`` every tensor,
    ``fused=True`` takes the kernel (CPU: the interpreter) where it applies; fp16
    parameters stay on the torch-ops path; bad values raise."""
    calls = []
    monkeypatch.setattr(triton_adamw, "adamw_step", lambda *a, **k: calls.append(a[0].shape))
    for fused, dtype, expected in ((None, torch.float32, 0), (False, torch.float32, 0), (True, torch.float32, 1),
                                   (True, torch.float16, 0)):  # fmt: skip
        calls.clear()
        p = torch.nn.Parameter(torch.randn(4, 32).to(dtype))
        p.grad = torch.randn_like(p)
        AdamW([p], fused=fused).step()
        assert len(calls) == expected, (fused, dtype)
    with pytest.raises(ValueError, match="fused must be None"):
        AdamW([torch.nn.Parameter(torch.ones(2))], fused="yes")


# ------------------------------------------------------------ CUDA: the compiled kernel


CUDA_SHAPES = ((1030, 700), (3, 4, 50), (64, 4096), (7,))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("param_dtype, master", PARAMS, ids=lambda x: str(x).replace("torch.", ""))
def test_cuda_fused_step_is_the_torch_ops_step(param_dtype, master, state_dtype):
    """The compiled kernel against the torch-ops path on CUDA, torch's own square root
    (correctly rounded there), after every step."""
    for step, models in _lockstep(param_dtype, master, state_dtype, shapes=CUDA_SHAPES, device="cuda"):
        _compare(models, f"step {step}")


def _cuda_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype, per_tensor", [(torch.float32, 1), (torch.bfloat16, 1), (FP8, 3)],
                         ids=["fp32", "bf16", "fp8"])  # fmt: skip
def test_cuda_one_kernel_per_tensor(state_dtype, per_tensor):
    """One step kernel per tensor; FP8 moments add the two tables of draws (torch.rand)."""
    params = [torch.nn.Parameter(torch.randn(256, 512, device="cuda")) for _ in range(3)]
    opt = AdamW(params, state_dtype=state_dtype)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    launched = _cuda_kernels(opt.step)
    assert sum("adamw_step_kernel" in name for name in launched) == len(params), launched
    assert len(launched) == per_tensor * len(params), launched


# ------------------------------------------------------------ compiled for GPUs, without one

_FLOATS = ("wd_factor", "w1", "beta2", "value2", "bc2", "neg_step", "eps")


def _compile_adamw(arch: int, p: str, g: str, m: str, states: int, master: int, stochastic: bool):
    import triton
    from triton.backends.compiler import GPUTarget

    from f8tensor.kernels import triton_cast

    kernel = triton_cast._kernels(False, "_triton_adamw_kernels").adamw_step_kernel
    pointers = {"p_ptr": p, "rem_ptr": "*i16", "g_ptr": g, "m_ptr": m, "v_ptr": m, "ms_ptr": "*fp32",
                "vs_ptr": "*fp32", "mtab_ptr": "*fp32", "vtab_ptr": "*fp32", "ptab_ptr": "*fp32"}  # fmt: skip
    constants = {
        "P_BF16": p == "*i16", "G_BF16": g == "*i16", "STATES": states, "MASTER": master, "HAS_WD": True,
        "LERP_SMALL": True, "STOCH_M": stochastic, "STOCH_V": stochastic, "TORCH_CUDA": True,
        "FMAX": 448.0, "BIAS": 7, "MBITS": 3, "EPS": 2.0**-100, "G": 8, "B": 128,
    }  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "fp32" if name in _FLOATS else "i32")
        for name in kernel.arg_names
    }
    source = triton.compiler.ASTSource(kernel, signature, constexprs=constants)
    options = {"num_warps": 4, **triton_adamw._OPTIONS}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@pytest.mark.parametrize("arch", [89, 90])
def test_kernel_compiles_for_cuda(arch):
    """The step kernel compiles to a cubin for sm89 and sm90 with triton's own ptxas (what
    the interpreter cannot show), and its PTX rounds as torch's CUDA kernels do: correctly
    rounded square roots and divisions, no approximate or flush-to-zero arithmetic."""
    import re

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    built = [
        _compile_adamw(arch, "*fp32", "*fp32", "*fp32", 0, 0, False),
        _compile_adamw(arch, "*i16", "*i16", "*i16", 1, 2, False),
        _compile_adamw(arch, "*i16", "*i16", "*u8", 2, 1, True),
    ]
    for kernel in built:
        assert kernel.asm["cubin"], kernel.name
        ptx = kernel.asm["ptx"]
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
        assert not re.search(r"\b(?:mul|fma|add|sqrt|div)\.\w*ftz", ptx)
        assert "div.full" not in ptx and "div.approx" not in ptx and "sqrt.approx" not in ptx
