"""Rowwise products with precise accumulation: the rowwise kernel or the post-scale route.

The rowwise recipes' backward GEMMs (grad_x, grad_W) accumulate precisely
(``use_fast_accum=False``) and write bf16. Two routes are legal on every supported build
(``f8tensor.gemm.set_precise_rowwise_route``):

- ``kernel`` (default): ``torch._scaled_mm`` with the per-row and per-column scales, the
  product written in bf16 by the kernel's epilogue;
- ``postscale``: the tensorwise kernel with unit scales and an fp32 output, then one
  elementwise pass ``acc * a_inv[:, None] * b_inv[None, :]`` that writes bf16: M*N*(4 + 4 + 2)
  bytes more than the kernel route, and one more kernel.

This script times one product ``a8 @ b8.t()`` per shape and route, eager and compiled, and
checks that both routes give the same product (SQNR between them). On CUDA it answers
which route is faster on that GPU and build; a CPU run (labelled CPU) only shows the
overhead of the extra pass, CPUs having no FP8 matrix units.

    python benchmarks/bench_routes.py --device cuda [--shapes 16384x8192x7168,...] [--modes eager,compiled]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch

from f8tensor import Float8Tensor, GemmConfig, float8_mm
from f8tensor import gemm as G

ROUTES = ("kernel", "postscale")
#: M x K x N of the products: a grad_x product of the cast-traffic shape, and the four
#: linears of a 8B-class transformer block at 16384 tokens (CUDA default).
CPU_SHAPES = "2048x1024x512"
CUDA_SHAPES = "2048x1024x512,16384x8192x1280,16384x1024x8192,16384x8192x7168,16384x3584x8192"
QUICK_SHAPES = "64x64x32"


def parse_shapes(text: str, parser) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"--shapes: each shape is MxKxN with positive integers; got {item!r}")
        m, k, n = (int(p) for p in parts)
        if k % 16 or n % 16:
            parser.error(f"--shapes: K and N must be multiples of 16 (torch._scaled_mm); got {item!r}")
        shapes.append((m, k, n))
    return shapes


def operands(m: int, k: int, n: int, device: torch.device) -> tuple[Float8Tensor, Float8Tensor]:
    """Rowwise e4m3 operands with precise accumulation: ``a`` (M, K) and ``b`` (K, N)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cfg = GemmConfig(use_fast_accum=False)
    a = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(device, torch.bfloat16)
    a8 = Float8Tensor.from_hp(a, granularity="rowwise", gemm_config=cfg)
    b8 = Float8Tensor.from_hp(w, granularity="rowwise", gemm_config=cfg).t()
    return a8, b8


def product(a8: Float8Tensor, b8: Float8Tensor) -> torch.Tensor:
    return float8_mm(a8, b8, out_dtype=torch.bfloat16)


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (ref.double() - out.double()).pow(2).mean()
    return math.inf if err == 0 else 10 * math.log10(ref.double().pow(2).mean() / err)


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__)
    parser.add_modes()
    parser.add_argument(
        "--shapes", default=None, help=f"MxKxN, comma-separated (default on CPU {CPU_SHAPES}; on CUDA {CUDA_SHAPES})"
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5, --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed calls per round (default 20, --quick 2)")
    args = parser.parse_args(argv)
    default = QUICK_SHAPES if args.quick else (CUDA_SHAPES if args.device.type == "cuda" else CPU_SHAPES)
    shapes = parse_shapes(args.shapes or default, parser)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (2 if args.quick else 20)
    if rounds < 1 or steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    if "compiled" in args.modes:
        C.setup_compile()
    env = C.environment(args.device, args.torchao_note)  # torchao has no such setting: no column
    C.print_environment(env, "Precise rowwise products: rowwise kernel vs post-scale route")
    previous = G.precise_rowwise_route()
    rows = []
    try:
        for m, k, n in shapes:
            a8, b8 = operands(m, k, n, args.device)
            torch._dynamo.reset()
            calls = {}
            for route in ROUTES:
                for mode in args.modes:
                    fn = torch.compile(product, fullgraph=True) if mode == "compiled" else product

                    def call(fn=fn, route=route, a8=a8, b8=b8):
                        # The route is read when a product is traced or run (a compiled
                        # product is guarded on it): set it for every call.
                        G.set_precise_rowwise_route(route)
                        return fn(a8, b8)

                    calls[route, mode] = call
            outs = {key: call() for key, call in calls.items()}  # warm-up: compiles each route once
            for call in calls.values():
                call()
            timings = C.interleaved(calls, rounds, steps, args.device)
            for mode in args.modes:
                base = timings["kernel", mode].median
                for route in ROUTES:
                    t = timings[route, mode]
                    rows.append(
                        {
                            "M": m,
                            "K": k,
                            "N": n,
                            "mode": mode,
                            "route": route,
                            "ms": t.median,
                            "spread": t.spread,
                            "tflops": 2 * m * k * n / (t.median * 1e-3) / 1e12,
                            "vs_kernel": t.median / base,
                            "sqnr_vs_kernel_db": sqnr_db(outs["kernel", mode], outs[route, mode]),
                        }
                    )
    finally:
        G.set_precise_rowwise_route(previous)
    where = "CUDA" if args.device.type == "cuda" else "CPU (no FP8 matrix units: overhead only)"
    print(
        f"### {where}: a8 @ b8.t(), rowwise e4m3 operands, precise accumulation, bf16 output; "
        f"median of {rounds} x {steps} calls"
    )
    print()
    headers = ["M x K x N", "mode", "route", "ms", "+-", "TFLOP/s", "time vs kernel route", "SQNR vs kernel route dB"]
    table = [
        [
            f"{r['M']}x{r['K']}x{r['N']}",
            r["mode"],
            r["route"],
            C.fmt(r["ms"], 3),
            "-" if math.isnan(r["spread"]) else C.fmt(100 * r["spread"], 1) + "%",
            C.fmt(r["tflops"], 1),
            C.fmt(r["vs_kernel"], 3),
            "same" if math.isinf(r["sqnr_vs_kernel_db"]) else C.fmt(r["sqnr_vs_kernel_db"], 1),
        ]
        for r in rows
    ]
    print(C.markdown_table(headers, table, numeric=[False, False, False, True, True, True, True, True]))
    C.write_csv(args.csv, rows, env)


if __name__ == "__main__":
    main()
