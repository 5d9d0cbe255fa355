"""torch.compile(dynamic=True) of the block recipes: one graph for every token count.

Before, the padding check of ``gemm/blocks.py`` formatted the token count into its error
message before deciding to raise (pinning it: guard ``s0 == 15``), and ``scaling.py`` tested
block paddings as booleans: a compilation per token count, and after 8 the layer fell back
to eager. Token counts above the block size along the tokens (128 for blockwise, whose
weight-gradient operands are tiled 128 tokens long; 32 for MXFP8): a count that fits in one
block gives a block-count dim of 1, which torch's own stride rules specialize (as they do a
dim of 1 in the dense recipes).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from f8tensor import Float8Linear, Float8LinearConfig

TOKENS = (130, 144, 200, 256, 333)  # multiples of 16, 32 and 128, and none


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_one_compilation_for_every_token_count(recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Float8Linear.from_float(torch.nn.Linear(128, 64), Float8LinearConfig.from_recipe(recipe))
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(layer, backend=counter, dynamic=True)
    for tokens in TOKENS:
        x = torch.randn(tokens, 128)
        xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ye, yc = layer(xe), compiled(xc)
        assert torch.equal(ye, yc), f"{recipe} tokens={tokens}"  # measured: bitwise
        yc.sum().backward()
        ye.sum().backward()
        assert torch.equal(xe.grad, xc.grad), f"{recipe} tokens={tokens}: grad_x"
    assert counter.frame_count == 1
