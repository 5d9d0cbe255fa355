"""The random Hadamard transform (RHT) of the weight-gradient GEMM's operands.

``grad_W = grad_y.t() @ x`` contracts over the tokens. An orthogonal matrix ``Q`` applied to
both operands along the tokens leaves the product unchanged in exact arithmetic,
``(Q g).t() @ (Q x) = g.t() @ Q.t() @ Q @ x = g.t() @ x``, while it spreads a few large tokens
over their neighbours, so a 16-block's scale no longer has to cover one outlier and the
small values around it survive the FP4 rounding. Here ``Q`` is block-diagonal with one
16x16 block ``H D`` per 16 tokens: ``H`` the Sylvester Hadamard matrix scaled by 1/4
(orthonormal), ``D`` a diagonal of random signs drawn from a seeded ``torch.Generator``
(the same signs every step, so the transform is a fixed rotation).
"""

from __future__ import annotations

import math

import torch

__all__ = ["RHT_SEED_MAX", "RHT_SIZE", "apply_rht", "check_rht_seed", "hadamard_matrix", "rht_matrix", "rht_signs"]

#: The transform's block along the tokens: NVFP4's block.
RHT_SIZE = 16
#: The largest seed: ``torch.Generator.manual_seed`` takes a uint64 (it also takes negative
#: ints down to ``-2**63``, read as ``seed + 2**64``: aliases, so they are refused here).
RHT_SEED_MAX = 2**64 - 1


def check_rht_seed(seed: object, name: str = "seed") -> None:
    """Raise unless ``seed`` is an int in ``[0, RHT_SEED_MAX]`` (``name``: how the message
    calls it, e.g. ``"Float8LinearConfig.hadamard_seed"``).

    Raises:
        TypeError: not an int (a bool is refused: ``True`` is no seed anyone means).
        ValueError: outside ``[0, 2**64 - 1]``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{name} must be an int in [0, 2**64 - 1]; got {seed!r}")
    if not 0 <= seed <= RHT_SEED_MAX:
        raise ValueError(
            f"{name} must be in [0, 2**64 - 1] (the seeds torch.Generator.manual_seed takes as distinct "
            f"states; a negative one would alias seed + 2**64); got {seed!r}"
        )


def hadamard_matrix(n: int = RHT_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix scaled to be orthonormal (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix has a power-of-two size; got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)


@torch.compiler.assume_constant_result
def rht_signs(seed: int, n: int = RHT_SIZE) -> tuple[float, ...]:
    """The transform's ``n`` random signs, drawn from ``torch.Generator().manual_seed(seed)``.

    A tuple of Python floats, a constant for ``torch.compile`` (the seed is a config field,
    so a compile guard): a generator cannot be made inside a compiled graph. ``seed``: an
    int in ``[0, 2**64 - 1]`` (:func:`check_rht_seed`)."""
    check_rht_seed(seed)
    bits = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tuple(2.0 * b - 1.0 for b in bits)


def rht_matrix(
    seed: int, n: int = RHT_SIZE, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``H @ diag(signs)`` (orthogonal), built in fp64 and rounded once to ``dtype``."""
    signs = torch.tensor(rht_signs(seed, n), dtype=torch.float64)
    return (hadamard_matrix(n, torch.float64) * signs).to(dtype).to(device)


def apply_rht(x: torch.Tensor, seed: int, dim: int = 0) -> torch.Tensor:
    """``x`` with the transform applied in blocks of 16 along ``dim`` (its size a multiple of
    16: pad with zeros first, which add nothing to the product).

    Deliberate fp32 output (fp64 for fp64 input): the values go straight into an FP4 cast,
    and rounding them to bf16 in between would add an error the transform is meant to remove."""
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % RHT_SIZE:
        raise ValueError(f"the Hadamard transform runs in blocks of {RHT_SIZE} along dim {dim}; got size {size}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = rht_matrix(seed, device=x.device, dtype=dtype)
    # Blocks along dim 0, contiguous: (n, 16, rest) so that Q multiplies from the left in one
    # batched matmul over contiguous 16 x rest slabs. ``rest`` spelled out, not -1: an empty
    # tensor (no tokens, or no features) has no size to infer it from.
    moved = x.to(dtype).movedim(dim, 0).contiguous()
    rest = math.prod(moved.shape[1:])
    blocks = moved.reshape(size // RHT_SIZE, RHT_SIZE, rest)
    out = torch.matmul(q, blocks)  # each 16-block b -> Q b
    return out.reshape(moved.shape).movedim(0, dim)
