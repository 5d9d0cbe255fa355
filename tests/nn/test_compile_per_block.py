"""The end-to-end benchmark's compile pattern, at a tiny size: each transformer block of the
Llama-style model (benchmarks/_models.py) compiled on its own with
``block.compile(dynamic=False)``, embedding, final norm and output head eager, an AdamW step
between training steps.

What makes that pattern fast on a GPU, checked per FP8 recipe on CPU: no graph break in a
block (a break runs the rest of the block eagerly, with eager's per-op host cost), one
compile shared by every block and every step (no guard on a layer's identity, a step
counter or buffer state), and no device->host read (``aten::_local_scalar_dense``) in the
model's forward or backward. The optimizer's ``.item()`` calls (AdamW reading its CPU step
counters) are torch's and the same for every recipe: not counted here.

Measured (torch 2.13 CPU, 2 blocks, 2 and 3 steps, aot_eager and inductor): bf16,
tensorwise and rowwise each 1 frame, 0 graph breaks, 0 recompiles, 0 reads in the model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from f8tensor import Float8LinearConfig, convert_to_float8_training

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _models as M

# The e2e model's shape at a CPU size: dims multiples of 16, grouped-query attention, 2 blocks.
CFG = M.LlamaConfig(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32, batch=2, lr=1e-3)
STEPS = 2
# Ops that make the host wait for the device (on a GPU): a scalar read, a data-dependent shape.
HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(recipe: str) -> M.Llama:
    model = M.build_model(CFG, torch.device("cpu"))
    if recipe != "bf16":
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=M.fp8_filter)
    return model


def _host_reads_in_model_step(model: M.Llama, tokens: torch.Tensor) -> dict[str, int]:
    """The host-read ops of one forward and backward of ``model`` (no optimizer step)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    reads: dict[str, int] = {}
    for event in prof.events():
        if event.name in HOST_READS:
            reads[event.name] = reads.get(event.name, 0) + 1
    return reads


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_blocks_compiled_one_by_one_share_one_graph(recipe):
    model = _model(recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for block in model.layers:
        block.compile(backend=counter, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=CFG.lr)
    batches = M.synthetic_batches(CFG, STEPS + 1, torch.device("cpu"))
    for step in range(STEPS):
        loss = model(batches[step][:, :-1], batches[step][:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.isfinite(loss), f"{recipe}: step {step} loss {loss.item()}"
        # One compile for the block type: the second block and every later step reuse it.
        assert counter.frame_count == 1, f"{recipe}: {counter.frame_count} compiles after step {step}"
    breaks = dict(counters["graph_break"])
    assert not breaks, f"{recipe}: graph breaks in a block: {breaks}"
    recompiles = dict(counters["recompiles"])
    assert not recompiles, f"{recipe}: recompiles: {recompiles}"
    assert counter.op_count > 0
    reads = _host_reads_in_model_step(model, batches[STEPS])
    assert not reads, f"{recipe}: device->host reads in the compiled model's step: {reads}"
    assert counter.frame_count == 1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_eager_model_step_reads_nothing_back(recipe):
    """The same model uncompiled: the FP8 linears' forward and backward never read a value
    back to the host (a scale or amax checked with ``.item()`` would stall a GPU per layer)."""
    model = _model(recipe)
    tokens = M.synthetic_batches(CFG, 1, torch.device("cpu"))[0]
    reads = _host_reads_in_model_step(model, tokens)
    assert not reads, f"{recipe}: device->host reads in the eager model's step: {reads}"
