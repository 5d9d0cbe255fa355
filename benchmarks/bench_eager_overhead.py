"""Eager overhead of one FP8 training step at a tiny shape: ops, kernels and host time.

At a small layer an eager FP8 step is bound by what runs around the GEMMs (casts, scales,
layouts, Python), not by the GEMMs. For each recipe (and bf16 ``nn.Linear``, and
torchao.float8 where it is installed) this script runs one ``Linear(K -> K, bias=False)``
in bf16 on ``x (16, K)``: forward, ``.sum()``, backward (``x`` requires grad, so all three
GEMMs run), after a warm-up step, and measures:

- **dispatch ops**: aten ops seen by a ``TorchDispatchMode`` around forward, ``.sum()`` and
  backward (:class:`DispatchOpCounter`). This is the harness of issue 26's table: ops
  reaching the backend from outside any tensor subclass (ops that a Float8Tensor's
  ``__torch_dispatch__`` handler runs on its inner tensors count once per handled op, as
  the handled op). Other harnesses differ by a constant per recipe.
- **leaf ops** and **kernels**: what the backend executes, from ``torch.profiler``
  (:func:`count_leaf_kernels`). CPU: leaf ops are the operator events with no operator
  below them (an op built from other ops, a ``custom_op`` too, counts its children, never
  itself); kernels are the innermost operators that compute (views, allocations and
  metadata, :data:`NO_KERNEL_OPS`, are neither counted nor hide the op above them). These
  are CPU counts (a CPU kernel may call sub-kernels a GPU kernel would not have). CUDA:
  the profiler's kernel events, for both.
- **Python calls**: every Python function call of the fourth step (``sys.setprofile`` "call"
  events, after three warm-up steps; C functions not counted), in all and in the library
  measured (f8tensor's or torchao's files), with the library's files in ``--breakdown``.
- **host time**: wall time per step, the median over interleaved rounds (every variant runs
  ``--steps`` steps, then the next, round after round). On CPU it includes the (tiny)
  arithmetic; it is labelled CPU.

**reuse** rows: the same step as a later micro-batch of gradient accumulation inside
``f8tensor.reuse_weight_casts`` (the weight's casts are served from the first micro-batch;
recipes whose weight cast is not reusable, delayed, run as before).

Shapes: K = 64 for tensorwise, rowwise, rowwise_with_gw_hp, delayed and bf16; K = 128 for
blockwise and mxfp8 (1x128 / 128x128 blocks; bf16 is also measured at 128 for their ratio).

    python benchmarks/bench_eager_overhead.py                       # CPU, about a minute
    python benchmarks/bench_eager_overhead.py --breakdown           # also each recipe's ops by name
    python benchmarks/bench_eager_overhead.py --cast-region         # also: one cast, eager vs a compiled region

``--cast-region`` times one tensorwise cast of ``x (16, 64)`` (scale, data, inverse scale)
three ways: the eager reference ops, the same function compiled once with
``torch.compile(dynamic=True, fullgraph=True)`` and called from eager code (the
"compiled regions" mechanism), and, on CUDA, the fused kernels (``kernels.cast_for_gemm``).

Prints Markdown tables (with the command, versions and CPU) for BENCHMARKS.md.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: The recipes measured, in table order.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")
#: Recipes whose blocks need K = 128 (a 1x128 tile and a 128x128 weight block).
WIDE = ("blockwise", "mxfp8")
TOKENS = 16

#: Leaf operators that launch no kernel on a GPU: views, allocations and metadata.
NO_KERNEL_OPS = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::view",
        "aten::_unsafe_view",
        "aten::as_strided",
        "aten::t",
        "aten::transpose",
        "aten::permute",
        "aten::expand",
        "aten::reshape",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::select",
        "aten::slice",
        "aten::narrow",
        "aten::alias",
        "aten::detach",
        "aten::lift_fresh",
        "aten::resolve_conj",
        "aten::resolve_neg",
        "aten::result_type",
        "aten::_reshape_alias",
        "aten::split",
        "aten::unbind",
        "aten::contiguous",
        "aten::is_nonzero",
        "aten::item",
        "aten::_local_scalar_dense",
        "aten::view_as",
        "aten::expand_as",
        "aten::set_",
        "aten::_has_compatible_shallow_copy_type",
        "aten::to",
        "aten::detach_",
        "detach_",
        "aten::lift_fresh_copy",
    }
)


class DispatchOpCounter(TorchDispatchMode):
    """Counts every aten op that reaches the dispatch mode (by overload name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def build(library: str, recipe: str, k: int, device: torch.device, float8=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, k, bias=False)).to(device, torch.bfloat16)
    if library in ("f8tensor", "f8tensor+reuse"):
        C.f8tensor_convert(model, recipe)
    elif library == "torchao":
        C.torchao_convert(float8, model, recipe)
    return model


