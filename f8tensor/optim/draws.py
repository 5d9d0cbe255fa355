"""The seeded draws of :class:`f8tensor.optim.AdamW`'s stochastic roundings.

Element ``i`` draws entry ``i mod`` :data:`NOISE_PERIOD` of a uniform table seeded with
(parameter position, step, moment): a function of the seed and the global index only, so a
shard draws what one process draws and a resumed run repeats its draws.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NOISE_PERIOD", "noise_table", "noise_table_at", "seed", "uniform"]

#: The period of the stochastic-rounding draws along a tensor's flattened elements (a prime).
NOISE_PERIOD = 65537
_MASK32 = 0xFFFFFFFF


def _hash32(x: int) -> int:
    """A 32-bit integer mix (two rounds of multiply and xor-shift)."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def seed(param_index: int, step: int, moment: int) -> int:
    """The seed of one rounding; ``moment``: 0 ``exp_avg``, 1 ``exp_avg_sq``, 2 the bf16 parameter."""
    return _hash32(_hash32(_hash32(param_index) ^ step) ^ moment)


def noise_table(seed: int, device: torch.device) -> torch.Tensor:
    """The :data:`NOISE_PERIOD` uniform fp32 draws of ``seed`` (empty on the meta device)."""
    if device.type == "meta":
        return torch.empty(NOISE_PERIOD, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.rand(NOISE_PERIOD, generator=generator, device=device)


@torch.library.custom_op("f8tensor::adamw_noise_table", mutates_args=())
def _noise_table_op(step: torch.Tensor, param_index: int, moment: int, device: torch.device) -> torch.Tensor:
    # A 0-dim CPU counter: reading it is no device sync.
    return noise_table(seed(param_index, int(step.item()), moment), device)


@_noise_table_op.register_fake
def _(step, param_index, moment, device):
    return torch.empty(NOISE_PERIOD, dtype=torch.float32, device=device)


def noise_table_at(step: torch.Tensor, param_index: int, moment: int, device: torch.device) -> torch.Tensor:
    """:func:`noise_table` for the step counter ``step``, one op that torch.compile keeps whole."""
    return torch.ops.f8tensor.adamw_noise_table(step, param_index, moment, device)


def uniform(table: torch.Tensor, start: int | torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The draws of global flat elements ``start, start + 1, ...`` in ``shape``.

    Elements a (prime) period apart share a draw within a step; each element's draws over the
    steps are independent, as unbiased rounding needs.
    """
    n = math.prod(shape)
    if torch.compiler.is_compiling():
        if len(shape) == 2 and shape[1] <= NOISE_PERIOD:
            # Row r is one sliding window of the table: one contiguous load per row.
            width = shape[1]
            windows = torch.cat((table, table[: width - 1])).unfold(0, width, 1)
            rows = torch.arange(shape[0], device=table.device) * width + start
            return windows[torch.remainder(rows, NOISE_PERIOD)]
        index = torch.remainder(torch.arange(n, device=table.device) + start, NOISE_PERIOD)
        return table[index].reshape(shape)
    first = int(start) % NOISE_PERIOD
    reps = -(-(first + n) // NOISE_PERIOD)
    return table.repeat(reps)[first : first + n].reshape(shape)
