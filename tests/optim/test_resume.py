"""Resume and faults, for every recipe (and an MoE model): a run saved and resumed continues
bit for bit; a fault (NaN/inf in the input, the loss gradient, or the weights after a step)
is never turned into finite numbers, never poisons the delayed-scaling state, and training
goes on once the fault is gone.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.moe import convert_experts_to_float8
from tests.linear_utils import RECIPE_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny GEMMs: threads only add waiting

STEPS = 3


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))


class _MoE(nn.Module):
    """A tiny MoE block: 4 experts with 3D weights, top-1 routing, grouped FP8 products."""

    def __init__(self, e: int = 4, h: int = 32, i: int = 32) -> None:
        super().__init__()
        self.num_experts = e
        self.router = nn.Linear(h, e)
        self.gate_up_proj = nn.Parameter(torch.randn(e, i, h) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.router(x).argmax(-1)
        order = ids.argsort()
        counts = torch.bincount(ids, minlength=self.num_experts)
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[order]
        h = F.gelu(torch._grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offs=offs))
        y = torch._grouped_mm(h, self.down_proj.transpose(-2, -1), offs=offs)
        return torch.empty_like(y).index_copy_(0, order, y)


def _moe(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = _MoE()
    convert_experts_to_float8(model, Float8LinearConfig.from_recipe(recipe))
    return model


def _data(dim: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, dim, generator=g) for _ in range(n)]


def _train(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_same_state(a: nn.Module, b: nn.Module, what: str) -> None:
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        va = va.to_hp() if hasattr(va, "to_hp") else va
        vb = vb.to_hp() if hasattr(vb, "to_hp") else vb
        torch.testing.assert_close(vb, va, rtol=0, atol=0, equal_nan=True, msg=f"{what}: {k} differs")


@pytest.mark.parametrize(
    "kind,recipe",
    [("dense", r) for r in RECIPE_NAMES] + [("moe", "tensorwise"), ("moe", "rowwise")],
)
def test_resume_is_bit_exact(kind, recipe):
    make, dim = (_model, 64) if kind == "dense" else (_moe, 32)
    data = _data(dim, 2 * STEPS)
    straight = make(recipe)
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    _train(straight, opt, data[:STEPS])
    saved = _roundtrip({"model": straight.state_dict(), "opt": opt.state_dict()})
    _train(straight, opt, data[STEPS:])

    resumed = make(recipe)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(resumed, opt2, data[STEPS:])
    _assert_same_state(straight, resumed, f"{kind}/{recipe}")


# ===================================================================== faults

FAULTS = ["input_nan", "input_inf", "grad_nan", "grad_inf", "weight_nan", "weight_inf"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_a_fault_shows_and_training_goes_on_once_it_is_gone(recipe, fault):
    model = _model(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = _data(64, 3)
    _train(model, opt, data[:1])
    good = copy.deepcopy(model.state_dict())
    bad = float("nan") if fault.endswith("nan") else float("inf")

    x = data[1].clone().requires_grad_(True)
    if fault.startswith("input"):
        x.data[2, 7] = bad
    if fault.startswith("weight"):
        with torch.no_grad():
            model[0].weight[5, 9] = bad
    y = model(x)
    g = torch.randn_like(y)
    if fault.startswith("grad"):
        g[4, 11] = bad
    y.backward(g)
    if not fault.startswith("grad"):
        assert not torch.isfinite(y).all(), f"{recipe}/{fault}: the output hides the fault"
    assert not torch.isfinite(x.grad).all(), f"{recipe}/{fault}: grad_input hides the fault"
    assert not torch.isfinite(model[0].weight.grad).all(), f"{recipe}/{fault}: grad_weight hides the fault"
    # The delayed-scaling state never holds a non-finite number.
    for name, buf in model.named_buffers():
        if "amax_history" in name or name.endswith(("scale_input", "scale_weight")):
            assert torch.isfinite(buf).all(), f"{recipe}/{fault}: {name} poisoned"

    # The fault is gone (weights restored): the next steps are finite.
    model.load_state_dict(good)
    opt.zero_grad()
    y = model(data[2])
    y.square().mean().backward()
    assert torch.isfinite(y).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())
