"""Float8Linear's autocast probe under torch.compile: nothing dynamo cannot trace.

torch 2.11's dynamo cannot trace ``torch.amp.is_autocast_available`` (a C builtin there):
the GPU campaign's rehearsal on torch 2.11 saw every ``fullgraph=True`` compile of a
Float8Linear fail on it, and a non-fullgraph one break its graph there. This test makes the
probe untraceable on any torch version and checks that compiling never calls it.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from f8tensor import Float8Linear


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no_autocast"])
def test_fullgraph_compile_does_not_ask_whether_autocast_exists(monkeypatch, autocast):
    untraceable = torch._dynamo.disable(torch.amp.is_autocast_available)
    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    layer = Float8Linear.from_float(nn.Linear(64, 32))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = compiled(x)
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
    y.float().sum().backward()
    assert counter.frame_count == 1
    assert x.grad.shape == x.shape and layer.weight.grad.dtype == torch.float32
