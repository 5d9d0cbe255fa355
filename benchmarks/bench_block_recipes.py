"""Block recipes next to the others: CPU step time of one Float8Linear and its saved bytes.

For each recipe (and bf16 ``nn.Linear``): the median time of ``layer(x).backward(g)``
(eager; bf16 weights and activations, no bias) over interleaved rounds, and the bytes
autograd saves for backward (``f8tensor.stats.saved_tensor_bytes``; exact, device
independent). CPU figures show the overhead around the GEMMs only: CPUs have no FP8 units,
and block-scaled products run on the reference path (dequantize per block, fp32 matmul).

    python benchmarks/bench_block_recipes.py                       # CPU, about a minute
    python benchmarks/bench_block_recipes.py --shape 2048x512x1792 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from _common import cpu_model  # benchmarks/_common.py (the script's own folder)
from torch import nn

from f8tensor import RECIPES, Float8Linear, Float8LinearConfig
from f8tensor.stats import saved_tensor_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048x512x512", help="MxKxN: tokens, in_features, out_features")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    m, k, n = (int(v) for v in args.shape.split("x"))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    layers = {"bf16 nn.Linear": ref}
    layers.update({r: Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig.from_recipe(r)) for r in RECIPES})
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, dtype=torch.bfloat16)

    def step(layer: nn.Module) -> None:
        layer(x).backward(g)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in layers}
    for layer in layers.values():
        step(layer)  # warm-up
    for _ in range(args.rounds):
        for name, layer in layers.items():  # interleaved: load falls on all alike
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(layer)
                times[name].append(time.perf_counter() - t0)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {cpu_model()}, {args.threads} thread(s)")
    print(f"One layer, x ({m}, {k}) bf16, weight ({n}, {k}) bf16, no bias; forward + backward, eager.\n")
    print("| layer | step (median) | vs bf16 | saved bytes | bytes / input element |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(times["bf16 nn.Linear"])
    for name, layer in layers.items():
        t = statistics.median(times[name])
        saved, y = saved_tensor_bytes(layer, lambda layer=layer: layer(x))
        del y
        print(f"| {name} | {t * 1e3:.1f} ms | {base / t:.2f}x | {saved:,} | {saved / (m * k):.4f} |")


if __name__ == "__main__":
    main()
