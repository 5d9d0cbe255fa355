"""Cast traffic: the bytes a compiled FP8 training step moves outside its GEMMs, read from
inductor's generated code, f8tensor and torchao side by side.

On GPUs the GEMMs of an FP8 linear run on tensor cores and everything around them (amax,
scale, cast, transposed copies) is memory-bound, so the bytes moved outside the GEMMs decide
how much of the FP8 speed-up survives. This script compiles one training step (forward and
backward) of a bf16 ``Linear(K -> N, bias=False)`` on ``x`` of shape (B, S, K) (M = B*S
tokens), captures the C++ code inductor generates for it on CPU (whose fusion decisions
the GPU back end largely shares) and reports, per recipe:

- kernels: the fused kernels (``cpp_fused_*`` calls) of forward and backward; GEMMs: the
  extern GEMM calls (``_scaled_mm``, ``mm``); other extern calls, if any.
- MiB outside the GEMMs, counted as follows. A *pass* is a top-level loop nest of a fused
  kernel (a loop that sits in no other loop; a tail loop that continues the previous one is
  merged into it). Within one pass every buffer the loop nest loads counts as read once,
  whole (its numel times its element size), and every buffer it stores counts as written
  once, whole: what is re-read inside one pass (a row, a tile) stays in cache. A buffer
  read by two passes is read twice. Buffers are tied to the kernels' pointer arguments
  through the calls in the generated ``call()``; sizes come from their allocations and
  dtypes from the kernel signatures. The GEMMs' own reads and writes are left out.
- passes over x, W and grad_y: the passes that read the high-precision tensor itself.
- saved for backward: under compile, the forward graph's outputs besides ``y`` (the
  weight, a parameter, left out), from the generated code; in eager, through
  :func:`f8tensor.stats.saved_tensor_bytes`.
- fp64 loops: loop bodies that compute in ``double`` and load a full-size tensor (per
  element float64); 0 is the target.
- eager kernels: the ATen kernels (views left out) one eager training step launches, and
  for f8tensor those of one cast of x (the first cast of the forward).
- with ``--timing``: the CPU time of the compiled step's fused kernels (the least over
  ``--steps`` profiled steps, inductor's kernel profiling on), the GEMMs left out.

The floor per recipe, in the same counting. Let X = M*K, W = N*K and G = M*N elements, h = 2
bytes (bf16), FP8 1 byte. Each GEMM operand must exist in FP8 in the layout the GEMM takes:
x and grad_y both with K or N innermost (forward, grad_x) and with M innermost (grad_W, which
contracts over the tokens); W with K innermost (forward) and N innermost (grad_x).

- tensorwise (dynamic): a tensor's amax must be complete before any element can be cast,
  so each tensor is read twice (amax pass, cast pass); the cast pass writes both FP8
  layouts. x: 2hX + 2X; grad_y: 2hG + 2G; W in forward 2hW + W, and in backward, re-cast
  with the forward's scale into the other layout (the FP8 weight is not kept), hW + W.
  Floor = 6X + 8W + 6G: 22 MiB at the default shape.
- delayed: the scale is known from the history before the pass, so the amax is measured
  inside the cast pass: x hX + 2X, grad_y hG + 2G, W 2 (hW + W). Floor = 4X + 6W + 4G:
  15 MiB.
- rowwise: a row's amax and its cast share one pass (the row is reduced, then cast, in one
  loop over the rows). The weight-gradient GEMM needs x and grad_y scaled per column (along
  M): a column amax is complete only after a full pass, which is the second read; once the
  column scales are known, the column cast rides along the row pass (the row loop writes
  the row-scaled copy and, strided, the column-scaled one). x: hX (column amax) + hX + 2X;
  grad_y likewise; W: forward hW + W, backward (scaled per column, along N) hW + hW + W.
  Floor = 6X + 8W + 6G = 22 MiB, as tensorwise.
- rowwise_with_gw_hp: the weight-gradient GEMM takes bf16 x and grad_y, so only the row
  casts remain: x hX + X, grad_y hG + G, W as rowwise. Floor = 3X + 8W + 3G = 13 MiB.

Scalars and per-row scales are counted like any buffer (they are small); the floors leave
them out, and the "full-size" column counts the x-, W- and grad_y-sized buffers alone.

Code generation. By default inductor's C++ back end vectorizes each loop nest on its own: a
per-row scale is computed 16 rows at a time, a cast that writes two layouts is tiled 32 x
32. Loops whose steps then differ cannot share an outer loop, so a row's amax, its scale
and its cast end up in separate passes (the same for f8tensor and torchao). That split is
a CPU vectorization choice, not a fusion decision of inductor's scheduler, and GPU kernels
have no such steps. ``--scalar-codegen`` compiles with vectorization off
(``cpp.simdlen=1``): the passes are then the loop fusion the scheduler decided, the closer
reading of what a GPU back end fuses. Both readings are reported.

CPU only: the code reading is of inductor's C++ kernels.

    python benchmarks/bench_cast_traffic.py [--batch 8 --seq 256 --in-features 512 --out-features 1024]
        [--timing] [--scalar-codegen]
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig, compat
from f8tensor.stats import saved_tensor_bytes

MIB = 2**20
_DTYPE_BYTES = {
    "at::BFloat16": 2,
    "at::Half": 2,
    "float": 4,
    "double": 8,
    "int64_t": 8,
    "int32_t": 4,
    "bool": 1,
    "at::Float8_e4m3fn": 1,
    "at::Float8_e5m2": 1,
    "at::Float8_e4m3fnuz": 1,
    "at::Float8_e5m2fnuz": 1,
    "uint8_t": 1,
    "int8_t": 1,
}
_TORCH_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "uint8": 1,
}
# cpu_scaled_mm: f8tensor's CPU product, where torch's CPU kernel refuses one (rowwise on 2.11).
_GEMMS = ("_scaled_mm", "cpu_scaled_mm", "mm", "addmm", "bmm", "_scaled_grouped_mm")


# ===================================================================== reading generated code


def _split_args(text: str) -> list[str]:
    """Split ``a, f(b, c), d`` on its top-level commas."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<" and not (ch == "<" and not cur):
            depth += ch in "([{"
        if ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _call_args(text: str, start: int) -> tuple[list[str], int]:
    """The arguments of the call whose ``(`` is at ``text[start]``, and the index after ``)``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return _split_args(text[start + 1 : i]), i + 1
    raise ValueError("unbalanced parentheses in generated code")


def _shape_numel(shape: str) -> int:
    dims = [d for d in re.findall(r"-?\d+", shape)]
    return math.prod(int(d) for d in dims) if dims else 1


@dataclasses.dataclass
class Loop:
    """A ``for`` loop: where its body is in the kernel source, and its loops inside."""

    header: str
    start: int  # index of "{" of the body
    end: int  # index of the matching "}"
    children: list[Loop] = dataclasses.field(default_factory=list)


def _loops(src: str) -> list[Loop]:
    """The top-level ``for`` loops of a C++ kernel body (with their nested loops)."""
    top: list[Loop] = []
    stack: list[tuple[int, Loop | None]] = []  # (brace depth at open, loop or None)
    depth = 0
    pending: str | None = None
    i = 0
    header_re = re.compile(r"for\s*\(")
    while i < len(src):
        m = header_re.match(src, i)
        if m and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            _, j = _call_args(src, m.end() - 1)
            pending = src[i:j]
            i = j
            continue
        ch = src[i]
        if ch == "{":
            loop = None
            if pending is not None:
                loop = Loop(pending, i, -1)
                parents = [lp for _, lp in stack if lp is not None]
                (parents[-1].children if parents else top).append(loop)
                pending = None
            stack.append((depth, loop))
            depth += 1
        elif ch == "}":
            depth -= 1
            _, loop = stack.pop()
            if loop is not None:
                loop.end = i
        elif ch == ";" and pending is not None:  # a loop without braces: not generated, but be safe
            pending = None
        i += 1
    return top


def _accesses(body: str, pointers: list[str]) -> tuple[set[str], set[str]]:
    """(pointers loaded, pointers stored) in a piece of kernel source."""
    loads, stores = set(), set()
    for name in pointers:
        for m in re.finditer(rf"(?<![\w]){re.escape(name)}(?![\w])", body):
            before = body[max(0, m.start() - 8) : m.start()]
            after = body[m.end() : m.end() + 200]
            if (
                before.endswith(".store(")
                or after.startswith("[")
                and re.match(r"\[[^\]]*\]\s*=(?!=)", after)
                or _is_transpose_dst(body, m.start())
            ):
                stores.add(name)
            else:
                loads.add(name)
    return loads, stores


def _is_transpose_dst(body: str, pos: int) -> bool:
    """Whether ``pos`` lies in the destination (third) argument of a ``transpose_mxn`` call."""
    start = body.rfind("transpose_mxn<", 0, pos)
    if start < 0:
        return False
    paren = body.find(">(", start)
    # the template arguments hold nested <...>: find the "(" that opens the call
    depth, k = 0, start + len("transpose_mxn")
    while k < len(body):
        if body[k] == "<":
            depth += 1
        elif body[k] == ">":
            depth -= 1
            if depth == 0:
                paren = k + 1
                break
        k += 1
    args, end = _call_args(body, paren)
    if pos > end or len(args) < 3:
        return False
    # locate the third argument's span
    offset = paren + 1
    spans = []
    for a in args:
        idx = body.find(a, offset)
        spans.append((idx, idx + len(a)))
        offset = idx + len(a)
    return spans[2][0] <= pos < spans[2][1]


@dataclasses.dataclass
class Buffer:
    numel: int
    itemsize: int | None = None  # known from an allocation; else from the kernel signature

    @property
    def nbytes(self) -> int:
        return self.numel * (self.itemsize or 0)


@dataclasses.dataclass
class Pass:
    kernel: str
    reads: dict[str, int]  # buffer -> bytes
    writes: dict[str, int]
    fp64_per_element: bool


@dataclasses.dataclass
class GraphCode:
    """One compiled graph (forward or backward): its kernels, GEMMs and passes."""

    inputs: list[str]
    buffers: dict[str, Buffer]
    kernels: list[str]
    gemms: list[str]
    other_externs: list[str]
    passes: list[Pass]
    outputs: list[str]

    @property
    def read_bytes(self) -> int:
        return sum(sum(p.reads.values()) for p in self.passes)

    @property
    def written_bytes(self) -> int:
        return sum(sum(p.writes.values()) for p in self.passes)

    def full_size_bytes(self, threshold: int) -> int:
        """Bytes of the buffers of at least ``threshold`` elements (x, W, grad_y and their
        copies), the part the floors count; the rest are scales, amax partials, scalars."""
        return sum(
            n
            for p in self.passes
            for d in (p.reads, p.writes)
            for b, n in d.items()
            if self.buffers.get(b) is not None and self.buffers[b].numel >= threshold
        )

    def passes_over(self, buffer: str | None) -> int:
        return 0 if buffer is None else sum(buffer in p.reads for p in self.passes)


def parse_graph_code(code: str, element_threshold: int) -> GraphCode:
    """Kernels, GEMM calls and the passes of one inductor output module (CPU C++).

    ``element_threshold``: a buffer with at least this many elements is a full-size tensor
    (x, W, grad_y or a copy of one), for the per-element float64 check.
    """
    kernels_src: dict[str, tuple[list[str], str]] = {}
    for m in re.finditer(
        r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[(.*?)\], r'''(.*?)'''", code, re.DOTALL | re.MULTILINE
    ):
        types = [t.strip().strip("'\"") for t in m.group(2).split(",")]
        kernels_src[m.group(1)] = (types, m.group(3))
    call_src = code[code.index("    def call(self, args):") :]
    call_src = call_src[: call_src.index("\nrunner = ") if "\nrunner = " in call_src else len(call_src)]
    buffers: dict[str, Buffer] = {}
    # Graph inputs: their shapes and dtypes in get_args().
    for m in re.finditer(r"(\w+) = rand_strided\((\([^)]*\)), \([^)]*\), device='\w+', dtype=torch\.(\w+)\)", code):
        buffers[m.group(1)] = Buffer(_shape_numel(m.group(2)), _TORCH_BYTES.get(m.group(3)))
    inputs_m = re.search(r"^\s+(.*?) = args$", call_src, re.MULTILINE)
    inputs = [a.strip() for a in inputs_m.group(1).split(",") if a.strip()] if inputs_m else []
    for m in re.finditer(r"(\w+) = empty_strided_cpu\((\([^)]*\)), \([^)]*\), torch\.(\w+)\)", call_src):
        buffers[m.group(1)] = Buffer(_shape_numel(m.group(2)), _TORCH_BYTES.get(m.group(3)))
    for m in re.finditer(r"(\w+) = reinterpret_tensor\((\w+), (\([^)]*\))", call_src):
        base = buffers.get(m.group(2))
        buffers[m.group(1)] = Buffer(_shape_numel(m.group(3)), base.itemsize if base else None)
    # Storage reuse: ``buf13 = buf12; del buf12  # reuse`` (e.g. an in-place pass over a GEMM's output).
    for m in re.finditer(r"^\s+(\w+) = (\w+); del \2\b", call_src, re.MULTILINE):
        if m.group(2) in buffers:
            buffers[m.group(1)] = buffers[m.group(2)]

    def resolve(arg: str) -> tuple[str, Buffer | None]:
        m = re.match(r"reinterpret_tensor\((\w+), (\([^)]*\))", arg)
        if m:
            base = buffers.get(m.group(1))
            return m.group(1), Buffer(_shape_numel(m.group(2)), base.itemsize if base else None)
        return arg, buffers.get(arg)

    kernels, gemms, others, passes = [], [], [], []
    for m in re.finditer(
        r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", call_src, re.MULTILINE
    ):
        name = m.group(1)
        if name.startswith(("extern_kernels.", "torch.ops.")):
            short = name.split(".")[-1] if name.startswith("extern_kernels.") else name.split(".")[-2]
            (gemms if short in _GEMMS else others).append(short)
            continue
        kernels.append(name)
        args, _ = _call_args(call_src, m.end() - 1)
        types, src = kernels_src[name]
        params = re.findall(r"[\w:]+\s*\*\s*(\w+)\s*[,)]", src[: src.index("{")])
        bound: dict[str, tuple[str, Buffer]] = {}
        for param, ctype, arg in zip(params, types, args):
            buf_name, buf = resolve(arg)
            itemsize = _DTYPE_BYTES.get(ctype.replace("const ", "").replace("*", "").strip())
            buf = Buffer(buf.numel if buf else 1, (buf.itemsize if buf and buf.itemsize else itemsize))
            bound[param] = (buf_name, buf)
        body = src[src.index("{") :]
        passes.extend(_kernel_passes(name, body, bound, element_threshold))
    ret = re.search(r"^\s+return \((.*)\)\s*$", call_src, re.MULTILINE)
    outputs = _split_args(ret.group(1)) if ret else []
    return GraphCode(inputs, buffers, kernels, gemms, others, passes, outputs)


def _kernel_passes(kernel: str, body: str, bound: dict[str, tuple[str, Buffer]], threshold: int) -> list[Pass]:
    pointers = sorted(bound, key=len, reverse=True)
    groups: list[list[Loop]] = []
    for loop in _loops(body):
        start = re.search(r"=\s*static_cast<int64_t>\((\d+)L?\)|=\s*(\d+)", loop.header)
        begins_at_zero = start is None or (start.group(1) or start.group(2)) == "0"
        if groups and not begins_at_zero:
            groups[-1].append(loop)  # a tail loop continuing the previous one
        else:
            groups.append([loop])
    out = []
    for group in groups:
        text = "".join(body[lp.start : lp.end + 1] for lp in group)
        loads, stores = _accesses(text, pointers)
        reads = {bound[p][0]: bound[p][1].nbytes for p in loads}
        writes = {bound[p][0]: bound[p][1].nbytes for p in stores}
        big = {p for p in loads if bound[p][1].numel >= threshold}
        fp64 = any(_fp64_per_element(body, lp, big) for lp in group)
        out.append(Pass(kernel, reads, writes, fp64))
    return out


def _own_text(body: str, loop: Loop) -> str:
    """A loop's body without the bodies of the loops inside it."""
    pieces, pos = [], loop.start
    for child in loop.children:
        pieces.append(body[pos : body.rfind("for", pos, child.start)])
        pos = child.end + 1
    pieces.append(body[pos : loop.end])
    return "".join(pieces)


