"""Shared pieces of the Float8Linear tests: small models, the recipe list, comparisons."""

from __future__ import annotations

import copy

import torch
from torch import nn

from f8tensor import RECIPES, Float8Linear, Float8LinearConfig, convert_to_float8_training, sqnr

RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")
# The FP4 recipes have their own tests and thresholds (tests/recipes/test_fp4_training.py): the FP8
# suites' SQNR thresholds are FP8's.
FP4_RECIPE_NAMES = ("nvfp4", "mxfp4")
assert set(RECIPE_NAMES) | set(FP4_RECIPE_NAMES) == set(RECIPES), "a recipe was added: give it a place in the tests"

# The per-role buffers delayed scaling adds to a Float8Linear.
DELAYED_BUFFERS = (
    "amax_history_input",
    "amax_history_weight",
    "amax_history_grad_output",
    "scale_input",
    "scale_weight",
)


class MLP(nn.Module):
    """Two linears with a nonlinearity in between: ``dim -> hidden -> dim``."""

    def __init__(self, dim: int = 64, hidden: int = 128, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def fp8_copy(model: nn.Module, recipe: str, **overrides: object) -> nn.Module:
    """A converted deep copy of ``model`` (same initial weights)."""
    config = Float8LinearConfig.from_recipe(recipe, **overrides)
    return convert_to_float8_training(copy.deepcopy(model), config=config)


def fp8_linear(linear: nn.Linear, recipe: str, **overrides: object) -> Float8Linear:
    return Float8Linear.from_float(copy.deepcopy(linear), Float8LinearConfig.from_recipe(recipe, **overrides))


def run_fwd_bwd(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor | None = None):
    """Forward and backward with a fixed output gradient; returns ``(y, x.grad)``."""
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(torch.ones_like(y) if grad_out is None else grad_out)
    return y, x.grad


def assert_sqnr(reference: torch.Tensor, actual: torch.Tensor, min_db: float, what: str) -> float:
    """Fail unless ``sqnr(reference, actual) >= min_db``; NaN fails too."""
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    db = sqnr(reference.detach(), actual.detach())
    assert db >= min_db, f"{what}: SQNR {db:.2f} dB is below the {min_db} dB threshold"
    return db


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}
