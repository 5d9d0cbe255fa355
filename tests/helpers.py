"""Shared test helpers: SQNR with a stated threshold, bit-exact Float8Tensor comparison."""

from __future__ import annotations

import ast
import contextlib
import datetime
import functools
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from f8tensor import FLOAT8_DTYPES, Float8Linear, Float8Tensor, sqnr
from f8tensor.tensor import weights

HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
E4M3_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
E5M2_DTYPES = (torch.float8_e5m2, torch.float8_e5m2fnuz)
GRANULARITIES = ("tensorwise", "rowwise")

# Minimum round-trip SQNR (dB) of a cast of torch.randn data, per format: 3 mantissa bits
# give ~31 dB, 2 give ~25 dB; the thresholds leave ~3 dB of margin.
CAST_MIN_DB = {
    torch.float8_e4m3fn: 28.0,
    torch.float8_e4m3fnuz: 28.0,
    torch.float8_e5m2: 22.0,
    torch.float8_e5m2fnuz: 22.0,
}
assert set(CAST_MIN_DB) == set(FLOAT8_DTYPES)

# Minimum SQNR (dB) of an FP8 matrix product against the fp32 reference, Gaussian operands,
# high-precision output. Measured on CPU over the tests that use these (test_ops_matmul,
# test_gemm, test_compile, test_inference_export): e4m3 x e4m3 products 27.0-32 dB, so
# MATMUL_MIN_DB sits 2 dB under; a product with an e5m2 operand (one mantissa bit less)
# measures 24.6 (tensorwise) to 25.3 (rowwise) dB: a tensorwise e4m3/e5m2 mix-up fails
# MATMUL_MIN_DB. Products that are meant to take an e5m2 operand use MATMUL_E5M2_MIN_DB,
# 2.6 dB under their 24.6 dB.
MATMUL_MIN_DB = 25.0
MATMUL_E5M2_MIN_DB = 22.0