def _fp64_per_element(body: str, loop: Loop, big_pointers: set[str]) -> bool:
    """Whether a loop (or one inside it) computes in double while loading a full-size tensor
    in the same loop body: float64 work once per element, not once per scale."""
    own = _own_text(body, loop)
    if re.search(r"\bdouble\b", own) and any(re.search(rf"(?<![\w]){p}(?![\w])", own) for p in big_pointers):
        return True
    return any(_fp64_per_element(body, child, big_pointers) for child in loop.children)


def fp64_per_element_loops(codes: list[str], element_threshold: int) -> int:
    """The number of passes, over ``codes`` (inductor output modules), with per-element float64."""
    return sum(p.fp64_per_element for code in codes for p in parse_graph_code(code, element_threshold).passes)


# ===================================================================== measuring one recipe


@dataclasses.dataclass
class Shape:
    batch: int
    seq: int
    k: int
    n: int

    @property
    def m(self) -> int:
        return self.batch * self.seq


def floor_bytes(recipe: str, s: Shape) -> int:
    """The floor in bytes, per the module docstring."""
    x, w, g = s.m * s.k, s.n * s.k, s.m * s.n
    if recipe == "tensorwise":
        return 6 * x + 8 * w + 6 * g
    if recipe == "delayed":
        return 4 * x + 6 * w + 4 * g
    if recipe == "rowwise":
        return 6 * x + 8 * w + 6 * g
    if recipe == "rowwise_with_gw_hp":
        return 3 * x + 8 * w + 3 * g
    raise ValueError(recipe)


