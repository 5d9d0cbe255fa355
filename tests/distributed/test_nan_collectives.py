"""Amax all-reduces keep a NaN that one rank holds (a MAX collective may drop it).

The scale of a tensor one process casts is NaN when the tensor holds a NaN; the ranks of a
tensor-parallel input or a delayed layer's history must agree on the same NaN, never on a
finite amax that would turn the NaN rank's values into finite garbage.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import free_port, init_gloo, run_processes

from f8tensor.compat import functional_all_reduce_max

pytestmark = pytest.mark.distributed

# Per rank: the local amaxes, and what every rank must get back.
CASES = [
    ([1.0], [float("nan")], [float("nan")]),  # the NaN on the higher rank (gloo dropped it)
    ([float("nan")], [1.0], [float("nan")]),
    ([float("inf")], [2.0], [float("inf")]),  # inf stays inf, is not made NaN
    ([3.0, 0.0, float("nan")], [1.0, float("nan"), 2.0], [3.0, float("nan"), float("nan")]),
    ([0.5, 7.0], [4.0, 1.0], [4.0, 7.0]),
]


def _worker(rank: int, port: int) -> None:
    init_gloo(rank, 2, port)
    try:
        group = torch.distributed.group.WORLD
        for index, (r0, r1, want) in enumerate(CASES):
            local = torch.tensor(r0 if rank == 0 else r1, dtype=torch.float32)
            got = functional_all_reduce_max(local, group)
            got = got.wait() if hasattr(got, "wait") else got
            for g, w in zip(got.tolist(), want):
                ok = math.isnan(g) if math.isnan(w) else g == w
                assert ok, f"case {index}, rank {rank}: got {got.tolist()}, want {want}"
            # 0-dim amaxes (the tensorwise case) keep their shape.
            scalar = functional_all_reduce_max(local[0], group)
            assert scalar.shape == ()
    finally:
        torch.distributed.destroy_process_group()


def test_all_reduce_max_keeps_nan_from_any_rank():
    run_processes(_worker, 2, (free_port(),), timeout_s=180)
