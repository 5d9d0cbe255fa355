"""The converter's report is true (issue 24.5-24.7, issue 23.13, 23.17, 23.18).

Every layer reported FP8 is measured to run an FP8 product (a counter on ``Float8Linear``'s
forward, which adds no hook that could change the model's path); layers that would not are
skipped and reported; converting twice counts what is FP8; the model is checked before it
changes.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import warnings

import pytest
import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8tensor.moe import Float8ExpertWeight
from tests.helpers import RanFP8

pytestmark = pytest.mark.usefixtures("one_thread")


class _ViTBlock(nn.Module):
    """torchvision's ViT encoder block pattern: nn.MultiheadAttention + an MLP."""

    def __init__(self, d=32):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_every_reported_layer_runs_in_fp8(mode, monkeypatch, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(_ViTBlock(), nn.TransformerEncoderLayer(32, 2, 64, batch_first=True, dropout=0.0))
    ref_model = copy.deepcopy(model)
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model)
    # nn.MultiheadAttention runs its packed in-projection and its out_proj in FP8 (round 4):
    # both weights are reported, by parameter name, and the summary counts the attentions.
    assert "2 of 2 nn.MultiheadAttention (in- and out-projections, 4 weights" in caplog.text
    assert set(model.float8_converted_fqns) == {
        "0.mlp.0",
        "0.mlp.2",
        "1.linear1",
        "1.linear2",
        "0.self_attention.in_proj_weight",
        "0.self_attention.out_proj.weight",
        "1.self_attn.in_proj_weight",
        "1.self_attn.out_proj.weight",
    }
    counter = RanFP8(monkeypatch)
    x = torch.randn(2, 8, 32)
    if mode == "train":
        out = model(x)
    else:
        model.eval(), ref_model.eval()
        with torch.no_grad():
            out = model(x)
            ref = ref_model(x)
        assert not torch.equal(out, ref), "the FP8 layers change the result (the fused fast path is not taken)"
    assert counter.missing(model) == []


def test_already_converted_layers_are_counted_not_warned(caplog):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    config = Float8LinearConfig.from_recipe("rowwise")
    convert_to_float8_training(model, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level("INFO", logger="f8tensor"):
            again = convert_to_float8_training(model, config=config)
    assert "trains in high precision" not in caplog.text
    assert "2 layers or expert weights were already FP8" in caplog.text
    assert again.float8_converted_fqns == ("0", "2")


def test_a_second_recipe_is_refused_naming_the_layers():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"))
    with pytest.raises(ValueError, match=r"already FP8 with another recipe \[0, 1\]"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("tensorwise"))
    assert model[0].config == Float8LinearConfig.from_recipe("rowwise")


def test_delayed_recipe_without_experts_says_nothing_about_experts(caplog):
    model = nn.Sequential(nn.Linear(32, 32))
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("delayed"))
    assert "expert" not in caplog.text


class _LinearWithChildren(nn.Linear):
    def __init__(self):
        super().__init__(32, 32)
        self.adapter = nn.Linear(32, 16)
        self.register_buffer("mask", torch.ones(32))


def test_root_linear_keeps_its_children():
    model = _LinearWithChildren()
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    new = convert_to_float8_training(model)
    assert isinstance(new, Float8Linear) and isinstance(new, _LinearWithChildren)
    assert {n for n, _ in new.named_parameters()} | {n for n, _ in new.named_buffers()} == names
    assert isinstance(new.adapter, Float8Linear), "the children are converted too"
    assert set(new.float8_converted_fqns) == {"", "adapter"}


class _Sub(nn.Linear):
    pass


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
def test_converted_linear_subclasses_pickle(how):
    model = nn.Sequential(_Sub(32, 32), nn.ReLU(), _Sub(32, 16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"))
    x = torch.randn(4, 32)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copy_ = torch.load(buf, weights_only=False)
    elif how == "pickle":
        copy_ = pickle.loads(pickle.dumps(model))
    else:
        copy_ = copy.deepcopy(model)
    assert type(copy_[0]) is type(model[0]) and isinstance(copy_[0], _Sub)
    assert copy_[0].config == model[0].config
    assert torch.equal(copy_(x), model(x))


def test_filters_are_validated_before_the_model_changes():
    model = nn.Sequential(nn.Linear(32, 32))
    model.experts = nn.Module()
    model.experts.num_experts = 2
    model.experts.w = nn.Parameter(torch.randn(2, 32, 32))
    with pytest.raises(TypeError, match="experts_filter_fn must be a callable"):
        convert_to_float8_training(model, experts_filter_fn="experts")
    assert type(model[0]) is nn.Linear

    def boom(mod, fqn):
        raise RuntimeError("filter failed")

    with pytest.raises(RuntimeError, match="filter failed"):
        convert_to_float8_training(model, experts_filter_fn=boom)
    assert type(model[0]) is nn.Linear and type(model.experts.w) is nn.Parameter
    convert_to_float8_training(model)
    assert isinstance(model.experts.w, Float8ExpertWeight)


def test_converting_after_fully_shard_is_refused_naming_the_fix():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import free_port

    init = not dist.is_initialized()
    if init:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        fully_shard(model)
        with pytest.raises(ValueError, match="Convert first, then call fully_shard"):
            convert_to_float8_training(model)
        assert type(model[0]) is nn.Linear
    finally:
        if init:
            dist.destroy_process_group()


def test_report_logger_is_quiet_when_all_is_well(caplog):
    with caplog.at_level(logging.WARNING, logger="f8tensor"):
        convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)))
    assert caplog.text == ""


def test_one_recipe_per_layer_in_two_calls(caplog):
    """A second call with another recipe converts what its filter selects and leaves the
    layers FP8 with the first recipe alone (a tutorial runs delayed scaling everywhere but
    one dynamic layer); selecting one of those layers is refused by name."""
    rowwise, tensorwise = Float8LinearConfig.from_recipe("rowwise"), Float8LinearConfig.from_recipe("tensorwise")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    convert_to_float8_training(model, config=rowwise, module_filter_fn=lambda m, fqn: fqn != "1")
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model, config=tensorwise, module_filter_fn=lambda m, fqn: fqn == "1")
    assert [m.config for m in model] == [rowwise, tensorwise, rowwise]
    assert model.float8_converted_fqns == ("0", "2", "1")
    assert "2 FP8 with another recipe left as they are [0, 2]" in caplog.text
    with pytest.raises(ValueError, match=r"already FP8 with another recipe \[2\]"):
        convert_to_float8_training(model, config=tensorwise, module_filter_fn=lambda m, fqn: fqn == "2")
    assert model[2].config == rowwise
