"""Bytes per element of FP4 and FP8 storage, and what a Float8Linear saves for backward.

Exact counts (device independent): the weight as stored by each format (data, block
scales, NVFP4's tensor scale) and the bytes autograd keeps per input element in one
training forward under bf16 autocast (``f8tensor.stats.saved_tensor_bytes``).

    PYTHONPATH=. python benchmarks/bench_fp4_bytes.py
"""

from __future__ import annotations

import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig
from f8tensor.kernels.fp4 import FP4Spec
from f8tensor.stats import saved_tensor_bytes
from f8tensor.tensor.fp4 import to_float4

M, K, N = 512, 256, 256


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    w = torch.randn(N, K)
    print("weight bytes / element")
    for kind, block in (("nvfp4", (1, 16)), ("nvfp4", (16, 16)), ("mxfp4", (1, 32))):
        f = to_float4(w, FP4Spec(kind, block, 1))
        print(f"  {kind} {block}: {_nbytes(f._data, f._scale, f._global_scale) / (N * K):.4f}")
    x = torch.randn(M, K, requires_grad=True)
    print("saved bytes / input element (bf16 autocast)")
    for recipe in ("tensorwise", "rowwise", "mxfp8", "nvfp4", "mxfp4"):
        layer = Float8Linear.from_float(nn.Linear(K, N), Float8LinearConfig.from_recipe(recipe))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved, _ = saved_tensor_bytes(layer, lambda layer=layer: layer(x))
        print(f"  {recipe}: {saved / (M * K):.4f}")


if __name__ == "__main__":
    main()
