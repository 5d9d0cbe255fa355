"""What cast telemetry costs: training-step time with statistics off and on, eager and compiled.

Two measurements. (1) A stack of Float8Linear layers (ReLU between) runs forward +
backward (no optimizer, so the FP8 casts and GEMMs are all that is timed) for each recipe,
in eager mode and under ``torch.compile`` (inductor, fullgraph), with ``collect_stats``
off, on, and on with the dict read (``float8_stats``, one device sync) after every step.
(2) One cast alone, plain and measuring, since on CPU the emulated FP8 GEMMs dominate a
training step. Configurations are timed in interleaved rounds, so that load from other
processes falls on all of them alike; each figure is the median over all rounds.

    python benchmarks/bench_stats_overhead.py                 # CPU defaults, a few minutes
    python benchmarks/bench_stats_overhead.py --no-compile    # eager only, seconds

Prints a Markdown table (and the command, versions and CPU) for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
from _common import cpu_model  # benchmarks/_common.py (the script's own folder)
from torch import nn

from f8tensor import Float8LinearConfig, convert_to_float8_training, enable_float8_stats, float8_stats
from f8tensor.tensor import cast_to_float8, cast_to_float8_with_stats


def build(recipe: str, stats: bool, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(args.layers):
        layers.append(nn.Linear(args.hidden, args.hidden))
        if i < args.layers - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
    if stats:
        enable_float8_stats(model)
    return model


def cast_table(args: argparse.Namespace) -> list[str]:
    """One tensorwise dynamic e4m3 cast of an fp32 tensor, with and without its statistics."""
    rows, cols = (int(v) for v in args.cast_shape.split(","))
    x = torch.randn(rows, cols)

    def off(t):
        f8 = cast_to_float8(t, torch.float8_e4m3fn)
        return f8._data, f8._scale

    def on(t):
        f8, stats = cast_to_float8_with_stats(t, torch.float8_e4m3fn)
        return f8._data, f8._scale, stats

    fns = {("eager", "off"): off, ("eager", "on"): on}
    if not args.no_compile:
        fns["compiled", "off"] = torch.compile(off, fullgraph=True)
        fns["compiled", "on"] = torch.compile(on, fullgraph=True)
    for fn in fns.values():
        for _ in range(3):
            fn(x)
    times: dict[tuple, list[float]] = {key: [] for key in fns}
    for _ in range(args.rounds):
        for key, fn in fns.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                fn(x)
                times[key].append(time.perf_counter() - start)
    lines = [
        f"\nOne cast, fp32 ({rows}, {cols}) -> e4m3fn, tensorwise dynamic scale; median of {args.rounds * args.steps}:\n",
        "| mode | stats off (us) | stats on (us) | overhead |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode in ("eager", "compiled"):
        if (mode, "off") in times:
            a, b = (statistics.median(times[mode, v]) * 1e6 for v in ("off", "on"))
            lines.append(f"| {mode} | {a:.0f} | {b:.0f} | {100 * (b / a - 1):+.1f}% |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default="tensorwise,delayed")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--cast-shape", default="1024,1024", help="shape of the single-cast measurement")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    variants = ["off", "on", "on + read"]
    configs = {}
    compile_s = {}
    x = torch.randn(args.batch, args.hidden)
    for recipe in args.recipes.split(","):
        for mode in modes:
            for variant in variants:
                model = build(recipe, variant != "off", args)
                run = torch.compile(model, fullgraph=True) if mode == "compiled" else model
                read = variant == "on + read"

                def step(run=run, model=model, read=read):
                    run(x).sum().backward()
                    if read:
                        float8_stats(model)

                start = time.perf_counter()
                for _ in range(3):  # compile (when compiled) and warm up
                    step()
                compile_s[recipe, mode, variant] = time.perf_counter() - start
                configs[recipe, mode, variant] = step

    times: dict[tuple, list[float]] = {key: [] for key in configs}
    for _ in range(args.rounds):
        for key, step in configs.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times[key].append(time.perf_counter() - start)

    cmd = "python " + " ".join(sys.argv)
    print(f"command: `{cmd}`")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, CPU: {cpu_model()}, "
        f"{args.threads} thread(s); Float8Linear x{args.layers} ({args.hidden} -> {args.hidden}), "
        f"batch {args.batch}; forward + backward; median of {args.rounds * args.steps} steps\n"
    )
    print("| recipe | mode | stats off (ms) | stats on (ms) | overhead | on + read every step (ms) | overhead |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for recipe in args.recipes.split(","):
        for mode in modes:
            off, on, on_read = (statistics.median(times[recipe, mode, v]) * 1e3 for v in variants)
            print(
                f"| {recipe} | {mode} | {off:.3f} | {on:.3f} | {100 * (on / off - 1):+.1f}% "
                f"| {on_read:.3f} | {100 * (on_read / off - 1):+.1f}% |"
            )
    print("\n".join(cast_table(args)))
    for recipe in args.recipes.split(","):
        model = build(recipe, True, args)
        model(x).sum().backward()
        reads = []
        for _ in range(200):
            start = time.perf_counter()
            n_keys = len(float8_stats(model))
            reads.append(time.perf_counter() - start)
        print(f"\nfloat8_stats(model), {recipe}, {n_keys} keys: median {statistics.median(reads) * 1e6:.0f} us")
    if not args.no_compile:
        print(
            "\nfirst 3 steps incl. compile (s; inductor's caches speed up later, similar graphs): "
            + ", ".join(
                f"{r}/{v}: {compile_s[r, 'compiled', v]:.1f}" for r in args.recipes.split(",") for v in variants
            )
        )


if __name__ == "__main__":
    main()
