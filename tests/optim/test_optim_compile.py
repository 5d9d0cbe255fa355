"""f8tensor.optim.AdamW inside a ``torch.compile``d training step (forward, backward and the
optimizer step in one compiled function), against the same step run eagerly.

Under compilation the optimizer takes its torch-ops path (the fused kernel is for eager
CUDA tensors), traced whole: the step counter stays a tensor (no host read, no graph
break; ``test_optim_compiled_step.py`` counts the graphs). The ``aot_eager`` backend traces
what inductor would receive, at a fraction of the compile time, and runs it with the
eager kernels, except the fused multiply-adds the traced step spells out for inductor
(ATen's CPU lerp and addcmul round once; the ``inductor_prims.fma`` op run eagerly rounds
twice): the last bits differ from the first step on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from f8tensor.optim import AdamW

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _train(state_dtype: torch.dtype, compiled: bool, steps: int = 3):
    torch.manual_seed(0)
    # One 4 x 32 weight (128 elements: FP8 moments, one block per row) and its bias (fp32
    # moments): two tensors, so dynamo's per-parameter specializations stay few.
    model = nn.Linear(32, 4)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype, fused=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)

    def step() -> torch.Tensor:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    fn = torch.compile(step, backend="aot_eager") if compiled else step
    losses = [fn() for _ in range(steps)]
    return model, opt, losses


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    noise = (got - want).pow(2).sum()
    return float("inf") if noise == 0 else (10 * torch.log10(want.pow(2).sum() / noise)).item()


@pytest.mark.parametrize(
    "state_dtype, min_db",
    # Parameters after 3 steps, compiled vs eager (weight, bias): measured 153.8 / 149.9 dB
    # (FP8 moments; the bias has fp32 ones) and 158.2 / 154.4 dB (fp32 moments) on one CPU,
    # 147.5 / 157.9 and 145.8 / 145.8 on another. Not bit for bit: the traced step's fused
    # multiply-adds (lerp, addcmul) round twice when run by this backend (see the module
    # docstring; inductor rounds them once, as the eager kernels do); the last bits differ
    # after the first step and move the next steps' gradients. The bound: a few fp32 ulps
    # (one ulp on every element is 144.5 dB; five, 130.5); a wrong moment costs far more.
    [(FP8, 130.0), (torch.float32, 130.0)],
    ids=["fp8", "fp32"],
)
def test_compiled_training_step_matches_eager(state_dtype, min_db):
    torch._dynamo.reset()
    eager, eager_opt, eager_losses = _train(state_dtype, compiled=False)
    model, opt, losses = _train(state_dtype, compiled=True)
    assert torch.equal(losses[0], eager_losses[0])  # the same first forward
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert _sqnr_db(p, q) >= min_db, _sqnr_db(p, q)
        state, want = opt.state[p], eager_opt.state[q]
        assert state.keys() == want.keys()
        assert torch.equal(state["step"], want["step"])
        if state_dtype == FP8 and p.dim() == 2:
            assert state["exp_avg"].dtype == FP8 and state["exp_avg_scale"].shape == (4, 1)
