"""Linear microbenchmark: forward + backward of Float8Linear against bf16 nn.Linear and torchao.float8.

For each shape (M tokens, K in_features, N out_features; bf16 weights and activations, no
bias, as in LLaMA's projections) and each variant (bf16 ``nn.Linear``, every f8tensor
recipe, and torchao.float8's recipes when torchao is installed), eager and compiled
(``torch.compile(layer, dynamic=False)``, inductor), one step is
``layer(x).backward(grad)`` with gradients reset. Reported: the median step time, its
spread over rounds, the speed-up against bf16 in the same mode, and the GEMM ceiling:

- GEMM ceiling: the three GEMMs of a step (forward ``x @ W.t()``, ``grad_x = g @ W``,
  ``grad_W = g.t() @ x``) timed alone, with ``torch._scaled_mm`` on operands already in
  FP8 and in the layouts f8tensor hands it (A row-major, B column-major; tensorwise 0-dim
  or rowwise (M, 1) x (1, N) inverse scales; fast accumulation in forward only), against
  bf16 ``torch.mm`` on the layouts nn.Linear uses. ``rowwise_with_gw_hp`` keeps its
  weight-gradient GEMM in bf16. ceiling = bf16 GEMM time / FP8 GEMM time: what the
  linear would reach if casts, scales and layout copies were free.
- fraction of ceiling = linear speed-up / GEMM ceiling.

Shapes: ``llama`` (LLaMA-3-8B projections, M = 4096, 8192, 16384 tokens, K and N from
{4096, 14336, 1024}: q/o 4096->4096, k/v 4096->1024, gate/up 4096->14336, down
14336->4096), ``small`` (where FP8 loses: casts cost as much as the GEMM saves), ``cpu``
(the LLaMA proportions at 1/8 of K and N, M = 2048, plus one small shape: the CPU's
``_scaled_mm`` emulates FP8 in software and is far too slow for the full sizes), ``quick``
(a smoke test), or explicit ``MxKxN`` items. Default: ``llama,small`` on CUDA, ``cpu`` on CPU.

    python benchmarks/bench_linear.py                              # CUDA: LLaMA sweep; CPU: cpu preset
    python benchmarks/bench_linear.py --shapes 16384x4096x14336 --recipes tensorwise,rowwise
    python benchmarks/bench_linear.py --quick --csv linear.csv
    python benchmarks/bench_linear.py --shapes 16384x4096x14336 --recipes tensorwise --profile traces/
"""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch
from torch import nn

from f8tensor import compat

SHAPE_PRESETS: dict[str, list[tuple[int, int, int]]] = {
    "llama": [
        (m, k, n) for m in (4096, 8192, 16384) for k, n in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
    ],
    "small": [(1024, 1024, 1024), (4096, 512, 512), (512, 4096, 4096)],
    "cpu": [(2048, 512, 512), (2048, 512, 128), (2048, 512, 1792), (2048, 1792, 512), (256, 256, 256)],
    "quick": [(64, 64, 128)],
}

#: Per GEMM of a step: (name, operand shapes), for a linear with input (M, K) and weight (N, K).
GEMMS = ("forward", "grad_input", "grad_weight")
#: Which FP8 GEMM kind each recipe runs for (forward, grad_input, grad_weight); "bf16" stays high precision.
RECIPE_GEMMS = {
    "tensorwise": ("tensorwise", "tensorwise", "tensorwise"),
    "delayed": ("tensorwise", "tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise", "rowwise"),
    "rowwise_with_gw_hp": ("rowwise", "rowwise", "bf16"),
}


def parse_shapes(value: str, parser) -> list[tuple[int, int, int]]:
    shapes: list[tuple[int, int, int]] = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        if item in SHAPE_PRESETS:
            shapes += SHAPE_PRESETS[item]
            continue
        parts = item.lower().split("x")
        try:
            m, k, n = (int(p) for p in parts)
        except ValueError:
            parser.error(
                f"--shapes: {item!r} is neither a preset ({', '.join(SHAPE_PRESETS)}) nor MxKxN (e.g. 16384x4096x14336)"
            )
        if min(m, k, n) < 1 or k % 16 or n % 16:
            parser.error(
                f"--shapes: {item!r}: K and N must be positive multiples of 16 (torch._scaled_mm's rule), M positive"
            )
        shapes.append((m, k, n))
    if not shapes:
        parser.error("--shapes: no shapes given")
    return list(dict.fromkeys(shapes))


# ===================================================================== GEMM ceiling


