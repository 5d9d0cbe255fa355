"""accelerate (``pip install accelerate``): an FP8 model prepared by ``Accelerator`` on CPU
trains, and ``save_state`` / ``load_state`` resume it (dense and MoE expert weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate", reason="pip install accelerate (or pip install 'f8tensor[integrations]')")
from accelerate import Accelerator

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8tensor.moe import Float8ExpertWeight

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate_state")


class _Experts(nn.Module):
    """Two experts multiplied as transformers' eager implementation does: F.linear(x, w[e])."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.w = nn.Parameter(torch.randn(2, 32, 32) * 0.1)

    def forward(self, x):
        half = x.shape[0] // 2
        return torch.cat([nn.functional.linear(x[:half], self.w[0]), nn.functional.linear(x[half:], self.w[1])])


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_accelerator_trains_and_resumes(recipe, tmp_path):
    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), _Experts(), nn.Linear(32, 16))
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
        acc = Accelerator(cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return acc, *acc.prepare(model, opt)

    data = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def step(acc, model, opt, x):
        loss = model(x).float().pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    acc, model, opt = setup()
    assert isinstance(model[0], Float8Linear)
    assert isinstance(model[2].w, Float8ExpertWeight) == (recipe != "delayed")
    for x in data[:2]:
        step(acc, model, opt, x)
    acc.save_state(tmp_path)
    for x in data[2:]:
        step(acc, model, opt, x)
    acc2, model2, opt2 = setup()
    acc2.load_state(tmp_path)
    for x in data[2:]:
        step(acc2, model2, opt2, x)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