def build_layer(library: str, recipe: str, s: Shape, float8=None) -> nn.Module:
    torch.manual_seed(0)
    ref = nn.Linear(s.k, s.n, bias=False, dtype=torch.bfloat16)
    if library == "f8tensor":
        return Float8Linear.from_float(ref, Float8LinearConfig.from_recipe(recipe))
    return C.torchao_convert(float8, nn.Sequential(ref), recipe)


def _inputs(s: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s.batch, s.seq, s.k, dtype=torch.bfloat16, generator=g).requires_grad_()
    grad = torch.randn(s.batch, s.seq, s.n, dtype=torch.bfloat16, generator=g)
    return x, grad


def compiled_step_code(
    layer: nn.Module, s: Shape, kernel_profile: bool = False, scalar: bool = False
) -> tuple[list[str], Callable[[], None]]:
    """Inductor's output code of one compiled training step (forward, backward), and the step.

    ``scalar``: compile with the CPU back end's SIMD vectorization off (``cpp.simdlen=1``),
    see the module docstring.
    """
    from torch._inductor import config as ic
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x, grad = _inputs(s)
    patches = {"cpp.enable_kernel_profile": kernel_profile}
    if scalar:
        patches["cpp.simdlen"] = 1
    with ic.patch(patches):
        compiled = torch.compile(layer, fullgraph=True)

        def step() -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            compiled(x).backward(grad)

        _, codes = run_and_get_code(step)
    return codes, step


