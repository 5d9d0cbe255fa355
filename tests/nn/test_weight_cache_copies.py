"""``f8tensor.reuse_weight_casts``: copies of a model and writes by ``torch.distributed``.

A copy of the model made inside the scope (``copy.deepcopy``, ``torch.save`` of the whole
module, ``pickle``) must not carry the scope's casts: it would serve them forever, after its
own weights changed (an EMA copy updated through ``.data``), and a whole-model checkpoint
would hold the FP8 bytes. A collective that writes a weight in place (``dist.broadcast``,
``dist.scatter``, ...) bumps no version counter; the scope must still see the write.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from f8tensor import Float8LinearConfig, convert_to_float8_training, reuse_weight_casts
from tests.helpers import free_port, init_gloo, run_processes

K = 32


def _model(recipe: str = "tensorwise") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, K, bias=False), nn.GELU(), nn.Linear(K, K))
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))


def _x() -> torch.Tensor:
    return torch.randn(8, K, generator=torch.Generator().manual_seed(1))


def _fresh_output(model: nn.Module, recipe: str) -> torch.Tensor:
    """What ``model``'s current weights give, cast afresh (a new model that never saw a scope)."""
    fresh = _model(recipe)
    fresh.load_state_dict(model.state_dict())
    return fresh(_x())


def _ema_update(ema: nn.Module, model: nn.Module, decay: float = 0.5) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.data.mul_(decay).add_(p.data.neg(), alpha=1 - decay)  # moves every weight


def _deepcopy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def _torch_save(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _pickle(model: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(model))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("make_copy", [_deepcopy, _torch_save, _pickle], ids=["deepcopy", "torch_save", "pickle"])
def test_a_copy_made_in_the_scope_casts_its_own_weights(make_copy, recipe):
    model = _model(recipe)
    with reuse_weight_casts(model):
        model(_x()).sum().backward()  # every layer now holds its weight's casts
        ema = make_copy(model)
        _ema_update(ema, model)  # through .data, which the scope cannot see: the copy is not in it
        inside = ema(_x())
        assert torch.equal(inside, _fresh_output(ema, recipe)), "a copy made in the scope served its old casts"
    _ema_update(ema, model)
    # Before the fix the copy kept serving the casts it was made with, forever.
    assert torch.equal(ema(_x()), _fresh_output(ema, recipe)), "a copy served casts of its old weights after the scope"


def test_a_whole_model_checkpoint_holds_no_fp8_casts():
    model = _model()
    outside = io.BytesIO()
    torch.save(model, outside)
    with reuse_weight_casts(model):
        model(_x()).sum().backward()
        inside = io.BytesIO()
        torch.save(model, inside)
    # Before the fix the checkpoint taken in the scope also pickled each layer's FP8 casts.
    assert len(inside.getvalue()) == len(outside.getvalue())
    loaded = torch.load(io.BytesIO(inside.getvalue()), weights_only=False)
    assert all("_f8tensor_weight_casts" not in m.__dict__ for m in loaded.modules())


# ------------------------------------------------------------------ torch.distributed writes


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _scatter(weight: torch.Tensor, new: torch.Tensor) -> None:
    dist.scatter(weight, [new], src=0)


def _all_gather_into_tensor(weight: torch.Tensor, new: torch.Tensor) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(weight.view(-1), new.reshape(-1))


def _scatter_into_flat_view(weight: torch.Tensor, new: torch.Tensor) -> None:
    dist.scatter(weight.view(-1), [new.reshape(-1)], src=0)  # a view: same storage, other tensor


@pytest.mark.parametrize("write", [_scatter, _all_gather_into_tensor, _scatter_into_flat_view])
def test_a_weight_written_by_a_collective_is_cast_again(world_of_one, write):
    model = _model()
    layer = model[0]
    with reuse_weight_casts(model):
        model(_x()).sum().backward()
        version = layer.weight._version
        with torch.no_grad():
            write(layer.weight, torch.randn(K, K, generator=torch.Generator().manual_seed(5)))
        assert layer.weight._version == version  # c10d writes bump no version counter
        # Before the fix the cast of the old weight was served.
        assert torch.equal(model(_x()), _fresh_output(model, "tensorwise"))
    # The watch is gone with the scope: collectives run as before.
    dist.broadcast(layer.weight.data, src=0)


def _broadcast_rank(rank: int, port: int) -> None:
    init_gloo(rank, 2, port)
    try:
        torch.manual_seed(rank)  # the ranks start with different weights
        model = convert_to_float8_training(
            nn.Sequential(nn.Linear(K, K)), config=Float8LinearConfig.from_recipe("tensorwise")
        )
        x = _x()
        with reuse_weight_casts(model):
            model(x).sum().backward()
            for p in model.parameters():
                dist.broadcast(p, src=0)  # in place on the parameter, as DDP's start does
            y = model(x).detach()
        gathered = [torch.empty_like(y) for _ in range(2)]
        dist.all_gather(gathered, y)
        # Before the fix rank 1 computed with its own (old) weight's cast.
        assert torch.equal(gathered[0], gathered[1]), f"rank {rank}: a broadcast weight was served from its old cast"
    finally:
        dist.destroy_process_group()


def test_a_weight_broadcast_from_another_rank_is_cast_again():
    run_processes(_broadcast_rank, 2, (free_port(),), timeout_s=180)