def make_step(model: nn.Module, k: int, device: torch.device) -> Callable[[], None]:
    x = torch.randn(TOKENS, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    params = list(model.parameters())

    def step() -> None:
        for p in params:  # a fresh gradient each step, as after optimizer.zero_grad()
            p.grad = None
        x.grad = None
        model(x).sum().backward()

    return step


def count_dispatch_ops(step: Callable[[], None]) -> DispatchOpCounter:
    """The ops of one step: forward, ``.sum()`` and backward inside one dispatch mode."""
    counter = DispatchOpCounter()
    with counter:
        step()
    return counter


class PythonCalls(NamedTuple):
    """The Python function calls of one step (``sys.setprofile`` "call" events)."""

    total: int
    by_package: collections.Counter[str]  # top-level package of the called function's file
    files: collections.Counter[str]  # files of ``package`` (the library measured) with calls

    def within(self, package: str) -> int:
        return self.by_package[package]


def count_python_calls(step: Callable[[], None], package: str = "f8tensor") -> PythonCalls:
    """Every Python-level call of one step (C calls not counted), by package and by file.

    Args:
        step: the training step (forward, ``.sum()``, backward).
        package: the package whose files are listed in ``files``.
    Returns:
        :class:`PythonCalls`.
    """
    by_package: collections.Counter[str] = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    marker = f"/{package}/"

    def _package(filename: str) -> str:
        for root in ("site-packages/", "dist-packages/"):
            if root in filename:
                return filename.split(root, 1)[1].split("/", 1)[0]
        if marker in filename:
            return package
        return "<other>"

    def profiler(frame, event, arg):
        if event == "call":
            filename = frame.f_code.co_filename
            name = _package(filename)
            by_package[name] += 1
            if name == package:
                files[filename.rsplit(marker, 1)[1]] += 1

    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    return PythonCalls(sum(by_package.values()), by_package, files)


def _is_operator(name: str) -> bool:
    # Operators are namespaced (aten::, a custom op's library::); the autograd engine's and
    # the profiler's own ranges are not operators.
    return "::" in name and not name.startswith(("autograd::", "torch::autograd::", "ProfilerStep"))


def count_leaf_kernels(step: Callable[[], None], device: torch.device) -> tuple[int, int, collections.Counter[str]]:
    """``(leaf ops, kernels, kernels by name)`` of one step.

    CPU: *leaf ops* are the operator events with no operator below them (an op made of other
    ops, a ``custom_op`` too, counts its children, never itself). *Kernels* are the innermost
    operators that compute: not a view, allocation or metadata op (:data:`NO_KERNEL_OPS`), and
    with no computing operator below them (``mm`` counts, although it calls ``resolve_conj``;
    ``clone`` does not, its ``copy_`` does, although that allocates). CPU kernels call
    sub-kernels where a GPU kernel would not (``aminmax`` fills its outputs first;
    ``_scaled_mm`` widens both operands and multiplies in software), so these are CPU
    counts, not GPU kernel counts. CUDA: the profiler's kernel events, for both."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        C.sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = collections.Counter(e.name for e in events if e.device_type == DeviceType.CUDA)
        total = sum(kernels.values())
        return total, total, kernels

    def computes_below(e) -> bool:
        return any(_is_operator(c.name) and (c.name not in NO_KERNEL_OPS or computes_below(c)) for c in e.cpu_children)

    ops = [e for e in events if e.device_type == DeviceType.CPU and _is_operator(e.name)]
    leaves = sum(1 for e in ops if not any(_is_operator(c.name) for c in e.cpu_children))
    kernels = collections.Counter(e.name for e in ops if e.name not in NO_KERNEL_OPS and not computes_below(e))
    return leaves, sum(kernels.values()), kernels


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__, recipes=RECIPES)
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 9, --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 30, --quick 2)")
    parser.add_argument(
        "--breakdown", action="store_true", help="also print each variant's ops and leaf kernels by name"
    )
    parser.add_argument(
        "--cast-region",
        action="store_true",
        help="also time one cast: eager ops vs a compiled region (and the fused kernels on CUDA)",
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 9)
    steps = args.steps or (2 if args.quick else 30)
    if rounds < 1 or steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    device = args.device
    env = C.environment(device, args.torchao_note)
    C.print_environment(env, "Eager overhead: one training step of a tiny Linear")

    # (library, recipe, K): bf16 at each K the FP8 variants use, for its ratio.
    variants = [("f8tensor", r, 128 if r in WIDE else 64) for r in args.recipes]
    variants += [("torchao", r, 64) for r in args.torchao_recipes]
    widths = sorted({k for _, _, k in variants} | {64})
    variants = [("bf16", "-", k) for k in widths] + variants

    variants += [("f8tensor+reuse", r, 128 if r in WIDE else 64) for r in args.recipes if r != "delayed"]

    steps_by_variant = {}
    counts = {}
    scopes = contextlib.ExitStack()  # the reuse variants' scopes stay open while they are measured
    for library, recipe, k in variants:
        model = build(library, recipe, k, device, args.torchao)
        if library == "f8tensor+reuse":
            from f8tensor import reuse_weight_casts

            scopes.enter_context(reuse_weight_casts(model))
        step = make_step(model, k, device)
        step()  # warm-up: first-call work (lazy init, caches) is not what a step costs
        step()
        step()  # three warm-up steps in all: the Python calls are counted on the fourth
        calls = count_python_calls(step, "torchao" if library == "torchao" else "f8tensor")
        ops = count_dispatch_ops(step)
        leaves, kernels, kernel_names = count_leaf_kernels(step, device)
        counts[library, recipe, k] = (ops, leaves, kernels, kernel_names, calls)
        steps_by_variant[library, recipe, k] = step

    timings = C.interleaved(steps_by_variant, rounds, steps, device)
    scopes.close()
    bf16_us = {k: 1e3 * timings["bf16", "-", k].median for k in widths}
    rows = []
    for key in variants:
        library, recipe, k = key
        ops, leaves, kernels, _, calls = counts[key]
        t = timings[key]
        us = 1e3 * t.median
        rows.append(
            {
                "library": library,
                "recipe": recipe,
                "K": k,
                "N": k,
                "M": TOKENS,
                "dispatch_ops": ops.total,
                "leaf_ops": leaves,
                "kernels": kernels,
                "python_calls": calls.total,
                "library_calls": calls.within("torchao" if library == "torchao" else "f8tensor"),
                "library_files": len(calls.files),
                "host_us": us,
                "spread": t.spread,
                "vs_bf16": us / bf16_us[k],
            }
        )

    where = "CUDA" if device.type == "cuda" else "CPU"
    leaf_label, kernel_label = ("CUDA kernels", "CUDA kernels") if device.type == "cuda" else ("leaf ops", "kernels")
    print(
        f"### {where}: Linear(K -> K, bias=False) bf16, x ({TOKENS}, K), forward + .sum() + backward; host time: "
        f"median of {rounds} x {steps} steps (interleaved rounds)"
    )
    print()
    headers = [
        "variant",
        "K",
        "dispatch ops",
        leaf_label,
        kernel_label,
        "Python calls",
        "in library",
        "host us/step",
        "+-",
        "vs bf16",
    ]
    ao = {r for lib, r, _ in variants if lib == "torchao"}
    table = []
    for r in rows:
        name = "bf16 nn.Linear" if r["library"] == "bf16" else f"{r['library']} {r['recipe']}"
        if r["library"] == "f8tensor+reuse":
            name = f"f8tensor {r['recipe']}, reuse_weight_casts (later micro-batch)"
        table.append(
            [
                name,
                r["K"],
                r["dispatch_ops"],
                r["leaf_ops"],
                r["kernels"],
                r["python_calls"],
                r["library_calls"] if r["library"] != "bf16" else "-",
                C.fmt(r["host_us"], 1),
                "-" if r["spread"] != r["spread"] else C.fmt(100 * r["spread"], 1) + "%",
                C.fmt(r["vs_bf16"], 2) + "x",
            ]
        )
    print(C.markdown_table(headers, table, numeric=[False] + [True] * 9))
    print()
    # The side by side of issue 26: dispatch ops per recipe, torchao where it runs.
    by = {(r["library"], r["recipe"]): r for r in rows}
    print(
        "| recipe | f8tensor ops | torchao ops | f8tensor Python calls | torchao Python calls | calls vs torchao "
        "| f8tensor host vs bf16 | torchao host vs bf16 | host vs torchao |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for recipe in args.recipes:
        f8 = by["f8tensor", recipe]
        t = by.get(("torchao", recipe)) if recipe in ao else None

        def na(value, spec="", suffix="", t=t):
            return format(value, spec) + suffix if t else "n/a"

        print(
            f"| {recipe} | {f8['dispatch_ops']} | {na(t and t['dispatch_ops'])} | {f8['python_calls']} | "
            f"{na(t and t['python_calls'])} | {na(t and f8['python_calls'] / t['python_calls'], '.2f', 'x')} | "
            f"{f8['vs_bf16']:.2f}x | {na(t and t['vs_bf16'], '.2f', 'x')} | {na(t and f8['host_us'] / t['host_us'], '.2f', 'x')} |"
        )
    print()
    if args.breakdown:
        for key in variants:
            ops, _, _, kernel_names, calls = counts[key]
            print(f"#### {' '.join(str(p) for p in key)}: dispatch ops {ops.total}")
            print(", ".join(f"{n} {c}" for n, c in ops.ops.most_common()))
            print(
                f"kernels {sum(kernel_names.values())}: " + ", ".join(f"{n} {c}" for n, c in kernel_names.most_common())
            )
            print(f"Python calls {calls.total}: " + ", ".join(f"{n} {c}" for n, c in calls.by_package.most_common()))
            print(f"library files {len(calls.files)}: " + ", ".join(f"{n} {c}" for n, c in calls.files.most_common()))
            print()
    if args.cast_region:
        cast_region(device, rounds, steps)
    spread = [r["spread"] for r in rows if r["spread"] == r["spread"]]
    if spread:
        print(
            f"largest spread of per-round medians: +-{100 * max(spread):.1f}% "
            f"(median {100 * statistics.median(spread):.1f}%)"
        )
    C.write_csv(args.csv, rows, env)


def cast_region(device: torch.device, rounds: int, steps: int) -> None:
    """One tensorwise cast at the tiny shape: eager reference ops vs a compiled region (vs
    the fused kernels on CUDA), host time per call in interleaved rounds."""
    from f8tensor import kernels
    from f8tensor.kernels import reference
    from f8tensor.quant.config import CastSpec
    from f8tensor.quant.scaling import inverse_scale_of

    spec = CastSpec(torch.float8_e4m3fn)
    x = torch.randn(TOKENS, 64, device=device, dtype=torch.bfloat16)

    def eager_cast():
        data, scale = reference.cast(x, spec)
        return data, scale, inverse_scale_of(scale)

    region = torch.compile(eager_cast, dynamic=True, fullgraph=True)
    calls = {"eager ops": eager_cast, "compiled region": region}
    if device.type == "cuda":
        calls["fused kernels"] = lambda: kernels.cast_for_gemm(x, spec)
    for call in calls.values():
        for _ in range(3):
            call()  # compile, warm up
    a, b = eager_cast()[0], region()[0]
    same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    timings = C.interleaved(calls, rounds, steps, device)
    print(f"### One tensorwise cast of x ({TOKENS}, 64) bf16 (data, scale, inverse): host time per call")
    print()
    print(
        C.markdown_table(
            ["mechanism", "us/call", "+-"],
            [[name, C.fmt(1e3 * t.median, 1), C.fmt(100 * t.spread, 1) + "%"] for name, t in timings.items()],
            numeric=[False, True, True],
        )
    )
    print()
    print(f"compiled region bitwise equal to the eager ops: {same}")
    print()


if __name__ == "__main__":
    main()