def eager_kernels(fn: Callable[[], object]) -> int:
    """ATen kernels ``fn`` launches (views, which launch none, left out)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "permute",
        "expand",
        "reshape",
        "alias",
        "detach",
        "as_strided",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "_reshape_alias",
        "split",
        "lift_fresh",
    }

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in views:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def f8tensor_cast_kernels(recipe: str, s: Shape) -> int:
    """Eager kernels of f8tensor's forward cast of x for ``recipe``."""
    from f8tensor.quant.config import GemmConfig
    from f8tensor.quant.quantizers import cast_operand, role_plan

    layer = build_layer("f8tensor", recipe, s)
    cfg = layer.config
    x, _ = _inputs(s)
    x2 = x.detach().reshape(-1, s.k)
    state = (
        [getattr(layer, n).clone() for n in ("amax_history_input", "scale_input")] if cfg.any_delayed else [None, None]
    )
    return eager_kernels(lambda: cast_operand(x2, role_plan(cfg.input), 1, GemmConfig(), cfg, state[0], state[1]))


def kernel_times_ms(step: Callable[[], None], steps: int) -> float:
    """The least, over ``steps`` profiled calls, of the summed CPU time of the fused kernels
    (the least rather than the median: on a shared machine a step is only ever slowed down)."""
    from torch.profiler import ProfilerActivity, profile

    totals = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        totals.append(sum(e.cpu_time_total for e in prof.events() if "cpp_fused" in e.name) / 1e3)
    return min(totals)


