"""The block definition of each recipe's casts, written in plain torch from the recipes'
definition (not from f8tensor's cast or ``CastConfig.operand_spec``): the independent
reference that the orientation, tensor-parallel and FSDP2 tests compare f8tensor's operands
with. See tests/gemm/test_operand_orientation.py for the operand conventions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu

# The recipes as their definition states them, per role: (granularity, FP8 dtype, e8m0
# scales). A granularity is "T" (tensorwise), "R" (rowwise) or a (rows, contracted) block.
RECIPES = {
    "tensorwise": {"input": ("T", E4M3, False), "weight": ("T", E4M3, False), "grad_output": ("T", E5M2, False)},
    "rowwise": {r: ("R", E4M3, False) for r in ("input", "weight", "grad_output")},
    "rowwise_with_gw_hp": {r: ("R", E4M3, False) for r in ("input", "weight", "grad_output")},
    "blockwise": {
        "input": ((1, 128), E4M3, False),
        "weight": ((128, 128), E4M3, False),
        "grad_output": ((1, 128), E4M3, False),
    },
    "mxfp8": {r: ((1, 32), E4M3, True) for r in ("input", "weight", "grad_output")},
}
# Which role's granularity each operand of each GEMM has, and whether it is A or B.
GEMMS = {
    "output": (("input", "A"), ("weight", "B")),
    "grad_input": (("grad_output", "A"), ("weight", "B")),
    "grad_weight": (("grad_output", "A"), ("input", "B")),
}


def spiky(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Noise of size ~0.01 and, in every 32x32 tile, one spike of its own magnitude
    (2**0 .. 2**12, random sign) at a random place."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 0.01
    rows, cols = shape
    for r0 in range(0, rows, 32):
        for c0 in range(0, cols, 32):
            r = r0 + int(torch.randint(0, min(32, rows - r0), (1,), generator=gen))
            c = c0 + int(torch.randint(0, min(32, cols - c0), (1,), generator=gen))
            sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
            x[r, c] = sign * 2.0 ** float(torch.randint(0, 13, (), generator=gen))
    return x


def operand_block(gran, side: str) -> tuple[int, ...]:
    """The per-dim block of operand A (M, K) or B (K, N) for a (rows, contracted)
    granularity: 0 = the whole dim shares a scale, () = one scale for the tensor."""
    if gran == "T":
        return ()
    if gran == "R":
        return (1, 0) if side == "A" else (0, 1)
    rows, contracted = gran
    return (rows, contracted) if side == "A" else (contracted, rows)


def ref_cast(hp: torch.Tensor, block: tuple[int, ...], f8: torch.dtype, e8m0: bool):
    """The cast, from the definition: (FP8 data, fp32 scale, fp32 dequantized values).
    ``scale`` is the multiplier hp -> data: ``fp8_max / amax`` per block (e8m0: the largest
    power of two not above it), one entry per block along each dim."""
    x = hp.float()
    fmax = torch.finfo(f8).max
    if not block:
        amax = x.abs().amax()
        grid = (1, 1)
        bm, bn = x.shape
    else:
        bm = x.shape[0] if block[0] == 0 else block[0]
        bn = x.shape[1] if block[1] == 0 else block[1]
        grid = (math.ceil(x.shape[0] / bm), math.ceil(x.shape[1] / bn))
        padded = F.pad(x.abs(), (0, grid[1] * bn - x.shape[1], 0, grid[0] * bm - x.shape[0]))
        amax = padded.reshape(grid[0], bm, grid[1], bn).amax(dim=(1, 3))
    if e8m0:
        mantissa, exponent = torch.frexp(
            torch.full_like(amax, fmax, dtype=torch.float64) / amax.double()
        )  # fmax / amax = m * 2**e, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(mantissa), exponent - 1).float()
    else:
        # fp32 division, correctly rounded (``fmax / amax`` would be ``amax.reciprocal() * fmax``:
        # two roundings).
        scale = torch.full_like(amax, fmax) / amax
    full = scale.reshape(grid).repeat_interleave(bm, 0).repeat_interleave(bn, 1)[: x.shape[0], : x.shape[1]]
    data = (x * full).clamp(-fmax, fmax).to(f8)
    return data, scale, data.float() / full
