"""per_step_weight_casts: each weight cast once per optimizer step, with the bits of a cast per call."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import f8tensor
from f8tensor import Float8LinearConfig, convert_to_float8_training, per_step_weight_casts
from f8tensor.nn.linear import Float8Linear


def _model(recipe: str = "tensorwise", **config) -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    return convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe(recipe, **config))


def _train(
    model: nn.Module, *, compiled: bool, precast: bool, steps: int = 3, checkpointed: bool = False
) -> list[torch.Tensor]:
    """Outputs of ``steps`` SGD steps, then the parameters and buffers (delayed scaling's state)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if precast:
        per_step_weight_casts(model, opt)
    run = torch.compile(model, fullgraph=True) if compiled else model
    if checkpointed:  # forward run again in backward, with the recorded scales
        run = functools.partial(torch.utils.checkpoint.checkpoint, model, use_reentrant=False)
    torch.manual_seed(1)
    outs = []
    for _ in range(steps):
        y = run(torch.randn(2, 16, 64, dtype=torch.bfloat16))
        y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    kept = [t.detach().clone() for t in model.parameters()]
    return outs + kept + [b.clone() for name, b in model.named_buffers() if "fp8_weight" not in name]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)  # compiled: 9 s each, in CI's slow part
def test_training_is_bitwise_a_cast_per_call(compiled, recipe):
    want = _train(_model(recipe), compiled=compiled, precast=False)
    got = _train(_model(recipe), compiled=compiled, precast=True)
    assert len(want) == (10 if recipe == "delayed" else 6)  # 3 outputs, 3 parameters, delayed: 2 buffers each
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_checkpointed_delayed_step_is_bitwise_a_cast_per_call():
    want = _train(_model("delayed"), compiled=False, precast=False, checkpointed=True)
    got = _train(_model("delayed"), compiled=False, precast=True, checkpointed=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_delayed_weight_keeps_its_step_scale_over_micro_batches_and_pushes_each_amax():
    def two_micro_batches(precast: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        model = _model("delayed")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if precast:
            per_step_weight_casts(model, opt)
        torch.manual_seed(1)
        scales = []
        for _ in range(2):  # one optimizer step, two micro-batches
            model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            scales.append(model[0].scale_weight.clone())
        return scales, model[0].amax_history_weight.clone()

    per_call, history = two_micro_batches(precast=False)
    per_step, history_per_step = two_micro_batches(precast=True)
    assert not torch.equal(per_call[0], per_call[1])  # a cast per call: the first push moved it
    assert torch.equal(per_step[0], per_call[0]) and torch.equal(per_step[1], per_step[0])  # the step's scale
    assert torch.equal(history_per_step, history) and int((history > 0).sum()) == 2  # both amaxes pushed


def test_a_delayed_weight_is_recast_from_a_loaded_history():
    model, source = _model("delayed"), _model("delayed")
    with torch.no_grad():
        source[0].amax_history_weight.fill_(0.25)
    per_step_weight_casts(model)
    model.load_state_dict(source.state_dict())
    scale = model[0].fp8_weight_scale
    assert scale.shape == (3,) and torch.equal(scale[0], torch.tensor(448.0 / 0.25))
    assert torch.equal(scale[1], scale[0].reciprocal())
    assert torch.equal(scale[2], model[0].weight.detach().abs().max().float())  # pushed by the next backward
    want = f8tensor.Float8Tensor.from_hp(model[0].weight.detach(), scale=scale[0])
    assert torch.equal(model[0].fp8_weight_data.view(torch.uint8), want._data.view(torch.uint8))


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


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_recast_writes_the_buffers_in_place(recipe):
    # A compiled forward or a captured CUDA graph keeps reading the buffers it first saw.
    model = _model(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    casts = per_step_weight_casts(model, opt)
    buffers = [b for layer in casts.layers for b in (layer.fp8_weight_data, layer.fp8_weight_scale)]
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()  # recasts
    casts.refresh()
    after = [b for layer in casts.layers for b in (layer.fp8_weight_data, layer.fp8_weight_scale)]
    assert all(a is b for a, b in zip(after, buffers)) and len(after) == 4


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
        ({"recipe": "rowwise"}, "not tensorwise with nearest rounding"),
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


@pytest.mark.parametrize("new", ["delayed", "power_of_2_scale"])
def test_a_new_config_recasts(new):
    model, plain = _model(), _model("delayed" if new == "delayed" else "tensorwise")
    if new == "power_of_2_scale":
        config = plain[0].config
        plain[0].config = plain[2].config = dataclasses.replace(
            config, weight=dataclasses.replace(config.weight, power_of_2_scale=True)
        )
    per_step_weight_casts(model)
    model[0].config = model[2].config = plain[0].config  # cast again (delayed: a third scale slot)
    assert model[0].fp8_weight_scale.shape == (3 if new == "delayed" else 2,)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), plain(x))


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="expects an nn.Module; got list"):
        per_step_weight_casts([])