def measure(library: str, recipe: str, s: Shape, float8=None, timing_steps: int = 0, scalar: bool = False) -> dict:
    layer = build_layer(library, recipe, s, float8)
    codes, step = compiled_step_code(layer, s, kernel_profile=timing_steps > 0, scalar=scalar)
    threshold = min(s.m * s.k, s.n * s.k, s.m * s.n)
    graphs = [parse_graph_code(c, threshold) for c in codes]
    fwd = next(g for g in graphs if not any(i.startswith("tangents") for i in g.inputs))
    bwd = [g for g in graphs if g is not fwd]

    def input_named(g: GraphCode, numel: int) -> str | None:
        return next(
            (i for i in g.inputs if g.buffers.get(i) and g.buffers[i].numel == numel and g.buffers[i].itemsize == 2),
            None,
        )

    passes = {}
    for name, numel in (("x", s.m * s.k), ("W", s.n * s.k), ("grad_y", s.m * s.n)):
        passes[name] = sum(g.passes_over(input_named(g, numel)) for g in graphs)
    # Saved for backward: forward outputs after y, the weight (a parameter) left out.
    w_name = input_named(fwd, s.n * s.k)
    saved = 0
    for out in fwd.outputs[1:]:
        m = re.match(r"reinterpret_tensor\((\w+), (\([^)]*\))", out)
        name = m.group(1) if m else out
        if name == w_name or name not in fwd.buffers:
            continue
        buf = fwd.buffers[name]
        saved += (_shape_numel(m.group(2)) if m else buf.numel) * (buf.itemsize or 0)
    eager_layer = build_layer(library, recipe, s, float8)
    x, grad = _inputs(s)
    saved_eager, _ = saved_tensor_bytes(eager_layer, lambda: eager_layer(x))
    row = {
        "library": library,
        "recipe": recipe,
        "M": s.m,
        "K": s.k,
        "N": s.n,
        "kernels_fwd": len(fwd.kernels),
        "kernels_bwd": sum(len(g.kernels) for g in bwd),
        "gemms": len(fwd.gemms) + sum(len(g.gemms) for g in bwd),
        "other_externs": len(fwd.other_externs) + sum(len(g.other_externs) for g in bwd),
        "passes": sum(len(g.passes) for g in graphs),
        "read_bytes": sum(g.read_bytes for g in graphs),
        "written_bytes": sum(g.written_bytes for g in graphs),
        "full_size_bytes": sum(g.full_size_bytes(threshold) for g in graphs),
        "passes_x": passes["x"],
        "passes_W": passes["W"],
        "passes_grad_y": passes["grad_y"],
        "saved_bytes_compiled": saved,
        "saved_bytes_eager": saved_eager,
        "fp64_loops": sum(p.fp64_per_element for g in graphs for p in g.passes),
        "eager_kernels_step": eager_kernels(lambda: eager_layer(x).backward(grad)),
        "eager_kernels_cast_x": f8tensor_cast_kernels(recipe, s) if library == "f8tensor" else math.nan,
        "kernel_ms": kernel_times_ms(step, timing_steps) if timing_steps else math.nan,
    }
    row["total_bytes"] = row["read_bytes"] + row["written_bytes"]
    row["floor_bytes"] = floor_bytes(recipe, s)
    return row


