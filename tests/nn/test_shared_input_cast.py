"""An input read by several FP8 linears (q/k/v, gate/up) is cast once in a compiled graph:
the casts are equal nodes, which AOTAutograd's CSE merges, so none of them may carry a
constant that compares unequal to itself (a NaN scalar did: NaN != NaN)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from f8tensor import Float8LinearConfig, convert_to_float8_training

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    count = 0

    def compiler(gm: torch.fx.GraphModule, _):
        nonlocal count
        for node in gm.graph.nodes:
            count += node.target is torch.ops.aten._to_copy.default and node.kwargs.get("dtype") in FP8
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    inputs = (x,) if shared else (x, x.detach().clone().requires_grad_(True))
    torch.compile(model, backend=backend, fullgraph=True)(*inputs).sum().backward()
    return count


# FP8 casts of one input: tensorwise one (both layouts from it), rowwise two (rows for the
# output, columns for the weight gradient).
@pytest.mark.parametrize(("recipe", "casts_of_x"), [("tensorwise", 1), ("rowwise", 2)])
def test_an_input_read_by_two_linears_is_cast_once(recipe, casts_of_x):
    assert _fp8_casts(recipe, shared=True) == _fp8_casts(recipe, shared=False) - casts_of_x