def load_script(path: Path):
    """A script of ``benchmarks/`` or ``tools/`` as a module (its folder importable while it loads)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def matmul_min_db(*float8_dtypes: torch.dtype) -> float:
    """The product threshold for these operand formats: the e5m2 one if any operand is e5m2."""
    return MATMUL_E5M2_MIN_DB if any(d in E5M2_DTYPES for d in float8_dtypes) else MATMUL_MIN_DB


# Minimum SQNR (dB) of a gradient the FP8 path computes in bf16 (a weight gradient when only
# the weight was cast) against the fp32 reference: bf16 rounding, measured 55.06-55.67 dB.
HP_GRAD_MIN_DB = 53.0


@contextlib.contextmanager
def torch_reference_cpu_kernels():
    """oneDNN off for the block: torch's CPU ``_scaled_mm`` then runs its reference kernel,
    whose bits ``compat.cpu_scaled_mm`` (f8tensor's CPU product) reproduces. With oneDNN on,
    CPUs with AMX or AVX512-FP16 send ``aten._scaled_mm`` (an exported program's GEMM) and
    fp32 GELU to oneDNN, whose bits differ from the reference kernels'; and inductor's CPU code
    may compute an inverse scale an ulp off eager's (measured 4.7e-10 on 0.0045), which can
    move one FP8 element of a later cast (84.6 dB)."""
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


def kernel_skip_reason(
    recipe: str | None = None, *, blocks: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None = None
) -> str | None:
    """Why this CUDA device and torch build have no kernel for a product (None: they have one),
    as the kernel rules say (``f8tensor.gemm.rules``: each block-scaled row's builds, keyed
    by capability and ``torch.version.cuda``). The one gate of GPU tests that need a kernel.

    ``recipe``: a ``Float8LinearConfig`` recipe name: every block-scaled or FP4 product of
    its three GEMMs (output, grad_input, grad_weight) needs a kernel here; tensorwise and
    rowwise products are routed to a kernel every supported build has. ``blocks``:
    ``(block_a, block_b, scale_dtype)`` of one block-scaled product ``A (M, K) @ B (K, N)``.
    """
    from f8tensor import Float8LinearConfig, compat
    from f8tensor.gemm.rules import CudaBuild, block_rule_for, fp4_rule_for
    from f8tensor.quant.config import is_blockwise

    if not torch.cuda.is_available():
        return "needs CUDA (no CUDA device available)"
    products: list[tuple[str, object]] = []  # (what, rule or None)
    if blocks is not None:
        block_a, block_b, scale_dtype = blocks
        products.append((f"a {block_a} x {block_b} product", block_rule_for(block_a, block_b, scale_dtype)))
    if recipe is not None:
        config = Float8LinearConfig.from_recipe(recipe)
        fp4 = {c.fp4_kind for c in (config.input, config.weight, config.grad_output)} - {None}
        for kind in sorted(fp4):
            products.append((f"the {recipe} recipe", fp4_rule_for(kind)))
        gemms = {  # A's and B's (cast, contracted dim, transposed) per GEMM
            "output": ((config.input, 1, False), (config.weight, 1, True)),
            "grad_input": ((config.grad_output, 1, False), (config.weight, 0, False)),
            "grad_weight": ((config.grad_output, 0, True), (config.input, 0, False)),
        }
        for gemm, operands in gemms.items():
            if fp4:
                break
            specs = [cast.operand_spec(k) for cast, k, _ in operands]
            oriented = [s.block[::-1] if t else s.block for s, (_, _, t) in zip(specs, operands)]
            if not any(is_blockwise(b) for b in oriented):
                continue
            same = specs[0].scale_dtype == specs[1].scale_dtype
            rule = block_rule_for(*oriented, specs[0].scale_dtype, specs[0].float8_dtype) if same else None
            products.append((f"the {recipe} recipe's {gemm} product", rule))
    major, minor = torch.cuda.get_device_capability()
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    here = CudaBuild(compat.TORCH_VERSION, cuda, (major, minor))  # type: ignore[arg-type]
    for what, rule in products:
        if rule is None:
            return f"no kernel takes {what} on any build (the rules table has no row)"
        if not hasattr(torch.nn.functional, "scaled_mm") or here not in rule.builds:  # type: ignore[attr-defined]
            return f"{what} needs the {rule.name} kernel ({rule.builds}); this is {here.name}"  # type: ignore[attr-defined]
    return None


def gpu_test_skip_reason(item) -> str | None:
    """Why a ``gpu`` test item (a ``device_param`` test's ``cuda`` variant included) cannot
    run on this GPU although the test is right (None: it can), as :func:`kernel_skip_reason`
    says for the products its ``kernel`` markers name and for every recipe named in its
    parameters (a GPU test runs them on the GPU). tests/conftest.py skips on it."""
    from f8tensor.quant.config import RECIPES

    for marker in item.iter_markers("kernel"):
        why = kernel_skip_reason(*marker.args, **marker.kwargs)
        if why is not None:
            return why
    params = getattr(getattr(item, "callspec", None), "params", {})
    for value in params.values():
        if isinstance(value, str) and value in RECIPES:
            why = kernel_skip_reason(value)
            if why is not None:
                return why
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def assert_sqnr(reference: torch.Tensor, actual: torch.Tensor, min_db: float, what: str = "") -> float:
    """Fail unless ``sqnr(reference, actual) >= min_db``; the message carries the value.

    A NaN SQNR (NaN anywhere in ``actual``) fails too: ``nan >= x`` is False.
    """
    db = sqnr(reference.detach(), actual.detach())
    label = f"{what}: " if what else ""
    assert db >= min_db, f"{label}SQNR {db:.2f} dB is below the {min_db} dB threshold"
    return db


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 tensor (NaN-safe, sign-of-zero-safe comparison)."""
    return t.view(torch.uint8)


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of an fp32 tensor."""
    assert t.dtype == torch.float32, t.dtype
    return t.view(torch.int32)


def assert_bitwise_equal_f8(a: Float8Tensor, b: Float8Tensor) -> None:
    """Same subclass, outer shape/dtype, FP8 bytes, scale bits and metadata."""
    assert type(a) is Float8Tensor and type(b) is Float8Tensor, (type(a), type(b))
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a._data.dtype == b._data.dtype, (a._data.dtype, b._data.dtype)
    assert a._data.shape == b._data.shape, (a._data.shape, b._data.shape)
    assert torch.equal(bits(a._data), bits(b._data)), "FP8 bytes differ"
    assert a._scale.shape == b._scale.shape, (a._scale.shape, b._scale.shape)
    assert a._scale.dtype == b._scale.dtype, (a._scale.dtype, b._scale.dtype)
    assert torch.equal(scale_bits(a._scale), scale_bits(b._scale)), "scale bits differ"
    assert (a._orig_dtype, a._block, a._gemm) == (b._orig_dtype, b._block, b._gemm)


def scale_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a scale: fp32 as int32, e8m0 as its byte."""
    return float_bits(t) if t.dtype == torch.float32 else t.view(torch.uint8)


def assert_consistent(t: Float8Tensor) -> None:
    """The container invariants from the class docstring hold for ``t``."""
    assert type(t) is Float8Tensor
    assert t.shape == t._data.shape
    assert t.stride() == t._data.stride()
    assert t.dtype == t._orig_dtype
    assert t._scale.dtype in (torch.float32, torch.float8_e8m0fnu)
    assert len(t._block) == t.dim(), (t._block, t.shape)
    if t._scale.dim() == 0:
        assert set(t._block) <= {0}, t._block
    else:
        # One scale per block: ceil(size / b) along a dim with block b, 1 where b == 0.
        expected = [1 if b == 0 else -(-s // b) for s, b in zip(t._data.shape, t._block)]
        assert list(t._scale.shape) == expected, (t._scale.shape, expected, t._block)


def reference_cast(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """The scale rule written out independently: clamp(hp.float() * scale) to the range, then cast."""
    fmax = torch.finfo(float8_dtype).max
    return (hp.float() * scale).clamp(-fmax, fmax).to(float8_dtype)


def check_compiled_linear(granularity: str, batch: tuple[int, ...], k: int, n: int, device: str = "cpu") -> None:
    """``F.linear(x, Float8Tensor.from_hp(w))`` under inductor with ``fullgraph=True``: one
    graph, output and input gradient within MATMUL_MIN_DB of an fp32 reference, the weight
    gradient (a bf16 product) within HP_GRAD_MIN_DB."""
    import torch._dynamo.testing
    import torch.nn.functional as F

    from f8tensor import Float8Tensor

    def fn(x, w):
        return F.linear(x, Float8Tensor.from_hp(w, granularity=granularity))

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    x = torch.randn(*batch, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    upstream = torch.randn(*batch, n, dtype=torch.bfloat16, device=device)
    y = compiled(x, w)
    y.backward(upstream)
    assert counter.frame_count == 1
    x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y_ref = x_ref @ w_ref.t()
    y_ref.backward(upstream.float())
    assert_sqnr(y_ref, y, MATMUL_MIN_DB, "output")
    assert_sqnr(x_ref.grad, x.grad, MATMUL_MIN_DB, "grad_x")
    # Only w is cast: its gradient is upstream^T @ x in bf16 (measured 55.06 dB on CPU).
    assert_sqnr(w_ref.grad, w.grad, HP_GRAD_MIN_DB, "grad_w")


def dotted_name(node: ast.AST) -> list[str] | None:
    """``a.b.c`` (an attribute chain over a name) as ``["a", "b", "c"]``; None for any other
    expression. For the AST checks of the package's source."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def free_port() -> int:
    """A free TCP port on localhost, for a test's process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """In a spawned test process: one torch thread, a gloo process group on loopback."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def run_processes(fn: Callable, world: int, args: tuple, timeout_s: float) -> None:
    """``fn(rank, *args)`` in ``world`` spawned processes; fail the test past ``timeout_s``."""
    procs = torch.multiprocessing.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not procs.join(timeout=1):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.terminate()
            pytest.fail(f"the {world}-rank run did not finish within {timeout_s} s")


class RanFP8:
    """Which converted layers ran an FP8 forward: a counter on ``Float8Linear.forward`` and
    on the unwrapping of recipe weights (``nn.MultiheadAttention``'s projections and expert
    weights, whose FP8 products unwrap each weight they take), patched on the classes through
    ``monkeypatch``; no module hooks, which would change the path some models take, e.g.
    ``nn.TransformerEncoderLayer``'s fast path)."""

    def __init__(self, monkeypatch) -> None:
        self.ran: set[int] = set()
        real = Float8Linear.forward
        real_unwrap = weights.Unwrap.apply

        def counted(layer, *args, **kwargs):
            self.ran.add(id(layer))
            return real(layer, *args, **kwargs)

        def counted_unwrap(w):
            self.ran.add(id(w))
            return real_unwrap(w)

        monkeypatch.setattr(Float8Linear, "forward", counted)
        monkeypatch.setattr(weights.Unwrap, "apply", counted_unwrap)

    def missing(self, model) -> list[str]:
        """The names in ``model.float8_converted_fqns`` whose layer (or attention weight) did not run."""
        found = dict(model.named_modules()) | dict(model.named_parameters())
        return [f for f in model.float8_converted_fqns if id(found[f]) not in self.ran]


class FP8Products(TorchDispatchMode):
    """Counts the matrix products that run in FP8 (on a CPU a per-tensor product is the
    custom op ``f8tensor::cpu_scaled_mm``, a rowwise one ``aten._scaled_mm``), and lists the
    high-precision products whose right operand has the shape of one of ``hp_shapes`` (a
    weight's product that escaped FP8) or that take the fused attention kernel."""

    FP8 = frozenset({torch.ops.f8tensor.cpu_scaled_mm.default, torch.ops.aten._scaled_mm.default})
    HP = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default})

    def __init__(self, hp_shapes=()) -> None:
        super().__init__()
        self.fp8 = 0
        self.hp: list[str] = []
        self.hp_shapes = {tuple(s) for s in hp_shapes} | {tuple(s)[::-1] for s in hp_shapes}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.FP8:
            self.fp8 += 1
        elif func is torch.ops.aten._native_multi_head_attention.default:
            self.hp.append(str(func))
        elif func in self.HP:
            w = args[1] if func is torch.ops.aten.linear.default else args[-1]
            if tuple(w.shape) in self.hp_shapes:
                self.hp.append(f"{func} {tuple(w.shape)}")
        return func(*args, **(kwargs or {}))


def weight_grad_sqnr(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    """SQNR (dB) of each 2D weight's gradient in ``model`` against the same parameter's in
    ``reference`` (the high-precision twin, after the same backward)."""
    ref = dict(reference.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and p.grad is not None:
            out[name] = sqnr(ref[name].grad.detach().float(), p.grad.detach().float())
    assert out, "no 2D weight has a gradient"
    return out


def interpreter_problem(probe: Callable[[], object]) -> str | None:
    """None when this triton's interpreter runs ``probe`` (a call that launches a Triton
    kernel on CPU tensors); else why not. (Measured: triton 3.6's interpreter, the one
    torch 2.11 pins, fails on a loop with a runtime bound under numpy 2.4: ``int()`` of a
    1-element array. The GPU compiler is not the interpreter: the compile-for-CUDA tests
    still compile every kernel.)"""
    import triton

    try:
        probe()
    except Exception as error:  # noqa: BLE001 (the interpreter's own error types differ by release)
        return f"triton {triton.__version__}'s interpreter cannot run the kernels here: {error!r}"
    return None


@functools.cache
def unfused_interpreter_fma() -> str | None:
    """Why the interpreter's ``tl.fma`` cannot give torch's bits, or None: the fused AdamW
    step's large-weight lerp of a first step, ``fma(w - 1, g, g)``, rounded once as ATen's CPU
    lerp rounds it (triton 3.6's interpreter, the one torch 2.11 pins, rounds twice)."""
    import triton

    from f8tensor.optim import AdamW

    g = torch.full((128,), 1.7535215616226196)  # a gradient whose fma rounded once and twice differ
    p = torch.nn.Parameter(torch.zeros(128))
    p.grad = g.clone()
    opt = AdamW([p], betas=(0.3, 0.95), state_dtype=torch.float32, fused=True)
    opt.step()
    w1 = torch.tensor(0.7, dtype=torch.float32).double()
    once = ((w1 - 1) * g.double() + g.double()).float()  # the product exact in float64
    if torch.equal(opt.state[p]["exp_avg"], once):
        return None
    return (
        f"triton {triton.__version__}'s interpreter rounds tl.fma twice (a multiply, then an add): "
        "its bits cannot be torch's here; the gpu-marked tests compare the compiled kernel"
    )


def skip_without_interpreter(
    request: pytest.FixtureRequest, problem: Callable[[], str | None], exempt: set[str]
) -> None:
    """Skip a test that runs a kernel under the interpreter (not ``gpu``-marked, not named in
    ``exempt``) when ``problem()`` says the interpreter cannot run here."""
    if request.node.get_closest_marker("gpu") is None and request.node.originalname not in exempt:
        why = problem()
        if why is not None:
            pytest.skip(why)


def dequantized(x8: Float8Tensor) -> torch.Tensor:
    """``x8``'s values in fp32 from its fields alone (a reference independent of the library's
    dequantization): data / scale, each scale repeated over its block, partial edge blocks
    cut."""
    scale = x8._scale.float()
    if scale.dim():
        for d, b in enumerate(x8._block):
            if b > 1:
                scale = scale.repeat_interleave(b, dim=d).narrow(d, 0, x8.shape[d])
    return x8._data.float() / scale


#: The demo table's columns after ``run``, in order; a column can be left out (the same in
#: every row). A ``vs bf16`` column is read as ``"<the column before it> vs bf16"``.
DEMO_COLUMNS = ("loss", "vs bf16", "tok/s", "vs bf16", "act. MiB", "vs bf16", "sat.", "opt. MiB", "peak MiB")


def demo_table(stdout: str) -> dict[str, dict[str, str]]:
    """The rows of the demo's table in ``stdout``: run name -> column title -> cell text."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    header = lines[start]
    spans, pos, last = [], len("run"), ""
    for title in DEMO_COLUMNS:
        at = header.find(title, pos)
        if at < 0:
            continue
        key = f"{last} vs bf16" if title == "vs bf16" else title
        last = last if title == "vs bf16" else title
        spans.append((key, pos, at + len(title)))  # cells are right-aligned under their title
        pos = at + len(title)
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        name = line.split()[0]
        rows[name] = {key: line[max(lo, len(name)) : hi].strip() for key, lo, hi in spans}
    return rows


def compiled_fp8_casts(fn: Callable, *inputs: torch.Tensor) -> tuple[int, int]:
    """FP8 casts (``_to_copy`` to an FP8 dtype) in the forward and backward graphs of
    ``fn(*inputs).sum().backward()``, partitioned as inductor partitions (CSE on), not run
    through inductor."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counts: list[int] = []

    def compiler(gm: torch.fx.GraphModule, _):
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        counts.append(
            sum(n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") in fp8 for n in gm.graph.nodes)
        )
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs).sum().backward()
    forward, backward = counts
    return forward, backward
