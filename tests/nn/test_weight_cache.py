"""Weight casts reused across the micro-batches of one optimizer step (issue 26):
``f8tensor.reuse_weight_casts``.

Inside the scope every layer casts its weight once per layout and serves those bytes to the
later micro-batches: the results are bitwise those of casting every time, and a cast is
never served after the weight changed (optimizer steps, fused ones included, which do not
bump version counters; in-place updates; reloads; a replaced tensor or config).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import f8tensor
from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training, reuse_weight_casts
from f8tensor.nn.weight_cache import weight_casts_of

REUSABLE = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
K = 128  # whole 1x128 / 128x128 blocks for every recipe


def _model(recipe: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, K, bias=False), nn.GELU(), nn.Linear(K, K, bias=True)).bfloat16()
    config = (
        Float8LinearConfig.from_recipe(recipe, **overrides) if overrides else Float8LinearConfig.from_recipe(recipe)
    )
    return convert_to_float8_training(model, config=config)


def _batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, K, generator=g).bfloat16() for _ in range(n)]


def _train(model: nn.Module, reuse: bool, steps: int = 3, fused: bool = False) -> nn.Module:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    for _ in range(steps):
        with reuse_weight_casts(model) if reuse else contextlib.nullcontext():
            for x in _batches():
                model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("recipe", REUSABLE + ("delayed",))
def test_accumulation_with_reused_casts_is_bitwise_the_same(recipe, fused):
    plain = _train(_model(recipe), reuse=False, fused=fused)
    reused = _train(_model(recipe), reuse=True, fused=fused)
    for (name, a), b in zip(plain.named_parameters(), reused.parameters()):
        assert torch.equal(a, b), f"{recipe}: {name} differs after 3 steps of 3 micro-batches"


@pytest.mark.parametrize("recipe", REUSABLE)
def test_each_weight_is_cast_once_per_layout_per_optimizer_step(recipe):
    model = _model(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    second = model[2]  # its grad_x is needed: the backward uses the weight too
    # A tensorwise weight serves grad_x with forward's bytes; the others are cast along the other axis.
    layouts = 1 if recipe == "tensorwise" else 2
    for _ in range(2):
        with reuse_weight_casts(model):
            for x in _batches(4):
                model(x).float().sum().backward()
            casts = weight_casts_of(second)
            assert casts is not None
            assert casts.misses == layouts, (
                f"{recipe}: cast {casts.misses} times for {layouts} layouts in 4 micro-batches"
            )
            assert casts.hits == 4 * 2 - layouts  # one forward and one backward look-up per micro-batch
        opt.step()
        opt.zero_grad()
    assert weight_casts_of(second) is None  # nothing survives the scope


@pytest.mark.parametrize("recipe", REUSABLE)
def test_a_later_micro_batch_runs_fewer_ops(recipe):
    model = _model(recipe)
    x = _batches(1)[0]
    with reuse_weight_casts(model):
        model(x).float().sum().backward()
        with _Ops() as first:
            model(x).float().sum().backward()
    with _Ops() as plain:
        model(x).float().sum().backward()
    # Two layers, each skipping its weight cast(s): at least 10 ops fewer per micro-batch.
    assert first.count <= plain.count - 10, (first.count, plain.count)


def _stale_after(update) -> None:
    """A forward after ``update`` inside the scope equals a fresh layer's forward (no stale cast)."""
    model = _model("tensorwise")
    x = _batches(1)[0]
    with reuse_weight_casts(model):
        model(x)  # fills the cache
        update(model)
        got = model(x)
    fresh = copy.deepcopy(model)  # outside any scope: casts from the current weights
    assert torch.equal(got, fresh(x))
    assert not torch.equal(got, _model("tensorwise")(x)), "the update changed nothing: the test would not see staleness"


def test_a_fused_optimizer_step_drops_the_casts():
    # Fused AdamW writes parameters without bumping their version counters: the step hook drops the casts.
    def step(model):
        opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        before = [p._version for p in model.parameters()]
        opt.step()
        assert [p._version for p in model.parameters()] == before  # the case the hook is there for

    _stale_after(step)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_casts_dropped_between_forward_and_backward_are_made_again(recipe):
    """Another optimizer's step between a forward and its backward (two models trained in
    turn) drops every cast of the scope: the backward makes its weight casts again, from
    the unchanged weight (a tensorwise one with the forward's scale), bit for bit the
    gradients of casting every time."""
    x = _batches(1)[0]

    def grads(reuse: bool) -> list[torch.Tensor]:
        model = _model(recipe)
        other = nn.Parameter(torch.ones(3))
        other.grad = torch.ones(3)
        opt = torch.optim.SGD([other], lr=0.1)
        xx = x.clone().requires_grad_()
        with reuse_weight_casts(model) if reuse else contextlib.nullcontext():
            y = model(xx)
            if reuse:
                assert len(weight_casts_of(model[2])) == 1  # forward's cast, about to be dropped
            opt.step()
            if reuse:
                assert len(weight_casts_of(model[2])) == 0
            y.float().pow(2).mean().backward()
        return [xx.grad, *(p.grad for p in model.parameters())]

    for got, want in zip(grads(reuse=True), grads(reuse=False)):
        assert torch.equal(got, want)


