"""per_step_weight_casts: each weight cast once per optimizer step, with the bits of a cast per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import f8tensor
from f8tensor import Float8LinearConfig, convert_to_float8_training, per_step_weight_casts
from f8tensor.nn.linear import Float8Linear


def _model(recipe: str = "tensorwise", **config) -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    return convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe(recipe, **config))


def _train(model: nn.Module, *, compiled: bool, precast: bool, steps: int = 3) -> list[torch.Tensor]:
    """Outputs of ``steps`` SGD steps, then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if precast:
        per_step_weight_casts(model, opt)
    run = torch.compile(model, fullgraph=True) if compiled else model
    torch.manual_seed(1)
    outs = []
    for _ in range(steps):
        y = run(torch.randn(2, 16, 64, dtype=torch.bfloat16))
        y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)  # compiled: 9 s, in CI's slow part
def test_training_is_bitwise_a_cast_per_call(compiled):
    want = _train(_model(), compiled=compiled, precast=False)
    got = _train(_model(), compiled=compiled, precast=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_the_buffers_hold_the_forward_cast_and_follow_the_optimizer():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    casts = per_step_weight_casts(model, opt)
    layer = model[0]
    assert casts.layers == [model[0], model[2]]
    assert "fp8_weight_data" not in layer.state_dict()  # non-persistent: checkpoints unchanged
    want = f8tensor.Float8Tensor.from_hp(layer.weight.detach())
    assert torch.equal(layer.fp8_weight_data, want._data) and torch.equal(
        layer.fp8_weight_scale, torch.stack([want._scale, want._scale.reciprocal()])
    )
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()  # the post hook recasts
    want = f8tensor.Float8Tensor.from_hp(layer.weight.detach())
    assert torch.equal(layer.fp8_weight_data, want._data) and torch.equal(
        layer.fp8_weight_scale, torch.stack([want._scale, want._scale.reciprocal()])
    )


def test_an_eager_forward_recasts_a_weight_changed_otherwise():
    model, plain = _model(), _model()
    per_step_weight_casts(model)  # no optimizer: refresh() is the caller's
    for m in (model, plain):
        with torch.no_grad():
            m[0].weight.mul_(3.0)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), plain(x))


@pytest.mark.slow  # 9 s of compiling
def test_a_compiled_forward_reads_the_cast_until_refresh():
    model, plain = _model(), _model()
    casts = per_step_weight_casts(model)
    run, run_plain = torch.compile(model, fullgraph=True), torch.compile(plain, fullgraph=True)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(run(x), run_plain(x))
    for m in (model, plain):
        with torch.no_grad():
            m[0].weight.mul_(3.0)
    assert not torch.equal(run(x), run_plain(x))  # the documented limit: the old cast
    casts.refresh()
    assert torch.equal(run(x), run_plain(x))


def test_load_state_dict_and_to_recast():
    model, source = _model(), _model()
    with torch.no_grad():
        source[0].weight.mul_(-2.0)
    per_step_weight_casts(model)
    model.load_state_dict(source.state_dict())
    want = f8tensor.Float8Tensor.from_hp(source[0].weight.detach())
    assert torch.equal(model[0].fp8_weight_data, want._data)
    model.to(torch.float32)
    want = f8tensor.Float8Tensor.from_hp(model[0].weight.detach())
    assert model[0].fp8_weight_data.dtype == torch.float8_e4m3fn
    assert torch.equal(model[0].fp8_weight_data, want._data) and torch.equal(model[0].fp8_weight_scale[0], want._scale)


def test_remove_restores_casts_per_call():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    casts = per_step_weight_casts(model, opt)
    casts.remove()
    assert "fp8_weight_data" not in dict(model[0].named_buffers())
    assert not f8tensor.nn.linear_autograd.planned(model[0]._plan_number).precast_weight
    plain = _model()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for m, step in ((model, opt), (plain, torch.optim.SGD(plain.parameters(), lr=0.5))):
        m(x).float().sum().backward()
        step.step()  # model's: the hook is gone, nothing recast
    assert "fp8_weight_data" not in dict(model[0].named_buffers())
    assert torch.equal(model(x), plain(x))  # cast per call, from the stepped weights


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"recipe": "rowwise"}, "not tensorwise dynamic"),
        ({"recipe": "delayed"}, "not tensorwise dynamic"),
        ({"recipe": "tensorwise", "collect_stats": True}, "telemetry"),
        ({"recipe": "tensorwise", "enable_fsdp_float8_all_gather": True}, "FP8-gathered"),
    ],
)
def test_layers_it_cannot_serve_are_refused_by_name_and_nothing_changes(config, why):
    model = _model(**config)
    with pytest.raises(ValueError, match=rf"cannot serve 0: .*{why}.*module_filter_fn"):
        per_step_weight_casts(model)
    assert not any("fp8_weight" in name for name, _ in model.named_buffers())
    kept = per_step_weight_casts(model, module_filter_fn=lambda module, fqn: False)
    assert kept.layers == []


def test_a_config_it_cannot_serve_is_refused_while_on():
    model = _model()
    per_step_weight_casts(model)
    with pytest.raises(ValueError, match="per_step_weight_casts serves this layer"):
        model[0].config = Float8LinearConfig.from_recipe("rowwise")
    assert isinstance(model[0], Float8Linear) and model[0].config == Float8LinearConfig.from_recipe("tensorwise")


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="expects an nn.Module; got list"):
        per_step_weight_casts([])