def gemm_steps(m: int, k: int, n: int, device: torch.device) -> dict[tuple[str, str], callable]:
    """``{(kind, gemm): fn}`` for kind in bf16 / tensorwise / rowwise and the three GEMMs."""
    bf16 = torch.bfloat16
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.randn(m, k, dtype=bf16, device=device)
    w = torch.randn(n, k, dtype=bf16, device=device)
    g = torch.randn(m, n, dtype=bf16, device=device)
    one = torch.ones((), device=device)

    def f8(t: torch.Tensor, dtype: torch.dtype, col_major: bool = False) -> torch.Tensor:
        t = t.float().clamp(-200, 200).to(dtype)
        return t.t().contiguous().t() if col_major else t.contiguous()

    # Operands as f8tensor passes them to _scaled_mm: A row-major, B column-major.
    x8_a = f8(x, e4m3)  # forward A (M, K)
    w8_t = f8(w, e4m3).t()  # forward B: W.t() (K, N), column-major as W is row-major
    w8_b = f8(w, e4m3, col_major=True)  # grad_input B: W (N, K), column-major (f8tensor copies it so)
    x8_b = f8(x, e4m3, col_major=True)  # grad_weight B: x (M, K), column-major
    out = {}
    for kind, go_dtype in (("tensorwise", e5m2), ("rowwise", e4m3)):
        g8_a = f8(g, go_dtype)  # grad_input A (M, N)
        gt8_a = f8(g.t(), go_dtype)  # grad_weight A: g.t() (N, M), row-major
        rowwise = kind == "rowwise"

        def scales(rows: int, cols: int, rowwise=rowwise):
            if not rowwise:
                return one, one
            return torch.ones(rows, 1, device=device), torch.ones(1, cols, device=device)

        s_fwd, s_gx, s_gw = scales(m, n), scales(m, k), scales(n, k)
        # Through f8tensor's compat: torch._scaled_mm, and on a CPU without a rowwise kernel
        # (torch 2.11) its per-tensor kernel with the scales after.
        out[kind, "forward"] = lambda a=x8_a, b=w8_t, s=s_fwd: compat.scaled_mm(
            a, b, s[0], s[1], out_dtype=bf16, use_fast_accum=True
        )
        out[kind, "grad_input"] = lambda a=g8_a, b=w8_b, s=s_gx: compat.scaled_mm(a, b, s[0], s[1], out_dtype=bf16)
        out[kind, "grad_weight"] = lambda a=gt8_a, b=x8_b, s=s_gw: compat.scaled_mm(a, b, s[0], s[1], out_dtype=bf16)
    # bf16 on the layouts nn.Linear's forward and backward use.
    out["bf16", "forward"] = lambda: torch.mm(x, w.t())
    out["bf16", "grad_input"] = lambda: torch.mm(g, w)
    out["bf16", "grad_weight"] = lambda: torch.mm(g.t(), x)
    return out


def ceiling(gemm_ms: dict[tuple[str, str], float], recipe: str) -> float:
    bf16 = sum(gemm_ms["bf16", gm] for gm in GEMMS)
    fp8 = sum(gemm_ms[kind, gm] for kind, gm in zip(RECIPE_GEMMS[recipe], GEMMS))
    return bf16 / fp8


# ===================================================================== linear


def linear_step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    return step


def bench_shape(shape, args, progress: C.Progress) -> tuple[list[dict], list[dict]]:
    m, k, n = shape
    device = args.device
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.randn(m, n, dtype=torch.bfloat16, device=device)

    steps: dict[tuple, callable] = {}
    compile_s: dict[tuple, float] = {}
    for variant in C.variants(args):
        layer = variant.convert(copy.deepcopy(ref), args.torchao)
        for mode in args.modes:
            progress.update(f"{m}x{k}x{n} warm-up: {variant.name} {mode}")
            run = torch.compile(layer, dynamic=False) if mode == "compiled" else layer
            step = linear_step(run, x, grad)
            t0 = time.perf_counter()
            for _ in range(args.warmup + (2 if mode == "compiled" else 0)):
                step()
            C.sync(device)
            compile_s[variant, mode] = time.perf_counter() - t0
            steps["linear", variant, mode] = step
    if not args.no_gemm:
        for key, fn in gemm_steps(m, k, n, device).items():
            for _ in range(args.warmup):
                fn()
            steps[("gemm",) + key] = fn

    timings = C.interleaved(steps, args.rounds, args.steps, device)
    if args.profile:
        for key, step in steps.items():
            if key[0] == "linear":
                C.profile_steps(step, device, args.profile, f"{m}x{k}x{n} {key[1].name} {key[2]}")
    gemm_ms = {key[1:]: t.median for key, t in timings.items() if key[0] == "gemm"}
    base = {mode: timings["linear", C.Variant("bf16", ""), mode].median for mode in args.modes}
    rows = []
    for key, t in timings.items():
        if key[0] != "linear":
            continue
        _, variant, mode = key
        speedup = base[mode] / t.median
        ceil = ceiling(gemm_ms, variant.recipe) if variant.recipe and gemm_ms else float("nan")
        rows.append(
            {
                "M": m,
                "K": k,
                "N": n,
                "library": variant.library,
                "recipe": variant.recipe or "-",
                "mode": mode,
                "ms": t.median,
                "spread": t.spread,
                "speedup_vs_bf16": speedup,
                "gemm_ceiling": ceil,
                "fraction_of_ceiling": speedup / ceil,
                "warmup_s": compile_s[variant, mode],
                "steps": len(t.all),
            }
        )
    gemm_rows = []
    if gemm_ms:
        for gm in GEMMS:
            row = {"M": m, "K": k, "N": n, "gemm": gm, "bf16_ms": gemm_ms["bf16", gm]}
            for kind in ("tensorwise", "rowwise"):
                row[f"{kind}_ms"] = gemm_ms[kind, gm]
                row[f"{kind}_speedup"] = gemm_ms["bf16", gm] / gemm_ms[kind, gm]
            gemm_rows.append(row)
    return rows, gemm_rows