def test_an_in_place_update_drops_the_casts():
    def update(model):
        with torch.no_grad():
            model[0].weight.mul_(0.5)

    _stale_after(update)


def test_load_state_dict_drops_the_casts():
    def load(model):
        state = {k: v * 0.5 if k.endswith("weight") else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)

    _stale_after(load)


def test_a_replaced_weight_tensor_drops_the_casts():
    def replace(model):
        model[0].weight.data = model[0].weight.detach() * 0.5  # a new storage under the same Parameter

    _stale_after(replace)


def test_a_module_to_drops_the_casts():
    def to(model):
        model.float()
        model.bfloat16()
        with torch.no_grad():
            model[0].weight.mul_(0.5)

    _stale_after(to)


def test_a_replaced_config_casts_afresh():
    model = _model("tensorwise")
    x = _batches(1)[0]
    layer = model[0]
    with reuse_weight_casts(model):
        model(x)
        casts = weight_casts_of(layer)
        misses = casts.misses
        layer.set_collect_stats(True)  # a new config object
        model(x)
        assert casts.misses == misses + 1
        # The telemetry of the new config was measured by that fresh cast.
        assert f8tensor.float8_stats(model)["0/weight/amax"] == layer.weight.detach().abs().max().item()


@pytest.mark.parametrize(
    "recipe, overrides",
    [("delayed", {}), ("tensorwise", {"weight": f8tensor.CastConfig(rounding="stochastic")})],
    ids=["delayed", "stochastic-weight"],
)
def test_weights_whose_casts_differ_per_forward_are_not_cached(recipe, overrides):
    model = _model(recipe, **overrides)
    with reuse_weight_casts(model):
        for x in _batches(2):
            model(x).float().sum().backward()
        casts = weight_casts_of(model[0])
        assert casts is not None and casts.hits == 0 and casts.misses == 0 and len(casts) == 0


def test_the_scope_is_dropped_on_error_and_nests():
    model = _model("tensorwise")
    x = _batches(1)[0]
    with pytest.raises(RuntimeError, match="boom"), reuse_weight_casts(model):
        model(x)
        raise RuntimeError("boom")
    assert weight_casts_of(model[0]) is None
    with reuse_weight_casts(model):
        outer = weight_casts_of(model[0])
        with reuse_weight_casts(model):
            assert weight_casts_of(model[0]) is outer  # the inner scope shares the outer's entries
            model(x)
        assert weight_casts_of(model[0]) is outer and len(outer) == 1
    assert weight_casts_of(model[0]) is None
    with pytest.raises(TypeError, match="expects an nn.Module"), reuse_weight_casts("model"):  # type: ignore[arg-type]
        pass


def test_compiled_forward_ignores_the_scope():
    model = _model("tensorwise")
    x = _batches(1)[0]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    expected = model(x)
    with reuse_weight_casts(model):
        got = compiled(x)
        assert len(weight_casts_of(model[0])) == 0
    assert torch.equal(got, expected)


def test_activation_checkpointing_inside_the_scope():
    from torch.utils.checkpoint import checkpoint

    def run(model, reuse):
        with reuse_weight_casts(model) if reuse else contextlib.nullcontext():
            for x in _batches():
                checkpoint(model, x.requires_grad_(), use_reentrant=False).float().sum().backward()
        return [p.grad for p in model.parameters()]

    for a, b in zip(run(_model("rowwise"), False), run(_model("rowwise"), True)):
        assert torch.equal(a, b)


def test_a_float8_linear_outside_a_model():
    layer = Float8Linear(K, K, bias=False, config=Float8LinearConfig.from_recipe("tensorwise")).bfloat16()
    x = _batches(1)[0]
    with reuse_weight_casts(layer):
        a = layer(x)
        b = layer(x)
        assert weight_casts_of(layer).hits == 1
    assert torch.equal(a, b)


def test_hugging_face_conv1d_keys_on_its_parameter():
    # Float8Conv1D hands the product a fresh transposed view each forward: the cache keys on
    # the (in, out) Parameter itself, so the view's cast is reused, and dropped when it changes.
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    from f8tensor.nn.linear import Float8Conv1D

    torch.manual_seed(0)
    conv = pytorch_utils.Conv1D(K, K).bfloat16()
    layer = Float8Conv1D.from_conv1d(conv, Float8LinearConfig.from_recipe("rowwise"))
    x = _batches(1)[0]
    with reuse_weight_casts(layer):
        a = layer(x)
        b = layer(x)
        assert weight_casts_of(layer).hits == 1 and torch.equal(a, b)
        with torch.no_grad():
            layer.weight.mul_(0.5)
        c = layer(x)
    assert weight_casts_of(layer) is None
    assert torch.equal(c, layer(x)) and not torch.equal(a, c)
