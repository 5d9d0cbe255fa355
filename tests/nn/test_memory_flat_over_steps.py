"""300 training steps per recipe on a tiny layer: after warm-up, neither resident memory nor
the count of live tensors grows (within 5 %). A leak of one tensor per step (a history
that grows, a saved tensor kept by a module) shows as +250 tensors here.
"""

from __future__ import annotations

import gc
import resource

import pytest
import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig
from tests.linear_utils import RECIPE_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny GEMMs: threads only add waiting

WARMUP, STEPS = 50, 300
TOLERANCE = 0.05


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rss_bytes() -> int:
    # Current resident set (Linux /proc), not the peak that getrusage reports.
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_memory_is_flat_over_300_steps(recipe):
    torch.manual_seed(0)
    # Telemetry on: its buffers are overwritten every step, never appended to.
    model = Float8Linear.from_float(nn.Linear(32, 32), Float8LinearConfig.from_recipe(recipe, collect_stats=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(16, 32)
    counts, rss = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if step + 1 in (WARMUP, STEPS):
            counts.append(_live_tensors())
            rss.append(_rss_bytes())
    assert counts[1] <= counts[0] * (1 + TOLERANCE), f"{recipe}: live tensors {counts[0]} -> {counts[1]}"
    assert rss[1] <= rss[0] * (1 + TOLERANCE), f"{recipe}: resident memory {rss[0]} -> {rss[1]} bytes"
