"""Forward+backward step time of one Float8Linear per recipe against bf16 nn.Linear, on CPU.

CPUs have no FP8 matrix units: ``torch._scaled_mm`` on CPU widens the FP8 operands and
multiplies in higher precision, so these figures show the *overhead* of the FP8 path
(casts, scales, layout copies, the CPU FP8 GEMM), not the speed-up FP8 brings on a GPU.
Eager and ``torch.compile`` (inductor, fullgraph) are both measured. One thread by
default, so that figures taken on a shared machine mean something.

    python benchmarks/bench_linear_cpu.py [--shapes 16x256x512x512 8x256x1024x1024] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch._dynamo
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")


def cpu_name() -> str:
    """``lscpu``'s model name (falls back to the platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.machine()


def step_ms(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int) -> float:
    """Median wall time (ms) of ``layer(x).backward(grad)``; gradients are reset each step."""

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_shape(
    batch: int, seq: int, k: int, n: int, warmup: int, iters: int, compile: bool = True
) -> list[tuple[str, float, float]]:
    """``[(name, eager ms, compiled ms)]`` for bf16 nn.Linear and each recipe (NaN: not compiled)."""
    torch.manual_seed(0)
    ref = nn.Linear(k, n, dtype=torch.bfloat16)
    x = torch.randn(batch, seq, k, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, seq, n, dtype=torch.bfloat16)
    layers = {"bf16 nn.Linear": ref}
    for recipe in RECIPES:
        layers[recipe] = Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig.from_recipe(recipe))
    rows = []
    for name, layer in layers.items():
        eager = step_ms(layer, x, grad, warmup, iters)
        if not compile:
            rows.append((name, eager, float("nan")))
            continue
        torch._dynamo.reset()
        compiled_layer = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=False)
        compiled = step_ms(compiled_layer, x, grad, warmup + 2, iters)  # the first calls compile
        rows.append((name, eager, compiled))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", nargs="+", default=["16x256x512x512", "8x256x1024x1024"], help="BATCHxSEQxINxOUT, input (BATCH, SEQ, IN)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"# CPU: {cpu_name()}, {args.threads} thread(s); torch {torch.__version__}; Python {platform.python_version()}")
    print(f"# command: python {' '.join(sys.argv)}")
    print("# forward+backward of one layer, median of", args.iters, "steps; bf16 weights and activations")
    print("# CPU has no FP8 hardware: ratios > 1 are the FP8 path's overhead, not a GPU prediction")
    for shape in args.shapes:
        batch, seq, k, n = (int(v) for v in shape.split("x"))
        rows = bench_shape(batch, seq, k, n, args.warmup, args.iters, compile=not args.no_compile)
        base_eager, base_compiled = rows[0][1], rows[0][2]
        print()
        print(f"input ({batch}, {seq}, {k}) -> {n}  (M={batch * seq}, K={k}, N={n})")
        print()
        print("| layer | eager ms | vs bf16 eager | compiled ms | vs bf16 compiled |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, eager, compiled in rows:
            print(f"| {name} | {eager:.2f} | {eager / base_eager:.2f}x | {compiled:.2f} | {compiled / base_compiled:.2f}x |")


if __name__ == "__main__":
    main()
