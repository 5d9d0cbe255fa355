"""The seeded draws of :class:`f8tensor.optim.AdamW`'s stochastic roundings.

Element ``i`` of a tensor draws entry ``i mod`` :data:`NOISE_PERIOD` of a table of uniform
fp32 numbers in ``[0, 1)`` that a generator seeded with ``(parameter position, step,
moment)`` fills (:func:`seed`, :func:`noise_table`). A draw is a function of the seed and
the element's global index only: a shard draws what one process draws at the same
elements, and a resumed run repeats its draws with nothing but the step counters saved.

Under ``torch.compile`` the table comes from a custom op (:func:`noise_table_at`) that reads
the step counter when the graph runs, so the step stays a tensor in the graph: no graph
break, and no recompilation as the step counts up.
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
    """The generator seed of one rounding: parameter position, step (after the increment)
    and moment (0: ``exp_avg``, 1: ``exp_avg_sq``, 2: the bf16 parameter)."""
    return _hash32(_hash32(_hash32(param_index) ^ step) ^ moment)


def noise_table(seed: int, device: torch.device) -> torch.Tensor:
    """The :data:`NOISE_PERIOD` uniform fp32 draws of ``seed`` (the fused kernel indexes
    it directly; :func:`uniform` lays it over a tensor's elements). On the meta device
    (shapes only, no generator there) an empty table."""
    if device.type == "meta":
        return torch.empty(NOISE_PERIOD, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.rand(NOISE_PERIOD, generator=generator, device=device)


@torch.library.custom_op("f8tensor::adamw_noise_table", mutates_args=())
def _noise_table_op(step: torch.Tensor, param_index: int, moment: int, device: torch.device) -> torch.Tensor:
    # The step counter is a 0-dim CPU tensor (as torch's optimizers keep it): reading it is
    # no device sync.
    return noise_table(seed(param_index, int(step.item()), moment), device)


@_noise_table_op.register_fake
def _(step, param_index, moment, device):
    return torch.empty(NOISE_PERIOD, dtype=torch.float32, device=device)


def noise_table_at(step: torch.Tensor, param_index: int, moment: int, device: torch.device) -> torch.Tensor:
    """:func:`noise_table` of :func:`seed` for the step counter ``step`` (a 0-dim CPU
    tensor), as one op that ``torch.compile`` keeps whole (it reads the counter when it
    runs; dynamo cannot trace a generator)."""
    return torch.ops.f8tensor.adamw_noise_table(step, param_index, moment, device)


def uniform(table: torch.Tensor, start: int | torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The draws of the elements ``start, start + 1, ...`` (global flat indices) of a tensor
    of ``shape``: element ``i`` reads ``table[i mod NOISE_PERIOD]``.

    Elements a period apart share a draw within a step (a prime period, so never along one
    column of a power-of-two width); each element's draws over the steps are independent,
    which is what unbiased rounding needs. Eager: the table repeated and sliced (one copy).
    Under ``torch.compile``: indices into the table, which inductor fuses into the rounding's
    loop (no copy): one per row of a 2-D shape, one per element of another (``start`` may be
    a 0-dim int64 tensor there, so a shard's offset is no constant to recompile for)."""
    n = math.prod(shape)
    if torch.compiler.is_compiling():
        if len(shape) == 2 and shape[1] <= NOISE_PERIOD:
            # Row r reads the table from (start + r * width) mod period on, wrapping once at
            # most: a row of the table's sliding windows (the table with its first width - 1
            # entries appended), picked by one remainder per row. The compiler loads each
            # row's draws as one contiguous run instead of one index per element.
            width = shape[1]
            windows = torch.cat((table, table[: width - 1])).unfold(0, width, 1)
            rows = torch.arange(shape[0], device=table.device) * width + start
            return windows[torch.remainder(rows, NOISE_PERIOD)]
        index = torch.remainder(torch.arange(n, device=table.device) + start, NOISE_PERIOD)
        return table[index].reshape(shape)
    first = int(start) % NOISE_PERIOD
    reps = -(-(first + n) // NOISE_PERIOD)
    return table.repeat(reps)[first : first + n].reshape(shape)