def print_tables(shape, rows: list[dict], gemm_rows: list[dict]) -> None:
    m, k, n = shape
    print(f"### M={m}, K={k}, N={n}: input ({m}, {k}) bf16, weight ({n}, {k}) bf16, forward + backward")
    print()
    table = []
    for r in rows:
        name = "bf16 nn.Linear" if r["library"] == "bf16" else f"{r['library']} {r['recipe']}"
        table.append(
            [
                name,
                r["mode"],
                r["ms"],
                "-" if math.isnan(r["spread"]) else f"±{100 * r['spread']:.0f}%",
                f"{r['speedup_vs_bf16']:.2f}x",
                "-" if r["library"] == "bf16" or math.isnan(r["gemm_ceiling"]) else f"{r['gemm_ceiling']:.2f}x",
                "-"
                if r["library"] == "bf16" or math.isnan(r["gemm_ceiling"])
                else f"{100 * r['fraction_of_ceiling']:.0f}%",
            ]
        )
    print(
        C.markdown_table(
            ["layer", "mode", "ms", "spread", "speed-up vs bf16", "GEMM ceiling", "fraction of ceiling"],
            table,
            numeric=[False, False, True, True, True, True, True],
        )
    )
    print()
    if gemm_rows:
        print(f"GEMMs alone (M={m}, K={k}, N={n}): bf16 torch.mm vs torch._scaled_mm on FP8 operands")
        print()
        print(
            C.markdown_table(
                ["GEMM", "bf16 ms", "FP8 tensorwise ms", "speed-up", "FP8 rowwise ms", "speed-up"],
                [
                    [
                        g["gemm"],
                        g["bf16_ms"],
                        g["tensorwise_ms"],
                        f"{g['tensorwise_speedup']:.2f}x",
                        g["rowwise_ms"],
                        f"{g['rowwise_speedup']:.2f}x",
                    ]
                    for g in gemm_rows
                ],
                numeric=[False, True, True, True, True, True],
            )
        )
        print()


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__)
    parser.add_modes()
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated presets ({', '.join(SHAPE_PRESETS)}) and/or MxKxN items; "
        "default: llama,small on CUDA, cpu on CPU, quick with --quick",
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration (compiled: +2)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration and round")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM-only ceiling")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="after timing, profile 3 steps of each configuration: print the top kernels/ops "
        "by self time and write a Chrome trace per configuration into DIR",
    )
    args = parser.parse_args(argv)
    cuda = args.device.type == "cuda"
    default_shapes = "quick" if args.quick else ("llama,small" if cuda else "cpu")
    shapes = parse_shapes(args.shapes or default_shapes, parser)
    defaults = (1, 2, 1) if args.quick else ((5, 5, 10) if cuda else (2, 3, 3))
    args.warmup = defaults[0] if args.warmup is None else args.warmup
    args.rounds = defaults[1] if args.rounds is None else args.rounds
    args.steps = defaults[2] if args.steps is None else args.steps
    for flag in ("warmup", "rounds", "steps"):
        if getattr(args, flag) < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} must be >= {0 if flag == 'warmup' else 1}; got {getattr(args, flag)}")
    if "compiled" in args.modes:
        C.setup_compile()

    env = C.environment(args.device, args.torchao_note)
    C.print_environment(env, "Linear forward + backward: f8tensor vs bf16 vs torchao.float8")
    print(
        f"{len(shapes)} shape(s); timing: {args.rounds} interleaved rounds x {args.steps} steps after "
        f"{args.warmup} warm-up steps; figures are medians, spread = half the range of the per-round medians; "
        "speed-up = bf16 ms / ms in the same mode (above 1: faster than bf16)"
    )
    print()
    n_configs = len(C.variants(args)) * len(args.modes)
    progress = C.Progress(len(shapes) * n_configs, "bench_linear")
    all_rows, all_gemm = [], []
    for shape in shapes:
        rows, gemm_rows = bench_shape(shape, args, progress)
        print_tables(shape, rows, gemm_rows)
        sys.stdout.flush()
        all_rows += [{"table": "linear", **r} for r in rows]
        all_gemm += [{"table": "gemm", **g} for g in gemm_rows]
    progress.close()
    C.write_csv(args.csv, all_rows + all_gemm, env)


if __name__ == "__main__":
    main()
