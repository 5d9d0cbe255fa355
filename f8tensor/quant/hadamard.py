"""The random Hadamard transform (RHT) of the weight-gradient GEMM's operands.

An orthogonal ``Q`` (a fixed, seeded ``H D`` per 16 tokens) on both operands leaves
``grad_W`` unchanged while spreading outliers over their block.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RHT_SEED_MAX", "RHT_SIZE", "apply_rht", "check_rht_seed", "hadamard_matrix", "rht_matrix", "rht_signs"]

#: The transform's block along the tokens: NVFP4's block.
RHT_SIZE = 16
#: The largest seed (uint64).
RHT_SEED_MAX = 2**64 - 1


def check_rht_seed(seed: object, name: str = "seed") -> None:
    """Raise unless ``seed`` is an int in ``[0, RHT_SEED_MAX]``.

    Raises:
        TypeError: not an int (bools too).
        ValueError: out of range.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name} must be an int in [0, 2**64 - 1]; got {seed!r}")
    if not 0 <= seed <= RHT_SEED_MAX:
        raise ValueError(
            f"{name} must be in [0, 2**64 - 1] (the seeds torch.Generator.manual_seed takes as distinct "
            f"states; a negative one would alias seed + 2**64); got {seed!r}"
        )


def hadamard_matrix(n: int = RHT_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal n x n Sylvester Hadamard matrix (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix has a power-of-two size; got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)


@torch.compiler.assume_constant_result
def rht_signs(seed: int, n: int = RHT_SIZE) -> tuple[float, ...]:
    """The ``n`` random signs of ``seed``, as a compile constant (no generator in a graph)."""
    check_rht_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tuple(2.0 * b - 1.0 for b in bits)


def rht_matrix(
    seed: int, n: int = RHT_SIZE, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``H @ diag(signs)``, built in fp64 and rounded once to ``dtype``."""
    signs = torch.tensor(rht_signs(seed, n), dtype=torch.float64)
    return (hadamard_matrix(n, torch.float64) * signs).to(dtype).to(device)


def apply_rht(x: torch.Tensor, seed: int, dim: int = 0) -> torch.Tensor:
    """``x`` transformed in blocks of 16 along ``dim``; fp32 out (fp64 for fp64), deliberately."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % RHT_SIZE:
        raise ValueError(f"the Hadamard transform runs in blocks of {RHT_SIZE} along dim {dim}; got size {size}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = rht_matrix(seed, device=x.device, dtype=dtype)
    # Not -1: an empty tensor has no size to infer.
    moved = x.to(dtype).movedim(dim, 0).contiguous()
    rest = math.prod(moved.shape[1:])
    blocks = moved.reshape(size // RHT_SIZE, RHT_SIZE, rest)
    out = torch.matmul(q, blocks)  # each 16-block b -> Q b
    return out.reshape(moved.shape).movedim(0, dim)
