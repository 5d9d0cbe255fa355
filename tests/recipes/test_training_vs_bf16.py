"""A small model trained for tens of steps per recipe ends where its bf16 twin does."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from f8tensor import Float8Linear

from linear_utils import RECIPE_NAMES, fp8_copy

STEPS = 40
# The final loss of the FP8 model may exceed or undercut its bf16 twin's by this fraction.
FINAL_LOSS_REL_TOL = 0.15
CLASSES = 16


class _ResidualClassifier(nn.Module):
    """Input projection, two pre-norm residual MLP blocks, a classification head."""

    def __init__(self, features: int = 32, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(2)
        )
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class _Task:
    """Classify 32 features by the argmax of a fixed random projection (learnable)."""

    def __init__(self, seed: int = 100) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.proj = torch.randn(32, CLASSES, generator=self.gen)
        self.train = [self.batch(16, 16) for _ in range(STEPS)]  # 3D inputs: (batch, seq, features)
        self.eval = self.batch(128, 16)

    def batch(self, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, s, 32, generator=self.gen)
        return x.to(torch.bfloat16), (x @ self.proj).argmax(-1)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def _train(model: nn.Module, task: _Task) -> float:
    """Train with AdamW; return the loss on held-out data."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for x, y in task.train:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        return _loss(model, *task.eval).item()


# Tiny GEMMs: extra threads only add synchronization (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task_and_twin():
    torch.manual_seed(0)
    task = _Task()
    model = _ResidualClassifier().to(torch.bfloat16)
    twin_loss = _train(copy.deepcopy(model), task)
    # The bf16 twin learns the task: well below chance (ln 16 = 2.77).
    assert twin_loss < 0.5 * math.log(CLASSES)
    return task, model, twin_loss


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_training_matches_bf16(recipe, task_and_twin):
    task, model, twin_loss = task_and_twin
    fp8 = fp8_copy(model, recipe)
    assert sum(isinstance(m, Float8Linear) for m in fp8.modules()) == 6
    loss = _train(fp8, task)
    assert loss < 0.5 * math.log(CLASSES), f"{recipe}: the FP8 model did not learn (held-out loss {loss:.3f})"
    assert abs(loss - twin_loss) <= FINAL_LOSS_REL_TOL * twin_loss, (
        f"{recipe}: final loss {loss:.4f} is not within {FINAL_LOSS_REL_TOL:.0%} of bf16's {twin_loss:.4f}"
    )
    assert all(p.dtype == torch.bfloat16 for p in fp8.parameters())
