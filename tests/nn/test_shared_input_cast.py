"""An input read by several FP8 linears (q/k/v, gate/up) is cast once in a compiled graph:
the casts are equal nodes, which AOTAutograd's CSE merges, so none of them may carry a
constant that compares unequal to itself (a NaN scalar did: NaN != NaN)."""

from __future__ import annotations

import pytest
import torch
from helpers import compiled_fp8_casts
from torch import nn

from f8tensor import Float8LinearConfig, convert_to_float8_training


class TwoReaders(nn.Module):
    """``a(x) + b(x)``, or ``a(x) + b(x2)`` (``x2`` an equal, separate input)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor, x2: torch.Tensor | None = None) -> torch.Tensor:
        return self.a(x) + self.b(x if x2 is None else x2)


def _fp8_casts(recipe: str, shared: bool) -> int:
    """FP8 casts in the forward and backward graphs inductor's partitioner gives (CSE on)."""
    torch.manual_seed(0)
    model = TwoReaders().to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    inputs = (x,) if shared else (x, x.detach().clone().requires_grad_(True))
    return sum(compiled_fp8_casts(model, *inputs))


# FP8 casts of one input: tensorwise one (both layouts from it), rowwise two (rows for the
# output, columns for the weight gradient).
@pytest.mark.parametrize(("recipe", "casts_of_x"), [("tensorwise", 1), ("rowwise", 2)])
def test_an_input_read_by_two_linears_is_cast_once(recipe, casts_of_x):
    assert _fp8_casts(recipe, shared=True) == _fp8_casts(recipe, shared=False) - casts_of_x
