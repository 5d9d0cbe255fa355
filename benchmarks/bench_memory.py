"""Saved-for-backward bytes of one linear layer: each FP8 recipe against bf16 ``nn.Linear``.

Counts what autograd keeps between forward and backward (``saved_tensors_hooks``), leaving
out the parameters themselves (their storage exists anyway). A Float8Tensor counts its FP8
``_data`` and fp32 ``_scale``. Byte counts are exact and device independent; measured on
CPU here. ``tests/test_memory.py`` asserts the same numbers through :func:`saved_bytes`.

    python benchmarks/bench_memory.py [--batch 4 --seq 1024 --in-features 4096 --out-features 4096]
"""

from __future__ import annotations

import argparse
import copy
import platform
import subprocess
from collections.abc import Callable

import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig, Float8Tensor

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")


def saved_bytes(module: nn.Module, fn: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Run ``fn()`` (a forward of ``module``) and return the bytes autograd saved for backward.

    Storages are counted once each (two views of one tensor keep one storage alive);
    storages of ``module``'s parameters are left out.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        parts = (t._data, t._scale) if isinstance(t, Float8Tensor) else (t,)
        for part in parts:
            storage = part.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in param_storages or ptr in seen:
                continue
            seen.add(ptr)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def measure(batch: int, seq: int, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, int]]:
    """``[(name, saved bytes)]`` for ``nn.Linear`` and each recipe, one forward on a 3D input."""
    torch.manual_seed(0)
    ref = nn.Linear(in_features, out_features, dtype=dtype)
    x = torch.randn(batch, seq, in_features, dtype=dtype, requires_grad=True)
    rows = [("nn.Linear", saved_bytes(ref, lambda: ref(x))[0])]
    for recipe in RECIPES:
        layer = Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig.from_recipe(recipe))
        rows.append((recipe, saved_bytes(layer, lambda layer=layer: layer(x))[0]))
    return rows


def cpu_name() -> str:
    """``lscpu``'s model name (falls back to the platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--out-features", type=int, default=4096)
    args = parser.parse_args()

    dtype = torch.bfloat16
    rows = measure(args.batch, args.seq, args.in_features, args.out_features, dtype)
    elements = args.batch * args.seq * args.in_features
    base = rows[0][1]
    print(f"# saved-for-backward bytes, one linear layer forward, CPU ({cpu_name()})")
    print(f"# torch {torch.__version__}; model dtype {dtype}; input ({args.batch}, {args.seq}, {args.in_features}); "
          f"weight ({args.out_features}, {args.in_features}); parameters not counted")
    print()
    print("| layer | saved bytes | bytes / input element | vs bf16 nn.Linear |")
    print("| --- | ---: | ---: | ---: |")
    for name, nbytes in rows:
        print(f"| {name} | {nbytes:,} | {nbytes / elements:.4f} | {nbytes / base:.3f}x |")


if __name__ == "__main__":
    main()