# ===================================================================== main


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__)
    parser.add_argument("--tiny", action="store_true", help="the tiny size of the smoke test (same as --quick)")
    parser.add_argument("--batch", type=int, default=None, help="x is (BATCH, SEQ, IN); default 8")
    parser.add_argument("--seq", type=int, default=None, help="default 256")
    parser.add_argument("--in-features", type=int, default=None, help="K, default 512")
    parser.add_argument("--out-features", type=int, default=None, help="N, default 1024")
    parser.add_argument("--timing", action="store_true", help="also time the compiled step's fused kernels (CPU)")
    parser.add_argument("--steps", type=int, default=15, help="profiled steps per configuration with --timing")
    parser.add_argument(
        "--scalar-codegen",
        action="store_true",
        help="compile with the CPU back end's SIMD vectorization off (cpp.simdlen=1): the loop "
        "fusion inductor's scheduler decides, unsplit by per-loop vector steps",
    )
    args = parser.parse_args(argv)
    if args.device.type != "cpu":
        parser.error(f"--device {args.device.type}: this script reads inductor's C++ (CPU) kernels; use --device cpu")
    tiny = args.quick or args.tiny
    s = Shape(
        args.batch or (2 if tiny else 8),
        args.seq or (16 if tiny else 256),
        args.in_features or (64 if tiny else 512),
        args.out_features or (128 if tiny else 1024),
    )
    if min(s.batch, s.seq, s.k, s.n) < 1 or s.k % 16 or s.n % 16:
        parser.error("--batch/--seq must be >= 1; --in-features/--out-features positive multiples of 16")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    C.setup_compile()
    # The graphs as a GPU runs them: one _scaled_mm extern call per product (f8tensor's own
    # fp32 CPU product would add its fp32 accumulator's traffic to the count).
    compat.CPU_PRODUCTS_IN_FP32 = False
    env = C.environment(args.device, args.torchao_note)
    C.print_environment(env, "Cast traffic: bytes outside the GEMMs of one compiled training step")
    jobs = [("f8tensor", r) for r in args.recipes] + [("torchao", r) for r in args.torchao_recipes]
    progress = C.Progress(len(jobs), "bench_cast_traffic")
    rows = []
    for library, recipe in jobs:
        progress.update(f"{library} {recipe}")
        row = measure(library, recipe, s, args.torchao, args.steps if args.timing else 0, args.scalar_codegen)
        row["codegen"] = "scalar" if args.scalar_codegen else "vectorized"
        rows.append(row)
    progress.close()
    print(
        f"### bf16 Linear({s.k} -> {s.n}, bias=False), x ({s.batch}, {s.seq}, {s.k}): M={s.m}, K={s.k}, N={s.n}; "
        f"one compiled forward + backward; {rows[0]['codegen'] if rows else ''} CPU code generation"
    )
    print()
    headers = [
        "library",
        "recipe",
        "MiB outside GEMMs",
        "of which full-size",
        "read",
        "written",
        "floor MiB",
        "fused kernels (fwd+bwd)",
        "GEMMs",
        "passes",
        "passes x / W / grad_y",
        "saved MiB compiled / eager",
        "fp64 loops",
        "eager kernels: step / cast of x",
    ]
    if args.timing:
        headers.append("fused-kernel CPU ms")
    table = []
    for r in rows:
        floor = f"{r['floor_bytes'] / MIB:.1f}"
        cast = "-" if math.isnan(r["eager_kernels_cast_x"]) else str(r["eager_kernels_cast_x"])
        row = [
            r["library"],
            r["recipe"],
            f"{r['total_bytes'] / MIB:.2f}",
            f"{r['full_size_bytes'] / MIB:.2f}",
            f"{r['read_bytes'] / MIB:.2f}",
            f"{r['written_bytes'] / MIB:.2f}",
            floor,
            f"{r['kernels_fwd'] + r['kernels_bwd']} ({r['kernels_fwd']}+{r['kernels_bwd']})",
            str(r["gemms"]) + (f" +{r['other_externs']} other" if r["other_externs"] else ""),
            str(r["passes"]),
            f"{r['passes_x']} / {r['passes_W']} / {r['passes_grad_y']}",
            f"{r['saved_bytes_compiled'] / MIB:.2f} / {r['saved_bytes_eager'] / MIB:.2f}",
            str(r["fp64_loops"]),
            f"{r['eager_kernels_step']} / {cast}",
        ]
        if args.timing:
            row.append(f"{r['kernel_ms']:.2f}")
        table.append(row)
    print(C.markdown_table(headers, table, numeric=[False, False] + [True] * (len(headers) - 2)))
    print()
    print(
        "MiB: bytes read + written by the fused kernels, a buffer counted once per pass (top-level loop nest) "
        "that touches it; GEMM operands and results left out. fp64 loops: passes computing in double per element."
    )
    C.write_csv(args.csv, rows, env)


if __name__ == "__main__":
    main()
